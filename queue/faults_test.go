package queue

import (
	"net/http"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/hibiken/asynq"

	"github.com/shaper-dev/shaper/internal/vendorsim"
	"github.com/shaper-dev/shaper/internal/windows"
	"github.com/shaper-dev/shaper/shaper"
)

// TestFaultRetriesThrough5xxAndHangs is G6 through vendor faults, quick
// enough for make test: the workers run in process with a 1 s retry
// backoff (the CLI run, TestLongFaultVendor5xxBurstsAndHangs, waits out
// asynq's default backoff of 15 s and more). The vendor answers 503 to
// a second's worth of calls (50) and hangs past the call timeout on 5 calls:
// every call completes, none is archived, and every attempt at a call
// carries the same Idempotency-Key.
func TestFaultRetriesThrough5xxAndHangs(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	var (
		seen atomic.Int64
		hung atomic.Int64
	)
	vend := &vendorsim.Mock{Rate: 50, Window: time.Second}
	// A second's worth of requests at 50/s answered 503, counted rather
	// than timed: on a busy machine a timed second can fall between two
	// requests.
	vend.Status = func(r *http.Request) int {
		if n := seen.Add(1); n > 25 && n <= 75 {
			return http.StatusServiceUnavailable
		}
		return http.StatusOK
	}
	vend.Hang = func(r *http.Request) time.Duration {
		if strings.HasSuffix(r.Header.Get("Idempotency-Key"), "7") && hung.Add(1) <= 5 {
			return 2 * time.Second // past the 500 ms timeout
		}
		return 0
	}
	p := shaper.Policy{Limits: []shaper.Limit{{Rate: 50, Window: time.Second}}}
	name := e.vendor("flaky", p, 0, vend)
	e.vendors[0].Timeout = 500 * time.Millisecond
	c := e.newClient()
	const n = 150
	enqueueN(t, c, name, n)
	e.startWorker(nil)
	e.startWorker(nil)
	insp := asynq.NewInspectorFromRedisClient(e.rdb())
	var info *asynq.QueueInfo
	waitFor(t, time.Minute, "every call to complete or be archived", func() bool {
		i, err := insp.GetQueueInfo(QueueName(name)) // can fail transiently: poll again
		if err == nil {
			info = i
		}
		return err == nil && i.Completed+i.Archived == n
	})
	s := vend.Summarize()
	keys := map[string]map[string]bool{} // path -> Idempotency-Keys
	failed := 0
	for _, r := range vend.Requests() {
		if keys[r.Path] == nil {
			keys[r.Path] = map[string]bool{}
		}
		keys[r.Path][r.Key] = true
		if r.Status == http.StatusServiceUnavailable {
			failed++
		}
	}
	t.Logf("fault report: %d calls, %d completed, %d archived; %d requests, %d answered 503, %d hung past the timeout, %d duplicate successes (same Idempotency-Key), most %d in a sliding window (limit %d)",
		n, info.Completed, info.Archived, s.Requests, failed, min(hung.Load(), 5), s.DuplicateKeys, s.MaxSliding, vend.Rate)
	if failed == 0 || hung.Load() < 5 {
		t.Fatalf("%d 503s and %d hangs: the faults never happened", failed, hung.Load())
	}
	if info.Archived != 0 || s.DistinctKeys != n {
		t.Errorf("%d calls archived, %d of %d succeeded at the vendor", info.Archived, s.DistinctKeys, n)
	}
	for path, ks := range keys {
		if len(ks) != 1 {
			t.Errorf("the attempts at %s carried %d Idempotency-Keys, want 1", path, len(ks))
		}
	}
	// G1 through the faults, in sliding windows a guard shorter than the
	// vendor's: a request's timestamp here can lag its start by more than
	// the jitter the design leaves (guard - tolerance) when the machine is
	// busy, since the vendor runs in this race-instrumented process. A
	// burst still fails it.
	var ts []time.Time
	for _, r := range vend.Requests() {
		ts = append(ts, r.At)
	}
	short := windows.MaxSliding(ts, time.Second-shaper.DefaultGuard)
	if s.RateLimited != 0 || short > vend.Rate {
		t.Errorf("G1 through the faults: %d 429s, %d calls in a sliding %s", s.RateLimited, short, time.Second-shaper.DefaultGuard)
	}
}
