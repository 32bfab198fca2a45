// Package vendorsim is a vendor API for tests and the demo: it enforces a
// rate limit of Rate requests per Window, answers excess with 429 and
// Retry-After, and records every request.
//
// The limit is one of three kinds, as real vendors count:
//   - "fixed" (the default): at most Rate admitted requests in each fixed
//     window, windows starting at Unix-epoch multiples of Window plus Phase;
//   - "sliding": a sliding log, admitting a request when fewer than Rate
//     admitted requests lie in the Window before it;
//   - "gcra": a leaky bucket (the generic cell rate algorithm) with emission
//     interval Window/Rate and a burst of Burst requests.
//
// Rejected requests are recorded but never count against the limit.
//
// An admitted request is answered 200 with a small JSON body unless the
// Mock says otherwise: AnswerBytes gives it a body of about that size
// (Answer), Paging serves GET requests as pages of a list, and FailKeys
// and FailEvery pick Idempotency-Keys whose requests fail: they are
// answered 422 with {"error":"validation failed","id":KEY}. A failed
// request was admitted and counts against the limit like any other.
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
	Units  int // its cost ("fixed" kind; 0 elsewhere, meaning 1)
}

// Mock is an http.Handler enforcing a rate limit of the given Kind. Set
// its fields before the first request and leave them alone after.
type Mock struct {
	// Kind is "fixed" (the default, also ""), "sliding" or "gcra"; see the
	// package doc. Any other value answers every request with 500.
	Kind   string
	Rate   int
	Window time.Duration
	Phase  time.Duration // "fixed" only: windows start at Unix-epoch multiples of Window plus Phase
	// More are further fixed-window limits a "fixed" vendor enforces too
	// (a quota over a minute or a day beside the per-second limit); a
	// request over any of them is refused, and counts in all of them.
	More []Fixed
	// CostHeader, when set, names a request header carrying its cost: the
	// units it uses of every limit ("fixed" only; default 1).
	// Burst is the "gcra" kind's burst: how many requests it admits at
	// once after being idle. Zero or less means 1. Other kinds ignore it.
	Burst int
	// RetryAfter is "seconds" (default), "date" or "none". For "fixed" it
	// says when the current window ends; for "sliding" and "gcra" it says
	// when the next request would be admitted, in whole seconds rounded up
	// (at least 1) or as an HTTP-date rounded up to the second.
	RetryAfter string
	// Headers is "none" (default), "x-ratelimit" (X-RateLimit-Limit,
	// -Remaining, -Reset in seconds) or "ietf" (RateLimit-Policy and
	// RateLimit, draft-08 and later), sent on every answer. Only the
	// "fixed" kind sends them; "sliding" and "gcra" send no rate-limit
	// headers, as their quota has no single reset time.
	Headers string
	// Status, when set, decides the answer to an admitted request (for
	// fault tests) that neither fails (FailKeys, FailEvery) nor names an
	// unknown cursor (Paging); default 200.
	Status func(r *http.Request) int
	// Delay, when set, is slept before answering an admitted request.
	Delay time.Duration
	// Hang, when set, says how long to sleep before answering a request
	// (after it was counted, as a vendor that hangs would).
	Hang func(r *http.Request) time.Duration
	// AnswerBytes, when above 0, answers an admitted request with
	// Answer(method, path, key, body, AnswerBytes) instead of the small
	// {"ok":...,"path":...} body.
	AnswerBytes int
	// Paging, when its Pages is above 0, serves GET requests under its
	// Prefix as pages of a list; see Paging.
	Paging Paging
	// FailKeys and FailEvery pick the Idempotency-Keys whose admitted
	// requests are answered 422, every time they are sent: those in
	// FailKeys, and with FailEvery above 0 those for which
	// FailsEvery(key, FailEvery) holds. Requests without a key never fail.
	FailKeys  map[string]bool
	FailEvery int

	now func() time.Time // the clock when set (tests), else time.Now

	CostHeader string

	mu       sync.Mutex
	window   int64       // "fixed": the current window's number
	count    int         // "fixed": requests (units) in the current window
	log      []time.Time // "sliding": the last Rate admitted times, a ring
	head     int         // "sliding": index in log of the oldest time once log is full
	tat      time.Time   // "gcra": theoretical arrival time of the next request
	requests []Request
}

// Fixed is one more fixed-window limit of a "fixed" vendor.
type Fixed struct {
	Rate   int
	Window time.Duration
	Phase  time.Duration

	window int64
	count  int
}

// clock returns the time now.
func (v *Mock) clock() time.Time {
	if v.now != nil {
		return v.now()
	}
	return time.Now()
}

