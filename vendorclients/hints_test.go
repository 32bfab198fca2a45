package vendorclients

import (
	"net/http"
	"strconv"
	"testing"
	"time"
)

func TestParseHints(t *testing.T) {
	now := time.Unix(1_780_000_000, 0)
	h := func(kv ...string) http.Header {
		hd := http.Header{}
		for i := 0; i < len(kv); i += 2 {
			hd.Set(kv[i], kv[i+1])
		}
		return hd
	}
	tests := []struct {
		name string
		h    http.Header
		want Hints
	}{
		{"none", h(), Hints{Remaining: -1, Reset: -1}},
		{"retry-after seconds", h("Retry-After", "3"), Hints{Remaining: -1, Reset: -1, RetryAfter: 3 * time.Second, HasRetryAfter: true}},
		{"x-ratelimit, reset in seconds", h("X-RateLimit-Limit", "50", "X-RateLimit-Remaining", "0", "X-RateLimit-Reset", "12"),
			Hints{Limit: 50, Remaining: 0, Reset: 12 * time.Second, Style: "x-ratelimit"}},
		{"x-ratelimit, reset as unix time", h("X-RateLimit-Limit", "50", "X-RateLimit-Reset", strconv.Itoa(1_780_000_030)),
			Hints{Limit: 50, Remaining: -1, Reset: 30 * time.Second, Style: "x-ratelimit"}},
		{"x-ratelimit, reset as unix millis", h("X-RateLimit-Reset", strconv.Itoa(1_780_000_000_500)),
			Hints{Remaining: -1, Reset: 500 * time.Millisecond, Style: "x-ratelimit"}},
		{"x-ratelimit, reset in the past", h("X-RateLimit-Reset", strconv.Itoa(1_779_999_000)),
			Hints{Remaining: -1, Reset: 0, Style: "x-ratelimit"}},
		{"x-ratelimit garbage", h("X-RateLimit-Limit", "lots", "X-RateLimit-Reset", "-4"), Hints{Remaining: -1, Reset: -1}},
		{"ietf draft-08+", h("RateLimit-Policy", `"default";q=100;w=60`, "RateLimit", `"default";r=0;t=30`),
			Hints{Limit: 100, Window: time.Minute, Remaining: 0, Reset: 30 * time.Second, Style: "ietf"}},
		{"ietf, most restrictive policy", h("RateLimit-Policy", `"day";q=1000;w=86400, "burst";q=10;w=1`),
			Hints{Limit: 1000, Window: 24 * time.Hour, Remaining: -1, Reset: -1, Style: "ietf"}},
		{"ietf draft-07", h("RateLimit-Policy", `100;w=60`, "RateLimit", `limit=100, remaining=5, reset=7`),
			Hints{Limit: 100, Window: time.Minute, Remaining: 5, Reset: 7 * time.Second, Style: "ietf"}},
		{"ietf draft-06", h("RateLimit-Limit", "20", "RateLimit-Remaining", "3", "RateLimit-Reset", "9"),
			Hints{Limit: 20, Remaining: 3, Reset: 9 * time.Second, Style: "ietf"}},
		{"ietf wins over x-ratelimit", h("RateLimit-Policy", `"a";q=10;w=1`, "X-RateLimit-Limit", "99"),
			Hints{Limit: 10, Window: time.Second, Remaining: -1, Reset: -1, Style: "ietf"}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			if got := ParseHints(tt.h, now); got != tt.want {
				t.Errorf("ParseHints = %+v\nwant          %+v", got, tt.want)
			}
		})
	}
}

func FuzzParseHints(f *testing.F) {
	f.Add("100;w=60", `"default";r=0;t=30`, "50", "0", "12")
	f.Add(`"a";q=10;w=1, "b";q=5`, `limit=1, remaining=2, reset=3`, "x", "-1", "1780000030")
	now := time.Now()
	f.Fuzz(func(t *testing.T, policy, rl, limit, remaining, reset string) {
		h := http.Header{}
		h.Set("RateLimit-Policy", policy)
		h.Set("RateLimit", rl)
		h.Set("X-RateLimit-Limit", limit)
		h.Set("X-RateLimit-Remaining", remaining)
		h.Set("X-RateLimit-Reset", reset)
		hs := ParseHints(h, now)
		if hs.Limit < 0 || hs.Window < 0 || hs.Remaining < -1 || hs.Reset < -1 || hs.RetryAfter < 0 {
			t.Errorf("impossible hints %+v", hs)
		}
		if hs.Window > 0 && hs.Limit == 0 && hs.Style == "" {
			t.Errorf("a window without a style: %+v", hs)
		}
	})
}
