package vendorsim

import (
	"net/http"
	"net/http/httptest"
	"strconv"
	"sync"
	"testing"
	"time"

	"go.uber.org/goleak"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

// fakeClock is a clock that moves only when told to.
type fakeClock struct {
	mu sync.Mutex
	t  time.Time
}

func (c *fakeClock) Now() time.Time {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.t
}

func (c *fakeClock) Set(t time.Time) {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.t = t
}

// base is a time a quarter second past a whole second, so that rounding
// to seconds shows.
var base = time.Unix(1_700_000_000, 250_000_000)

// step is one request at an offset from base and the answer it must get.
type step struct {
	at         time.Duration // since base
	status     int
	retryAfter string // checked on 429s only
}

// run sends the steps to v at their times and checks the answers.
func run(t *testing.T, v *Mock, steps []step) {
	t.Helper()
	clk := &fakeClock{t: base}
	v.now = clk.Now
	for i, s := range steps {
		clk.Set(base.Add(s.at))
		rec := httptest.NewRecorder()
		v.ServeHTTP(rec, httptest.NewRequest(http.MethodGet, "/x", nil))
		if rec.Code != s.status {
			t.Fatalf("step %d at +%v: status %d, want %d", i, s.at, rec.Code, s.status)
		}
		if got := rec.Header().Get("Retry-After"); rec.Code == http.StatusTooManyRequests && got != s.retryAfter {
			t.Fatalf("step %d at +%v: Retry-After %q, want %q", i, s.at, got, s.retryAfter)
		}
	}
	reqs := v.Requests()
	if len(reqs) != len(steps) {
		t.Fatalf("recorded %d requests, want %d", len(reqs), len(steps))
	}
	for i, r := range reqs {
		if r.Status != steps[i].status || !r.At.Equal(base.Add(steps[i].at)) {
			t.Fatalf("request %d recorded as %+v, want status %d at +%v", i, r, steps[i].status, steps[i].at)
		}
	}
}

const (
	ok       = http.StatusOK
	limited  = http.StatusTooManyRequests
	ms       = time.Millisecond
	sec      = time.Second
	httpDate = http.TimeFormat
)

func TestKinds(t *testing.T) {
	tests := []struct {
		name   string
		vendor *Mock
		steps  []step
	}{
		{"fixed counts per window at Phase", &Mock{Rate: 2, Window: sec}, []step{
			{0, ok, ""},
			{100 * ms, ok, ""},
			{200 * ms, limited, "1"}, // the window ends at +750 ms
			{749 * ms, limited, "1"},
			{750 * ms, ok, ""},
			{760 * ms, ok, ""},
			{770 * ms, limited, "1"},
		}},
		{"fixed with a phase", &Mock{Rate: 1, Window: sec, Phase: 500 * ms}, []step{
			{0, ok, ""},
			{200 * ms, limited, "1"},
			{250 * ms, ok, ""}, // a window starts at base+250ms = x.500
		}},
		{"gcra at 100/s admits every 10 ms", &Mock{Kind: "gcra", Rate: 100, Window: sec}, []step{
			{0, ok, ""},
			{9 * ms, limited, "1"},
			{10 * ms, ok, ""},
			{19 * ms, limited, "1"},
			{20 * ms, ok, ""},
			{100 * ms, ok, ""}, // idle: no credit beyond the burst of 1
			{101 * ms, limited, "1"},
			{110 * ms, ok, ""},
		}},
		{"gcra burst", &Mock{Kind: "gcra", Rate: 100, Window: sec, Burst: 3}, []step{
			{0, ok, ""},
			{0, ok, ""},
			{0, ok, ""},
			{0, limited, "1"},
			{5 * ms, limited, "1"},
			{10 * ms, ok, ""},
			{11 * ms, limited, "1"},
			{25 * ms, ok, ""}, // TAT was +40 ms: one slot, not a new burst
			{25 * ms, limited, "1"},
			{1000 * ms, ok, ""}, // idle a long time: the burst is back
			{1000 * ms, ok, ""},
			{1000 * ms, ok, ""},
			{1000 * ms, limited, "1"},
		}},
		{"gcra rejections leave TAT alone", &Mock{Kind: "gcra", Rate: 2, Window: time.Minute}, []step{
			{0, ok, ""},
			{1 * sec, limited, "29"},
			{500 * ms, limited, "30"}, // 29.5 s rounds up
			{29 * sec, limited, "1"},
			{29*sec + 999*ms, limited, "1"},
			{30 * sec, ok, ""},
			{31 * sec, limited, "29"},
		}},
		{"sliding admits Rate per window", &Mock{Kind: "sliding", Rate: 3, Window: sec}, []step{
			{0, ok, ""},
			{100 * ms, ok, ""},
			{200 * ms, ok, ""},
			{500 * ms, limited, "1"},
			{999 * ms, limited, "1"},
			{1000 * ms, ok, ""}, // the request at 0 left the window
			{1050 * ms, limited, "1"},
			{1100 * ms, ok, ""},
			{1150 * ms, limited, "1"},
			{1200 * ms, ok, ""},
			{1300 * ms, limited, "1"},
			{2000 * ms, ok, ""},
		}},
		{"sliding rejections do not count", &Mock{Kind: "sliding", Rate: 1, Window: time.Minute}, []step{
			{0, ok, ""},
			{10 * sec, limited, "50"},
			{20 * sec, limited, "40"},
			{59*sec + 500*ms, limited, "1"},
			{60 * sec, ok, ""},
			{61 * sec, limited, "59"},
		}},
		{"sliding date", &Mock{Kind: "sliding", Rate: 1, Window: time.Minute, RetryAfter: "date"}, []step{
			{0, ok, ""},
			// next admission at base+60s = ...060.25, rounded up to ...061
			{10 * sec, limited, time.Unix(1_700_000_061, 0).UTC().Format(httpDate)},
		}},
		{"gcra date", &Mock{Kind: "gcra", Rate: 4, Window: sec, RetryAfter: "date"}, []step{
			{0, ok, ""},
			// next admission at base+250ms = ...000.5, rounded up to ...001
			{0, limited, time.Unix(1_700_000_001, 0).UTC().Format(httpDate)},
			{750 * ms, ok, ""},
			// next admission at base+1s = ...001.25, rounded up to ...002
			{760 * ms, limited, time.Unix(1_700_000_002, 0).UTC().Format(httpDate)},
		}},
		{"gcra none", &Mock{Kind: "gcra", Rate: 1, Window: sec, RetryAfter: "none"}, []step{
			{0, ok, ""},
			{0, limited, ""},
		}},
		{"sliding with no rate admits nothing", &Mock{Kind: "sliding", Window: sec}, []step{
			{0, limited, "1"},
		}},
		{"gcra with no rate admits nothing", &Mock{Kind: "gcra", Window: 2 * sec}, []step{
			{0, limited, "2"},
		}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			run(t, tt.vendor, tt.steps)
		})
	}
}

