// Package vendorsim is a vendor API for tests and the demo: it enforces a
// fixed window of Rate requests per Window at a Phase, answers excess with
// 429 and Retry-After, and records every request.
package vendorsim

import (
	"fmt"
	"math"
	"net/http"
	"strconv"
	"sync"
	"time"

	"github.com/shaper-dev/shaper/internal/windows"
)

// Request is one request the vendor saw.
type Request struct {
	At     time.Time
	Method string
	Path   string
	Key    string // Idempotency-Key
	Status int
}

// Vendor is an http.Handler enforcing a fixed window.
type Vendor struct {
	Rate   int
	Window time.Duration
	Phase  time.Duration // windows start at Unix-epoch multiples of Window plus Phase
	// RetryAfter is "seconds" (default), "date" or "none".
	RetryAfter string
	// Headers is "none" (default), "x-ratelimit" (X-RateLimit-Limit,
	// -Remaining, -Reset in seconds) or "ietf" (RateLimit-Policy and
	// RateLimit, draft-08 and later), sent on every answer.
	Headers string
	// Status, when set, decides the answer to an admitted request (for
	// fault tests); default 200.
	Status func(r *http.Request) int
	// Delay, when set, is slept before answering an admitted request.
	Delay time.Duration
	// Hang, when set, says how long to sleep before answering a request
	// (after it was counted, as a vendor that hangs would).
	Hang func(r *http.Request) time.Duration

	mu       sync.Mutex
	window   int64
	count    int
	requests []Request
}

func (v *Vendor) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	now := time.Now()
	k := (now.UnixNano() - int64(v.Phase)) / int64(v.Window)
	v.mu.Lock()
	if k != v.window {
		v.window, v.count = k, 0
	}
	v.count++
	over := v.count > v.Rate
	status := http.StatusOK
	if over {
		status = http.StatusTooManyRequests
	} else if v.Status != nil {
		status = v.Status(r)
	}
	v.requests = append(v.requests, Request{At: now, Method: r.Method, Path: r.URL.RequestURI(), Key: r.Header.Get("Idempotency-Key"), Status: status})
	remaining := max(v.Rate-v.count, 0)
	v.mu.Unlock()
	if v.Hang != nil {
		if d := v.Hang(r); d > 0 {
			time.Sleep(d)
		}
	}
	end := time.Unix(0, (k+1)*int64(v.Window)+int64(v.Phase))
	reset := int(math.Ceil(time.Until(end).Seconds()))
	switch v.Headers {
	case "x-ratelimit":
		w.Header().Set("X-RateLimit-Limit", strconv.Itoa(v.Rate))
		w.Header().Set("X-RateLimit-Remaining", strconv.Itoa(remaining))
		w.Header().Set("X-RateLimit-Reset", strconv.Itoa(reset))
	case "ietf":
		w.Header().Set("RateLimit-Policy", fmt.Sprintf(`"default";q=%d;w=%d`, v.Rate, max(int(v.Window/time.Second), 1)))
		w.Header().Set("RateLimit", fmt.Sprintf(`"default";r=%d;t=%d`, remaining, reset))
	}
	if over {
		switch v.RetryAfter {
		case "date":
			w.Header().Set("Retry-After", end.Add(time.Second).UTC().Format(http.TimeFormat))
		case "none":
		default:
			w.Header().Set("Retry-After", strconv.Itoa(int(time.Until(end).Seconds())+1))
		}
		http.Error(w, "rate limit exceeded", status)
		return
	}
	if v.Delay > 0 {
		time.Sleep(v.Delay)
	}
	w.WriteHeader(status)
	fmt.Fprintf(w, `{"ok":%t,"path":%q}`, status < 300, r.URL.Path)
}

// Requests returns a copy of every request seen.
func (v *Vendor) Requests() []Request {
	v.mu.Lock()
	defer v.mu.Unlock()
	return append([]Request(nil), v.requests...)
}

// Summary is what a run looked like from the vendor's side.
type Summary struct {
	Requests      int
	RateLimited   int // 429s
	MaxPerWindow  int // most requests in one of the vendor's fixed windows
	MaxSliding    int // most requests in any sliding window of the same length
	DistinctKeys  int // distinct Idempotency-Keys among 2xx answers
	DuplicateKeys int // 2xx answers whose key had already succeeded
}

// Summarize counts the requests seen so far.
func (v *Vendor) Summarize() Summary {
	reqs := v.Requests()
	var s Summary
	s.Requests = len(reqs)
	ts := make([]time.Time, 0, len(reqs))
	ok := map[string]bool{}
	for _, r := range reqs {
		ts = append(ts, r.At)
		if r.Status == http.StatusTooManyRequests {
			s.RateLimited++
		}
		if r.Status >= 200 && r.Status < 300 {
			if ok[r.Key] {
				s.DuplicateKeys++
			}
			ok[r.Key] = true
		}
	}
	s.DistinctKeys = len(ok)
	s.MaxPerWindow = windows.MaxFixed(ts, v.Window, v.Phase)
	s.MaxSliding = windows.MaxSliding(ts, v.Window)
	return s
}
