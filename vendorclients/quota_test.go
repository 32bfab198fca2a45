package vendorclients

import (
	"context"
	"io"
	"net/http"
	"net/http/httptest"
	"testing"
	"time"

	"github.com/shaper-dev/shaper/internal/redistest"
	"github.com/shaper-dev/shaper/shaper"
)

// TestQuotaCountedFromTheVendorsHeaders: another app with the same
// credential spent most of an hourly quota. Both header styles that name
// the quota's window or rate make the gate count what the vendor says
// was used, and neither lowers the per-second rate (a quota announced is
// not a per-second limit); a later answer with more remaining lowers
// nothing.
func TestQuotaCountedFromTheVendorsHeaders(t *testing.T) {
	for _, style := range []string{"x-ratelimit", "ietf"} {
		t.Run(style, func(t *testing.T) {
			remaining := 100
			vendor := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
				switch style {
				case "x-ratelimit":
					w.Header().Set("X-RateLimit-Limit", "1000")
					w.Header().Set("X-RateLimit-Remaining", itoa(remaining))
					w.Header().Set("X-RateLimit-Reset", "1800")
				case "ietf":
					w.Header().Set("RateLimit-Policy", `"hour";q=1000;w=3600`)
					w.Header().Set("RateLimit", `"hour";r=`+itoa(remaining)+`;t=1800`)
				}
				w.WriteHeader(http.StatusOK)
			}))
			defer vendor.Close()
			gate := shaper.NewGate(redistest.Client(t), shaper.Config{KeyPrefix: redistest.Prefix(t)})
			bucket, err := gate.Bucket("gh", shaper.Policy{Limits: []shaper.Limit{{Rate: 50, Window: time.Second}, {Rate: 1000, Window: time.Hour}},
				Horizon: time.Millisecond})
			if err != nil {
				t.Fatal(err)
			}
			c, err := New(Endpoint{Name: "gh", BaseURL: vendor.URL}, bucket, Options{})
			if err != nil {
				t.Fatal(err)
			}
			call := func() {
				req, _ := c.NewRequest(context.Background(), http.MethodGet, "/x", nil)
				resp, err := c.Do(req)
				if err != nil {
					t.Fatal(err)
				}
				_, _ = io.Copy(io.Discard, resp.Body)
				resp.Body.Close()
			}
			call()
			st, err := bucket.Stats(context.Background())
			if err != nil {
				t.Fatal(err)
			}
			if use := st.Limits; use[1].Used != 900 {
				t.Errorf("the quota counts %d used after the vendor said 100 of 1000 remain, want 900", use[1].Used)
			}
			if st.RateSource != "" {
				t.Errorf("the quota's announcement set the rate (%s: %s)", st.RateSource, st.RateReason)
			}
			remaining = 500
			time.Sleep(1100 * time.Millisecond) // past the once-a-second read
			call()
			if st, err = bucket.Stats(context.Background()); err != nil {
				t.Fatal(err)
			}
			if st.Limits[1].Used != 901 {
				t.Errorf("after a second call and an announcement of more remaining: %d used, want 901 (900 the vendor counted, and this call)", st.Limits[1].Used)
			}
		})
	}
}

func itoa(n int) string {
	return string(rune('0'+n/100%10)) + string(rune('0'+n/10%10)) + string(rune('0'+n%10))
}

// TestAnnouncedLimit: which limit of a policy an announcement describes:
// the one of its window; else the only one of its rate; else the only
// quota whose window holds its reset.
func TestAnnouncedLimit(t *testing.T) {
	p := shaper.Policy{Limits: []shaper.Limit{{Rate: 10, Window: time.Second}, {Rate: 1000, Window: time.Hour}, {Rate: 10, Window: time.Minute, Spread: true}}}
	for _, c := range []struct {
		name string
		h    Hints
		want int
		ok   bool
	}{
		{"the per-second window", Hints{Limit: 10, Window: time.Second, Reset: -1}, 0, true},
		{"the hour's window", Hints{Limit: 900, Window: time.Hour, Reset: -1}, 1, true},
		{"a window of none", Hints{Limit: 5, Window: 2 * time.Second, Reset: -1}, -1, false},
		{"the only limit of the rate", Hints{Limit: 1000, Reset: -1}, 1, true},
		{"two limits of the rate", Hints{Limit: 10, Reset: -1}, 0, false},
		{"a reset only the hour's quota holds", Hints{Reset: 30 * time.Minute}, 1, true},
		{"a reset within the primary window", Hints{Reset: 500 * time.Millisecond}, -1, false},
		{"nothing announced", Hints{Reset: -1}, -1, false},
	} {
		if got, ok := announcedLimit(p, c.h); got != c.want || ok != c.ok {
			t.Errorf("%s: limit %d, %v; want %d, %v", c.name, got, ok, c.want, c.ok)
		}
	}
}