// ServeHTTP counts the request against the limit, records it and answers
// 429 when it is over the limit, else Status (default 200) with a small
// JSON body.
func (v *Mock) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	switch v.Kind {
	case "", "fixed":
		v.serveFixed(w, r)
	case "sliding", "gcra":
		v.serveQueued(w, r)
	default:
		msg := fmt.Sprintf("vendorsim: unknown Kind %q: set Kind to \"fixed\", \"sliding\" or \"gcra\"", v.Kind)
		v.mu.Lock()
		v.record(v.clock(), r, http.StatusInternalServerError)
		v.mu.Unlock()
		http.Error(w, msg, http.StatusInternalServerError)
	}
}

// record appends a request to the record; v.mu must be held.
func (v *Mock) record(at time.Time, r *http.Request, status int) {
	v.requests = append(v.requests, Request{At: at, Method: r.Method, Path: r.URL.RequestURI(), Key: r.Header.Get("Idempotency-Key"), Status: status})
}

// serveFixed serves a request under the "fixed" kind.
func (v *Mock) serveFixed(w http.ResponseWriter, r *http.Request) {
	now := v.clock()
	k := (now.UnixNano() - int64(v.Phase)) / int64(v.Window)
	units := 1
	if v.CostHeader != "" {
		if n, err := strconv.Atoi(r.Header.Get(v.CostHeader)); err == nil && n > 0 {
			units = n
		}
	}
	v.mu.Lock()
	if k != v.window {
		v.window, v.count = k, 0
	}
	v.count += units // a refused request counts too
	over := v.count > v.Rate
	for i := range v.More {
		m := &v.More[i]
		if mk := (now.UnixNano() - int64(m.Phase)) / int64(m.Window); mk != m.window {
			m.window, m.count = mk, 0
		}
		m.count += units
		over = over || m.count > m.Rate
	}
	status := http.StatusOK
	if over {
		status = http.StatusTooManyRequests
	} else {
		status = v.admittedStatus(r)
	}
	v.record(now, r, status)
	v.requests[len(v.requests)-1].Units = units
	remaining := max(v.Rate-v.count, 0)
	v.mu.Unlock()
	if v.Hang != nil {
		if d := v.Hang(r); d > 0 {
			time.Sleep(d)
		}
	}
	end := time.Unix(0, (k+1)*int64(v.Window)+int64(v.Phase))
	reset := int(math.Ceil(end.Sub(v.clock()).Seconds()))
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
			w.Header().Set("Retry-After", strconv.Itoa(int(end.Sub(v.clock()).Seconds())+1))
		}
		http.Error(w, "rate limit exceeded", status)
		return
	}
	v.answer(w, r, status)
}

// serveQueued serves a request under the "sliding" and "gcra" kinds.
func (v *Mock) serveQueued(w http.ResponseWriter, r *http.Request) {
	now := v.clock()
	v.mu.Lock()
	var admitted bool
	var next time.Time
	if v.Kind == "sliding" {
		admitted, next = v.admitSliding(now)
	} else {
		admitted, next = v.admitGCRA(now)
	}
	status := http.StatusOK
	if !admitted {
		status = http.StatusTooManyRequests
	} else {
		status = v.admittedStatus(r)
	}
	v.record(now, r, status)
	v.mu.Unlock()
	if v.Hang != nil {
		if d := v.Hang(r); d > 0 {
			time.Sleep(d)
		}
	}
	if !admitted {
		switch v.RetryAfter {
		case "date":
			w.Header().Set("Retry-After", ceilSecond(next).UTC().Format(http.TimeFormat))
		case "none":
		default:
			w.Header().Set("Retry-After", strconv.Itoa(retrySeconds(next.Sub(v.clock()))))
		}
		http.Error(w, "rate limit exceeded", status)
		return
	}
	v.answer(w, r, status)
}

// admittedStatus decides the status of an admitted request: 422 when its
// key fails, 400 for a page request with an unknown cursor, else Status
// (default 200).
func (v *Mock) admittedStatus(r *http.Request) int {
	if v.fails(r.Header.Get("Idempotency-Key")) {
		return http.StatusUnprocessableEntity
	}
	if v.Paging.serves(r) {
		if s := v.Paging.status(r); s != 0 {
			return s
		}
	}
	if v.Status != nil {
		return v.Status(r)
	}
	return http.StatusOK
}

