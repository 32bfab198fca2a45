package vendorclients

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/shaper-dev/shaper/internal/redistest"
	"github.com/shaper-dev/shaper/shaper"
)

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
		{"https://api.example/stores/{account}/v1", "..", "", false},
		{"https://api.example/stores/{account}/v1", ".", "", false},
		{"https://api.example/stores/{account}", "..", "", false},
		{"https://api.example/{account}", "..", "", false},
		{"https://api.example/stores/{account}/v1", "", "", false},
		{"https://api.example/stores/{account}/v1", "...", "https://api.example/stores/.../v1", true},
		{"https://api.example/stores/{account}/v1", "%2e%2e", "https://api.example/stores/%252e%252e/v1", true},
		{"https://api.example/stores/{account}/v1", "../x", "", false},
		{"https://api.example/stores/{account}/v1", "a/../b", "", false},
		{"https://api.example/stores/{account}/v1", "a/./b", "", false},
	} {
		got, err := AccountBaseURL(tt.base, tt.account)
		if (err == nil) != tt.ok || got != tt.want {
			t.Errorf("AccountBaseURL(%q, %q) = %q, %v; want %q, ok %v", tt.base, tt.account, got, err, tt.want, tt.ok)
		}
		if err != nil && !strings.HasPrefix(tt.base, "https://{account}") && tt.account != "" && !errors.Is(err, ErrBadPath) {
			t.Errorf("AccountBaseURL(%q, %q) = %v, want ErrBadPath", tt.base, tt.account, err)
		}
	}
}

// TestDotAccountNeverReachesTheVendor: where {account} is put in
// base_url, whatever let the account through before: a real vendor
// (httptest) with base_url .../stores/{account}/api receives the calls
// of account store-1 under /stores/store-1/api, and no request at all
// for the accounts "." and "..", whose clients are refused with
// ErrBadPath naming the account.
func TestDotAccountNeverReachesTheVendor(t *testing.T) {
	var mu sync.Mutex
	var seen []string
	vendor := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		mu.Lock()
		seen = append(seen, r.RequestURI)
		mu.Unlock()
	}))
	defer vendor.Close()
	gate := shaper.NewGate(redistest.Client(t), shaper.Config{KeyPrefix: redistest.Prefix(t)})
	c, err := New(Endpoint{Name: "shop", BaseURL: vendor.URL + "/stores/{account}/api"}, nil, Options{})
	if err != nil {
		t.Fatal(err)
	}
	for i, account := range []string{"store-1", ".", ".."} {
		bucket, err := gate.Bucket(fmt.Sprintf("shop-%d", i), shaper.Policy{Limits: []shaper.Limit{{Rate: 50, Window: time.Second}}})
		if err != nil {
			t.Fatal(err)
		}
		ac, err := c.ForAccount(account, bucket)
		if account != "store-1" {
			if !errors.Is(err, ErrBadPath) || !strings.Contains(err.Error(), `"`+account+`"`) {
				t.Errorf("ForAccount(%q) = %v, want ErrBadPath naming the account", account, err)
			}
			if err != nil {
				continue
			}
		} else if err != nil {
			t.Fatal(err)
		}
		req, err := ac.NewRequest(context.Background(), http.MethodGet, "/orders", nil)
		if err != nil {
			t.Fatal(err)
		}
		resp, err := ac.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		_, _ = io.Copy(io.Discard, resp.Body)
		resp.Body.Close()
	}
	mu.Lock()
	defer mu.Unlock()
	if len(seen) != 1 || seen[0] != "/stores/store-1/api/orders" {
		t.Errorf("the vendor received %q, want only /stores/store-1/api/orders (never /stores/../ or /stores/./)", seen)
	}
}
