package queue

import (
	"net/http"
	"testing"
	"time"

	"github.com/shaper-dev/shaper/internal/redistest"
	"github.com/shaper-dev/shaper/internal/vendorsim"
	"github.com/shaper-dev/shaper/shaper"
)

// TestLearnsTheVendorsRealLimit is G5 in make test: each vendor is
// configured at twice its real limit (40/s against 20 per fixed second at
// a random phase); after 6 s, at most 3 429s in the following 10 s and at
// least 90% of the real limit delivered. The quiet period before a step
// back up is 30 s here, past the end of the run: one step up costs a 429
// and its pause, a few percent of 10 s but not of the minute over which
// TestLongLearnsTheVendorsRealLimit holds the same scenarios, with the
// default 10 s quiet period. (shaper's TestThrottleAndRecover covers the
// steps up on their own.)
func TestLearnsTheVendorsRealLimit(t *testing.T) {
	t.Parallel()
	learnsTheRealLimit(t, shaper.Adapt{Quiet: 30 * time.Second}, 6*time.Second, 10*time.Second, 3)
}

// TestLongLearnsTheVendorsRealLimit configures each vendor at twice its
// real limit (40/s against 20 per fixed second at a random phase) and
// checks that shaper learns: after 10 s, no more than a handful of 429s in
// the following minute and at least 90% of the real limit delivered.
func TestLongLearnsTheVendorsRealLimit(t *testing.T) {
	redistest.Long(t)
	t.Parallel()
	learnsTheRealLimit(t, shaper.Adapt{}, 10*time.Second, 60*time.Second, 5)
}

// learnsTheRealLimit runs every learning scenario side by side (light
// traffic), with adapt as the vendor's adaptation settings: learn, then
// measure 429s and delivery over measure.
func learnsTheRealLimit(t *testing.T, adapt shaper.Adapt, learn, measure time.Duration, max429 int) {
	const trueRate, configured = 20, 40
	scenarios := []struct {
		name       string
		retryAfter string
		headers    string
		replicas   int
	}{
		{"Retry-After seconds", "seconds", "none", 1},
		{"Retry-After HTTP-date", "date", "none", 1},
		{"no Retry-After, no headers", "none", "none", 1},
		{"X-RateLimit headers", "none", "x-ratelimit", 1},
		{"IETF RateLimit headers", "none", "ietf", 1},
		{"three replicas, Retry-After seconds", "seconds", "none", 3},
	}
	for _, sc := range scenarios {
		t.Run(sc.name, func(t *testing.T) {
			t.Parallel()
			e := newEnv(t)
			vend := &vendorsim.Vendor{Rate: trueRate, Window: time.Second, Phase: randomPhase(time.Second),
				RetryAfter: sc.retryAfter, Headers: sc.headers}
			name := e.vendor("learn", shaper.Policy{Limits: []shaper.Limit{{Rate: configured, Window: time.Second}}, Adapt: adapt}, 0, vend)
			c := e.newClient()
			enqueueN(t, c, name, 2500)
			start := time.Now()
			for range sc.replicas {
				e.startWorker(nil)
			}
			time.Sleep(learn + measure) // traffic: the measured period
			var early429, late429, lateOK int
			for _, r := range vend.Requests() {
				inLearn := r.At.Before(start.Add(learn))
				switch {
				case r.Status == http.StatusTooManyRequests && inLearn:
					early429++
				case r.Status == http.StatusTooManyRequests:
					late429++
				case !inLearn && r.Status < 300:
					lateOK++
				}
			}
			delivered := float64(lateOK) / measure.Seconds()
			t.Logf("%s: 429s %d in the first %s, %d in the following %s; delivered %.2f calls/s of the vendor's %d (%.0f%%)",
				sc.name, early429, learn, late429, measure, delivered, trueRate, 100*delivered/trueRate)
			if late429 > max429 {
				t.Errorf("%d 429s in the %s after learning, want a handful (<= %d)", late429, measure, max429)
			}
			if delivered < 0.9*trueRate {
				t.Errorf("delivered %.2f calls/s, want >= 90%% of %d", delivered, trueRate)
			}
		})
	}
}