// answer answers an admitted request with the status admittedStatus
// decided.
func (v *Mock) answer(w http.ResponseWriter, r *http.Request, status int) {
	if v.Delay > 0 {
		time.Sleep(v.Delay)
	}
	key := r.Header.Get("Idempotency-Key")
	switch {
	case status == http.StatusUnprocessableEntity && v.fails(key):
		writeJSON(w, status, failure(key))
		return
	case v.Paging.serves(r):
		v.Paging.write(w, r, status)
		return
	case v.AnswerBytes > 0:
		v.writeAnswer(w, r, status)
		return
	}
	w.WriteHeader(status)
	fmt.Fprintf(w, `{"ok":%t,"path":%q}`, status < 300, r.URL.Path)
}

// admitSliding decides a request at now under the sliding log: it is
// admitted when fewer than Rate admitted requests lie in (now-Window, now].
// A rejected request gets the time at which the next one would be
// admitted. v.mu must be held. With Rate 0 or less nothing is admitted.
func (v *Mock) admitSliding(now time.Time) (bool, time.Time) {
	if v.Rate <= 0 {
		return false, now.Add(v.Window)
	}
	if len(v.log) < v.Rate {
		v.log = append(v.log, now)
		return true, time.Time{}
	}
	oldest := v.log[v.head]
	if now.Sub(oldest) < v.Window {
		return false, oldest.Add(v.Window)
	}
	v.log[v.head] = now
	v.head = (v.head + 1) % len(v.log)
	return true, time.Time{}
}

// admitGCRA decides a request at now under the generic cell rate
// algorithm: with emission interval T = Window/Rate and burst tolerance
// tau = (Burst-1)*T, a request is admitted when now >= TAT-tau, and then
// TAT becomes max(TAT, now)+T. A rejected request leaves TAT alone and gets
// TAT-tau, the time at which the next one would be admitted. v.mu must be
// held. With Rate 0 or less nothing is admitted.
func (v *Mock) admitGCRA(now time.Time) (bool, time.Time) {
	if v.Rate <= 0 {
		return false, now.Add(v.Window)
	}
	t := v.Window / time.Duration(v.Rate)
	tau := time.Duration(max(v.Burst, 1)-1) * t
	tat := v.tat
	if tat.IsZero() || tat.Before(now) {
		tat = now
	}
	if allowAt := tat.Add(-tau); now.Before(allowAt) {
		return false, allowAt
	}
	v.tat = tat.Add(t)
	return true, time.Time{}
}

// retrySeconds is a Retry-After delay in whole seconds: d rounded up, and
// at least 1.
func retrySeconds(d time.Duration) int {
	return max(int(math.Ceil(d.Seconds())), 1)
}

// ceilSecond rounds t up to a whole second, for an HTTP-date that is not
// earlier than t.
func ceilSecond(t time.Time) time.Time {
	if s := t.Truncate(time.Second); s.Before(t) {
		return s.Add(time.Second)
	}
	return t
}

// Requests returns a copy of every request seen.
func (v *Mock) Requests() []Request {
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
	// KeysSeen is the number of distinct Idempotency-Keys on requests of
	// any answer (429s and 422s too); requests without one are not counted.
	KeysSeen int
	// KeysRepeated is the number of those keys sent on more than one
	// request, whatever the answers; RepeatedFirst holds the first few
	// (up to 5), in the order they were first repeated.
	KeysRepeated  int
	RepeatedFirst []string
	Failed        int // 422s
}

// repeatedShown is how many repeated keys a Summary lists.
const repeatedShown = 5

// Summarize counts the requests seen so far.
func (v *Mock) Summarize() Summary {
	reqs := v.Requests()
	var s Summary
	s.Requests = len(reqs)
	ts := make([]time.Time, 0, len(reqs))
	ok := map[string]bool{}
	seen := map[string]int{}
	for _, r := range reqs {
		ts = append(ts, r.At)
		switch r.Status {
		case http.StatusTooManyRequests:
			s.RateLimited++
		case http.StatusUnprocessableEntity:
			s.Failed++
		}
		if r.Key != "" {
			seen[r.Key]++
			if seen[r.Key] == 2 {
				s.KeysRepeated++
				if len(s.RepeatedFirst) < repeatedShown {
					s.RepeatedFirst = append(s.RepeatedFirst, r.Key)
				}
			}
		}
		if r.Status >= 200 && r.Status < 300 {
			if ok[r.Key] {
				s.DuplicateKeys++
			}
			ok[r.Key] = true
		}
	}
	s.DistinctKeys = len(ok)
	s.KeysSeen = len(seen)
	s.MaxPerWindow = windows.MaxFixed(ts, v.Window, v.Phase)
	s.MaxSliding = windows.MaxSliding(ts, v.Window)
	return s
}
