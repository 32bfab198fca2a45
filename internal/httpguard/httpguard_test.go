package httpguard

import (
	"context"
	"net"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"
)

// TestCheckHost: which Host a server on an address answers, table by
// table: loopback names for a loopback address, the address itself
// otherwise, anything on a wildcard address with a token, and the
// connection's own address when the server's is not given.
func TestCheckHost(t *testing.T) {
	for _, tc := range []struct {
		addr, host string
		anyHost    bool
		local      string // the connection's local address ("": none)
		ok         bool
	}{
		{"127.0.0.1:8080", "127.0.0.1:8080", false, "", true},
		{"127.0.0.1:8080", "localhost:8080", false, "", true},
		{"127.0.0.1:8080", "LOCALHOST:8080", false, "", true},
		{"127.0.0.1:8080", "[::1]:8080", false, "", true},
		{"127.0.0.1:8080", "127.0.0.2:8080", false, "", true},
		{"localhost:8080", "127.0.0.1:8080", false, "", true},
		{"[::1]:8080", "localhost:8080", false, "", true},
		{"127.0.0.1:80", "localhost", false, "", true},
		{"127.0.0.1:8080", "localhost", false, "", false},
		{"127.0.0.1:8080", "localhost:8081", false, "", false},
		{"127.0.0.1:8080", "evil.example:8080", false, "", false},
		{"127.0.0.1:8080", "evil.example", true, "", false}, // a token does not widen a loopback address
		{"127.0.0.1:8080", "", false, "", false},
		{"10.0.0.5:8080", "10.0.0.5:8080", true, "", true},
		{"10.0.0.5:8080", "shaper.internal:8080", true, "", false},
		{"shaper.internal:8080", "Shaper.Internal:8080", true, "", true},
		{"0.0.0.0:8080", "shaper.internal:8080", true, "", true},
		{"[::]:8080", "anything", true, "", true},
		{":8080", "anything", true, "", true},
		{"0.0.0.0:8080", "shaper.internal:8080", false, "10.0.0.5:8080", false},
		{"0.0.0.0:8080", "10.0.0.5:8080", false, "10.0.0.5:8080", true},
		{"0.0.0.0:8080", "localhost:8080", false, "127.0.0.1:8080", true},
		{"", "localhost:9000", false, "127.0.0.1:9000", true},
		{"", "evil.example:9000", false, "127.0.0.1:9000", false},
		{"", "localhost:9000", false, "", false}, // no address known: nothing is accepted
	} {
		r := httptest.NewRequest("GET", "/", nil)
		r.Host = tc.host
		if tc.local != "" {
			local, err := net.ResolveTCPAddr("tcp", tc.local)
			if err != nil {
				t.Fatal(err)
			}
			r = r.WithContext(context.WithValue(r.Context(), http.LocalAddrContextKey, local))
		}
		err := CheckHost(r, tc.addr, tc.anyHost)
		if (err == nil) != tc.ok {
			t.Errorf("addr %q, Host %q, anyHost %v, local %q: %v, want ok=%v", tc.addr, tc.host, tc.anyHost, tc.local, err, tc.ok)
		}
		if err != nil && !strings.Contains(err.Error(), `"`+tc.host+`"`) {
			t.Errorf("addr %q, Host %q: %v does not name the Host seen", tc.addr, tc.host, err)
		}
	}
}

// TestCheckSameOrigin: a browser's request for another site's page is
// refused (Origin, Sec-Fetch-Site), the server's own and a non-browser
// client's are not, and a link followed from another site opens a page.
func TestCheckSameOrigin(t *testing.T) {
	for _, tc := range []struct {
		method string
		header []string
		ok     bool
	}{
		{"POST", nil, true},
		{"POST", []string{"Origin", "http://127.0.0.1:8080"}, true},
		{"POST", []string{"Origin", "http://127.0.0.1:8080", "Sec-Fetch-Site", "same-origin"}, true},
		{"POST", []string{"Sec-Fetch-Site", "none"}, true},
		{"POST", []string{"Origin", "https://evil.example"}, false},
		{"POST", []string{"Origin", "http://127.0.0.1:9999"}, false},
		{"POST", []string{"Origin", "http://localhost:8080"}, false}, // another origin, even if the same server
		{"POST", []string{"Origin", "null"}, false},
		{"POST", []string{"Sec-Fetch-Site", "cross-site"}, false},
		{"POST", []string{"Sec-Fetch-Site", "same-site"}, false},
		{"POST", []string{"Sec-Fetch-Site", "cross-site", "Sec-Fetch-Mode", "navigate"}, false},
		{"GET", []string{"Sec-Fetch-Site", "cross-site", "Sec-Fetch-Mode", "navigate"}, true},
		{"GET", []string{"Sec-Fetch-Site", "cross-site", "Sec-Fetch-Mode", "cors"}, false},
		{"GET", []string{"Origin", "https://evil.example", "Sec-Fetch-Mode", "navigate"}, false},
	} {
		r := httptest.NewRequest(tc.method, "/", nil)
		r.Host = "127.0.0.1:8080"
		for i := 0; i+1 < len(tc.header); i += 2 {
			r.Header.Set(tc.header[i], tc.header[i+1])
		}
		if err := CheckSameOrigin(r); (err == nil) != tc.ok {
			t.Errorf("%s %v: %v, want ok=%v", tc.method, tc.header, err, tc.ok)
		}
	}
}

// TestBound: a listener's address as a Host check needs it: the
// configured host (a name stays a name), the port the listener got.
func TestBound(t *testing.T) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	_, port, _ := net.SplitHostPort(ln.Addr().String())
	for configured, want := range map[string]string{
		"localhost:0": "localhost:" + port,
		"127.0.0.1:0": "127.0.0.1:" + port,
		":0":          ":" + port,
		"[::1]:0":     "[::1]:" + port,
	} {
		if got := Bound(configured, ln); got != want {
			t.Errorf("Bound(%q) = %q, want %q", configured, got, want)
		}
	}
}
