package vendorclients

import (
	"math"
	"net/http"
	"strconv"
	"strings"
	"time"
)

// Hints is what one response says about the vendor's limits. Unknown
// values are zero (Limit, Window) or negative (Remaining, Reset).
type Hints struct {
	// Limit calls per Window, as announced; Window is 0 when the header
	// style does not say (X-RateLimit-Limit): callers assume the
	// configured window.
	Limit  int
	Window time.Duration
	// Remaining calls in the current window, and the time until it resets.
	Remaining int
	Reset     time.Duration
	// RetryAfter, when HasRetryAfter.
	RetryAfter    time.Duration
	HasRetryAfter bool
	// Style is "ietf", "x-ratelimit" or "" (none).
	Style string
}

// unixTimeFloor tells a Unix time from a delay: X-RateLimit-Reset values at
// or above it (2001-09-09 in seconds) are Unix times, below it seconds
// from now. Values above unixMillisFloor are Unix times in milliseconds.
const (
	unixTimeFloor   = 1_000_000_000
	unixMillisFloor = 100_000_000_000
)

// ParseHints reads Retry-After, X-RateLimit-Limit / -Remaining / -Reset,
// and the IETF RateLimit and RateLimit-Policy fields (draft-ietf-httpapi-
// ratelimit-headers-08 and later: `"default";r=50;t=30` and
// `"default";q=100;w=60`; and the older RateLimit-Limit / -Remaining /
// -Reset). Values it cannot parse are left unknown.
func ParseHints(h http.Header, now time.Time) Hints {
	hs := Hints{Remaining: -1, Reset: -1}
	if v := h.Get("Retry-After"); v != "" {
		hs.RetryAfter, hs.HasRetryAfter = ParseRetryAfter(v, now)
	}
	if p := h.Get("RateLimit-Policy"); p != "" {
		if q, w, ok := parsePolicy(p); ok {
			hs.Limit, hs.Window, hs.Style = q, w, "ietf"
		}
	}
	if v := h.Get("RateLimit"); v != "" {
		if r, t, ok := parseRateLimit(v); ok {
			hs.Remaining, hs.Reset, hs.Style = r, t, "ietf"
		}
	}
	// draft-06 and earlier.
	if n, ok := nonNegInt(h.Get("RateLimit-Limit")); ok && hs.Limit == 0 {
		hs.Limit, hs.Style = n, "ietf"
	}
	if n, ok := nonNegInt(h.Get("RateLimit-Remaining")); ok && hs.Remaining < 0 {
		hs.Remaining, hs.Style = n, "ietf"
	}
	if n, ok := nonNegInt(h.Get("RateLimit-Reset")); ok && hs.Reset < 0 {
		hs.Reset, hs.Style = time.Duration(n)*time.Second, "ietf"
	}
	if hs.Style == "" {
		if n, ok := nonNegInt(h.Get("X-RateLimit-Limit")); ok {
			hs.Limit, hs.Style = n, "x-ratelimit"
		}
		if n, ok := nonNegInt(h.Get("X-RateLimit-Remaining")); ok {
			hs.Remaining, hs.Style = n, "x-ratelimit"
		}
		if d, ok := parseReset(h.Get("X-RateLimit-Reset"), now); ok {
			hs.Reset, hs.Style = d, "x-ratelimit"
		}
	}
	return hs
}

// parseReset reads X-RateLimit-Reset as seconds from now, or as a Unix
// time in seconds or milliseconds when the number is that large.
func parseReset(v string, now time.Time) (time.Duration, bool) {
	f, err := strconv.ParseFloat(strings.TrimSpace(v), 64)
	if err != nil || f < 0 || math.IsInf(f, 0) || math.IsNaN(f) {
		return 0, false
	}
	switch {
	case f >= unixMillisFloor:
		return max(time.UnixMilli(int64(f)).Sub(now), 0), true
	case f >= unixTimeFloor:
		return max(time.Unix(int64(f), int64((f-math.Floor(f))*1e9)).Sub(now), 0), true
	}
	return time.Duration(f * float64(time.Second)), true
}

func nonNegInt(v string) (int, bool) {
	n, err := strconv.Atoi(strings.TrimSpace(v))
	if err != nil || n < 0 {
		return 0, false
	}
	return n, true
}