func TestHeaders(t *testing.T) {
	clk := &fakeClock{t: base}
	get := func(v *Mock) http.Header {
		t.Helper()
		v.now = clk.Now
		rec := httptest.NewRecorder()
		v.ServeHTTP(rec, httptest.NewRequest(http.MethodGet, "/x", nil))
		return rec.Header()
	}
	fixed := &Mock{Rate: 5, Window: sec, Headers: "x-ratelimit"}
	h := get(fixed)
	if h.Get("X-RateLimit-Limit") != "5" || h.Get("X-RateLimit-Remaining") != "4" || h.Get("X-RateLimit-Reset") != "1" {
		t.Fatalf("fixed x-ratelimit headers: %v", h)
	}
	ietf := &Mock{Rate: 5, Window: sec, Headers: "ietf"}
	h = get(ietf)
	if h.Get("RateLimit-Policy") != `"default";q=5;w=1` || h.Get("RateLimit") != `"default";r=4;t=1` {
		t.Fatalf("fixed ietf headers: %v", h)
	}
	for _, kind := range []string{"sliding", "gcra"} {
		for _, mode := range []string{"x-ratelimit", "ietf"} {
			h := get(&Mock{Kind: kind, Rate: 5, Window: sec, Headers: mode})
			for _, name := range []string{"X-RateLimit-Limit", "X-RateLimit-Remaining", "X-RateLimit-Reset", "RateLimit-Policy", "RateLimit"} {
				if h.Get(name) != "" {
					t.Errorf("%s with Headers %q sent %s: %q", kind, mode, name, h.Get(name))
				}
			}
		}
	}
}

