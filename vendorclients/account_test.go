package vendorclients

import "testing"

func TestAccountBaseURL(t *testing.T) {
	for _, tt := range []struct {
		base, account, want string
		ok                  bool
	}{
		{"https://api.example/v1", "store-42", "https://api.example/v1", true},
		{"https://api.example/stores/{account}", "store-42", "https://api.example/stores/store-42", true},
		{"https://api.example/stores/{account}/v1", "a b/c", "https://api.example/stores/a%20b%2Fc/v1", true},
		{"https://{account}.api.example/v1", "store-42", "https://store-42.api.example/v1", true},
		{"https://{account}.api.example", "store-42", "https://store-42.api.example", true},
		{"https://{account}.api.example/", "Store_42", "", false},
		{"https://{account}.api.example/", "store.42", "", false},
	} {
		got, err := AccountBaseURL(tt.base, tt.account)
		if (err == nil) != tt.ok || got != tt.want {
			t.Errorf("AccountBaseURL(%q, %q) = %q, %v; want %q, ok %v", tt.base, tt.account, got, err, tt.want, tt.ok)
		}
	}
}