// sfItems splits a structured-field list into items, each a slice of
// "key=value" parameters; the item's bare value comes first with key "".
// It is tolerant: quoted strings may hold separators.
func sfItems(v string) [][][2]string {
	var items [][][2]string
	for _, item := range splitOutsideQuotes(v, ',') {
		var params [][2]string
		for i, part := range splitOutsideQuotes(item, ';') {
			part = strings.TrimSpace(part)
			k, val, found := strings.Cut(part, "=")
			if i == 0 && !found {
				params = append(params, [2]string{"", strings.Trim(part, `"`)})
				continue
			}
			params = append(params, [2]string{strings.ToLower(strings.TrimSpace(k)), strings.Trim(strings.TrimSpace(val), `"`)})
		}
		items = append(items, params)
	}
	return items
}

func splitOutsideQuotes(s string, sep byte) []string {
	var out []string
	quoted, start := false, 0
	for i := 0; i < len(s); i++ {
		switch s[i] {
		case '"':
			quoted = !quoted
		case sep:
			if !quoted {
				out = append(out, s[start:i])
				start = i + 1
			}
		}
	}
	return append(out, s[start:])
}

// parsePolicy reads RateLimit-Policy and returns the most restrictive
// policy as calls per window: `"burst";q=100;w=60, "day";q=1000;w=86400`
// (draft-08+), or `100;w=60` (drafts 05-07).
func parsePolicy(v string) (int, time.Duration, bool) {
	best, bestW, found := 0, time.Duration(0), false
	for _, params := range sfItems(v) {
		q, w := -1, time.Duration(0)
		for _, kv := range params {
			switch kv[0] {
			case "":
				if n, ok := nonNegInt(kv[1]); ok { // old style: the item is the quota
					q = n
				}
			case "q":
				if n, ok := nonNegInt(kv[1]); ok {
					q = n
				}
			case "w":
				if n, ok := nonNegInt(kv[1]); ok && n > 0 {
					w = time.Duration(n) * time.Second
				}
			}
		}
		if q < 0 || w <= 0 {
			continue
		}
		// Most restrictive: the lowest calls per second.
		if !found || float64(q)/w.Seconds() < float64(best)/bestW.Seconds() {
			best, bestW, found = q, w, true
		}
	}
	return best, bestW, found
}

// parseRateLimit reads RateLimit: `"default";r=50;t=30` (draft-08+) or
// `limit=100, remaining=50, reset=30` (draft-07), returning the lowest
// remaining and its reset.
func parseRateLimit(v string) (int, time.Duration, bool) {
	rem, reset, found := 0, time.Duration(0), false
	// draft-07 dictionary: one item per key.
	dict := map[string]string{}
	for _, params := range sfItems(v) {
		r, t := -1, time.Duration(-1)
		for _, kv := range params {
			switch kv[0] {
			case "r":
				if n, ok := nonNegInt(kv[1]); ok {
					r = n
				}
			case "t":
				if n, ok := nonNegInt(kv[1]); ok {
					t = time.Duration(n) * time.Second
				}
			case "limit", "remaining", "reset":
				dict[kv[0]] = kv[1]
			}
		}
		if r >= 0 && (!found || r < rem) {
			rem, reset, found = r, max(t, 0), true
		}
	}
	if !found {
		r, rok := nonNegInt(dict["remaining"])
		t, tok := nonNegInt(dict["reset"])
		if rok {
			rem, found = r, true
			if tok {
				reset = time.Duration(t) * time.Second
			}
		}
	}
	return rem, reset, found
}

// ParseRetryAfter parses a Retry-After value, as delay-seconds or as an
// HTTP-date (relative to now). Negative or unparsable values are not ok; a
// date in the past is 0.
func ParseRetryAfter(v string, now time.Time) (time.Duration, bool) {
	v = strings.TrimSpace(v)
	if v == "" {
		return 0, false
	}
	if n, err := strconv.ParseInt(v, 10, 64); err == nil {
		if n < 0 {
			return 0, false
		}
		if n > int64(100*365*24*time.Hour/time.Second) {
			n = int64(100 * 365 * 24 * time.Hour / time.Second)
		}
		return time.Duration(n) * time.Second, true
	}
	t, err := http.ParseTime(v)
	if err != nil {
		return 0, false
	}
	return max(t.Sub(now), 0), true
}