func TestUnknownKind(t *testing.T) {
	v := &Mock{Kind: "token", Rate: 5, Window: sec}
	rec := httptest.NewRecorder()
	v.ServeHTTP(rec, httptest.NewRequest(http.MethodGet, "/x", nil))
	if rec.Code != http.StatusInternalServerError {
		t.Fatalf("status %d, want 500", rec.Code)
	}
	if got := v.Summarize().Requests; got != 1 {
		t.Fatalf("recorded %d requests, want 1", got)
	}
}

// TestSlidingBounded checks that the sliding log keeps only Rate times.
func TestSlidingBounded(t *testing.T) {
	clk := &fakeClock{t: base}
	v := &Mock{Kind: "sliding", Rate: 7, Window: 100 * ms, now: clk.Now}
	admitted := 0
	for i := range 10_000 {
		clk.Set(base.Add(time.Duration(i) * ms))
		rec := httptest.NewRecorder()
		v.ServeHTTP(rec, httptest.NewRequest(http.MethodGet, "/x", nil))
		if rec.Code == ok {
			admitted++
		}
	}
	if len(v.log) != 7 || cap(v.log) > 8 {
		t.Fatalf("sliding log holds %d times (cap %d), want 7", len(v.log), cap(v.log))
	}
	// 10 s of one request per ms at 7 per 100 ms: 700 admitted.
	if admitted != 700 {
		t.Fatalf("admitted %d, want 700", admitted)
	}
	if s := v.Summarize(); s.MaxSliding != 100 || s.RateLimited != 10_000-700 {
		t.Fatalf("summary %+v", s)
	}
}

// TestKindsConcurrent runs every kind under concurrent requests on the
// real clock: no more than the limit is admitted, and -race sees no race.
func TestKindsConcurrent(t *testing.T) {
	for _, kind := range []string{"fixed", "sliding", "gcra"} {
		t.Run(kind, func(t *testing.T) {
			// For "fixed", now lies mid-window: no window starts during the test.
			phase := time.Duration(time.Now().UnixNano())%time.Hour - 30*time.Minute
			v := &Mock{Kind: kind, Rate: 10, Window: time.Hour, Phase: phase, Burst: 10}
			var wg sync.WaitGroup
			for range 50 {
				wg.Go(func() {
					rec := httptest.NewRecorder()
					v.ServeHTTP(rec, httptest.NewRequest(http.MethodGet, "/x", nil))
					if rec.Code == limited {
						if n, err := strconv.Atoi(rec.Header().Get("Retry-After")); err != nil || n < 1 {
							t.Errorf("Retry-After %q", rec.Header().Get("Retry-After"))
						}
					}
				})
			}
			wg.Wait()
			if s := v.Summarize(); s.Requests != 50 || s.RateLimited != 40 {
				t.Fatalf("summary %+v, want 50 requests and 40 limited", s)
			}
		})
	}
}

