package vendorclients

import (
	"errors"
	"net/http"
	"net/url"
	"path"
	"strings"
	"testing"
	"time"
)

func TestParseRetryAfter(t *testing.T) {
	now := time.Date(2026, 11, 30, 12, 0, 0, 0, time.UTC)
	tests := []struct {
		in     string
		want   time.Duration
		wantOK bool
	}{
		{"0", 0, true},
		{"7", 7 * time.Second, true},
		{" 120 ", 2 * time.Minute, true},
		{"-1", 0, false},
		{"1.5", 0, false},
		{"soon", 0, false},
		{"", 0, false},
		{now.Add(90 * time.Second).Format(http.TimeFormat), 90 * time.Second, true},
		{now.Add(-time.Hour).Format(http.TimeFormat), 0, true}, // a past date means now
		{"Sun, 06 Nov 1994 08:49:37 GMT", 0, true},
		{"Sunday, 06-Nov-94 08:49:37 GMT", 0, true}, // RFC 850
		{"99999999999999999999", 0, false},          // overflows int64
	}
	for _, tt := range tests {
		got, ok := ParseRetryAfter(tt.in, now)
		if got != tt.want || ok != tt.wantOK {
			t.Errorf("ParseRetryAfter(%q) = %v, %v; want %v, %v", tt.in, got, ok, tt.want, tt.wantOK)
		}
	}
}

func FuzzParseRetryAfter(f *testing.F) {
	for _, s := range []string{"0", "120", "-5", "Wed, 21 Oct 2015 07:28:00 GMT", "garbage", "9223372036854775807"} {
		f.Add(s)
	}
	now := time.Now()
	f.Fuzz(func(t *testing.T, s string) {
		d, ok := ParseRetryAfter(s, now)
		if d < 0 {
			t.Errorf("ParseRetryAfter(%q) = %v, negative", s, d)
		}
		if !ok && d != 0 {
			t.Errorf("ParseRetryAfter(%q) not ok but %v", s, d)
		}
	})
}

func TestCheckPath(t *testing.T) {
	good := []string{"/", "/orders", "/orders/1042?expand=lines", "/a/b/", "/a%20b", "/v1/items;matrix"}
	bad := []string{"", "orders", "//evil.example/x", "https://evil.example/x", "/a/../b", "/..", "/a/./b",
		"/a/%2e%2e/b", "/a/%2E%2E", "/a\\b", "/a\nb", "/%zz"}
	for _, p := range good {
		if err := CheckPath(p); err != nil {
			t.Errorf("CheckPath(%q) = %v, want ok", p, err)
		}
	}
	for _, p := range bad {
		if err := CheckPath(p); !errors.Is(err, ErrBadPath) {
			t.Errorf("CheckPath(%q) = %v, want ErrBadPath", p, err)
		}
	}
}

// FuzzCheckPath: a path CheckPath accepts, joined to a base_url, and an
// account AccountBaseURL accepts, put for {account}, never leave the base
// URL (the account's part of it).
func FuzzCheckPath(f *testing.F) {
	for _, s := range []string{"/orders", "/a/../b", "//h/x", "/a/%2e%2e/b", "/x?y=z", "/stores/../api", "/.%2e/x", "/%2E/"} {
		f.Add(s, "store-42")
	}
	for _, a := range []string{".", "..", "...", "%2e%2e", "%2E.", "a/../b", "../x", "a%2Fb", `..\`, ".\x00", "a..b", ""} {
		f.Add("/orders", a)
	}
	c := &Client{}
	var err error
	c.base, err = parseBase("https://api.example.com/v1")
	if err != nil {
		f.Fatal(err)
	}
	const perAccount = "https://api.example.com/stores/{account}/v1"
	f.Fuzz(func(t *testing.T, p, account string) {
		if raw, err := AccountBaseURL(perAccount, account); err == nil {
			u, err := url.Parse(raw)
			want := "/stores/" + url.PathEscape(account) + "/v1"
			if err != nil || u.Host != "api.example.com" || u.EscapedPath() != want || !strings.HasPrefix(path.Clean(u.Path), "/stores/") {
				t.Errorf("account %q left the base URL: %s (want the path %s)", account, raw, want)
			}
			for _, seg := range strings.Split(u.Path, "/") {
				if seg == "." || seg == ".." {
					t.Errorf("account %q: %s has a %q segment", account, raw, seg)
				}
			}
		}
		if CheckPath(p) != nil {
			return
		}
		u, err := c.URL(p)
		if err != nil {
			t.Fatalf("CheckPath accepted %q but URL failed: %v", p, err)
		}
		if u.Scheme != "https" || u.Host != "api.example.com" || !strings.HasPrefix(u.Path, "/v1/") && u.Path != "/v1" {
			t.Errorf("path %q left the base URL: %s", p, u)
		}
	})
}

func TestURLJoinsBase(t *testing.T) {
	c := &Client{}
	c.base, _ = parseBase("https://api.example.com/v1/")
	for p, want := range map[string]string{
		"/orders":         "https://api.example.com/v1/orders",
		"/orders/?page=2": "https://api.example.com/v1/orders/?page=2",
		"/":               "https://api.example.com/v1/",
	} {
		u, err := c.URL(p)
		if err != nil || u.String() != want {
			t.Errorf("URL(%q) = %v, %v; want %s", p, u, err, want)
		}
	}
}
