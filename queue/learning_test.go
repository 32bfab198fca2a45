package queue

import (
	"net/http"
	"testing"
	"time"

	"github.com/shaper-dev/shaper/internal/vendorsim"
	"github.com/shaper-dev/shaper/shaper"
)

// TestLearnsTheVendorsRealLimit configures each vendor at twice its real
// limit (40/s against 20 per fixed second at a random phase) and checks
// that shaper learns: after 10 s, no more than a handful of 429s in the
// following minute and at least 90% of the real limit delivered.
func TestLearnsTheVendorsRealLimit(t *testing.T) {
	if testing.Short() {
		t.Skip("runs 70 s of traffic; -short skips it")
	}
	const trueRate, configured = 20, 40
	const learn, measure = 10 * time.Second, 60 * time.Second
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
			name := e.vendor("learn", shaper.Policy{Limits: []shaper.Limit{{Rate: configured, Window: time.Second}}}, 0, vend)
			c := e.newClient()
			enqueueN(t, c, name, 2500)
			start := time.Now()
			for range sc.replicas {
				e.startWorker(nil)
			}
			time.Sleep(learn + measure)
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
			if late429 > 5 {
				t.Errorf("%d 429s in the minute after learning, want a handful (<= 5)", late429)
			}
			if delivered < 0.9*trueRate {
				t.Errorf("delivered %.2f calls/s, want >= 90%% of %d", delivered, trueRate)
			}
		})
	}
}