// TestJitterBounds checks that 200 delays fall within [Min, Max] and
// spread over it.
func TestJitterBounds(t *testing.T) {
	const lo, hi = 10 * time.Millisecond, 50 * time.Millisecond
	var mu sync.Mutex
	var slept []time.Duration
	var served int
	j := &Jitter{
		Next: http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) { served++ }),
		Min:  lo, Max: hi,
		sleep: func(d time.Duration) {
			mu.Lock()
			defer mu.Unlock()
			slept = append(slept, d)
		},
	}
	for range 200 {
		j.ServeHTTP(httptest.NewRecorder(), httptest.NewRequest(http.MethodGet, "/x", nil))
	}
	if served != 200 || len(slept) != 200 {
		t.Fatalf("served %d and slept %d times, want 200", served, len(slept))
	}
	least, most := slept[0], slept[0]
	for _, d := range slept {
		if d < lo || d > hi {
			t.Fatalf("delay %v outside [%v, %v]", d, lo, hi)
		}
		least, most = min(least, d), max(most, d)
	}
	// Uniform: 200 draws miss the bottom or top tenth with probability
	// 0.9^200, about 1e-9.
	if tenth := (hi - lo) / 10; least > lo+tenth || most < hi-tenth {
		t.Fatalf("delays span [%v, %v], want close to [%v, %v]", least, most, lo, hi)
	}
}

func TestJitterDegenerate(t *testing.T) {
	for _, tt := range []struct{ min, max, want time.Duration }{
		{0, 0, 0},
		{5, 5, 5},
		{7, 3, 7},
	} {
		j := &Jitter{Min: tt.min, Max: tt.max}
		if got := j.delay(); got != tt.want {
			t.Errorf("delay with Min %v, Max %v = %v, want %v", tt.min, tt.max, got, tt.want)
		}
	}
}

// TestJitterSleeps checks on the real clock that each request reaches Next
// no sooner than Min after it arrived, and not very long after Max.
func TestJitterSleeps(t *testing.T) {
	const lo, hi = 2 * time.Millisecond, 6 * time.Millisecond
	var reached time.Time
	j := &Jitter{Next: http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) { reached = time.Now() }), Min: lo, Max: hi}
	var late int
	for range 200 {
		start := time.Now()
		j.ServeHTTP(httptest.NewRecorder(), httptest.NewRequest(http.MethodGet, "/x", nil))
		d := reached.Sub(start)
		if d < lo {
			t.Fatalf("request reached Next after %v, want at least %v", d, lo)
		}
		if d > hi+5*time.Millisecond {
			late++
		}
	}
	// Sleeps overshoot on a busy machine; most must not.
	if late > 20 {
		t.Fatalf("%d of 200 requests reached Next more than 5 ms after Max", late)
	}
}

// TestJitterConcurrent sends 50 requests at once through a server: they
// are delayed side by side, not one after another.
func TestJitterConcurrent(t *testing.T) {
	vend := &Mock{Rate: 1000, Window: time.Second}
	srv := httptest.NewServer(&Jitter{Next: vend, Max: 50 * time.Millisecond})
	defer srv.Close()
	tr := &http.Transport{MaxIdleConnsPerHost: 50}
	defer tr.CloseIdleConnections()
	client := &http.Client{Transport: tr}
	start := time.Now()
	var wg sync.WaitGroup
	for range 50 {
		wg.Go(func() {
			resp, err := client.Get(srv.URL + "/x")
			if err != nil {
				t.Error(err)
				return
			}
			resp.Body.Close()
			if resp.StatusCode != http.StatusOK {
				t.Errorf("status %d", resp.StatusCode)
			}
		})
	}
	wg.Wait()
	// One after another would take about 50 * 25 ms on average.
	if took := time.Since(start); took > time.Second {
		t.Fatalf("50 concurrent requests took %v, want well under 50 * 50 ms", took)
	}
	if s := vend.Summarize(); s.Requests != 50 {
		t.Fatalf("vendor saw %d requests, want 50", s.Requests)
	}
}
