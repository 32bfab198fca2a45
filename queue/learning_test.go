package queue

import (
	"context"
	"fmt"
	"net/http"
	"testing"
	"time"

	"github.com/shaper-dev/shaper/internal/redistest"
	"github.com/shaper-dev/shaper/internal/vendorsim"
	"github.com/shaper-dev/shaper/internal/windows"
	"github.com/shaper-dev/shaper/shaper"
)

// TestLearnsTheVendorsRealLimit is G5 in make test for vendors that
// announce their limit in rate-limit headers: each is configured at twice
// its real limit (40/s against 20 per fixed second at a random phase);
// after 6 s, at most 3 429s in the following 10 s, and calls still
// accepted (the share of the real limit delivered is logged). The quiet
// period before a step back up is 30 s here, past the end of the run.
// Vendors that announce nothing are TestConvergesOnTheTrueLimit's.
func TestLearnsTheVendorsRealLimit(t *testing.T) {
	t.Parallel()
	learnsTheRealLimit(t, shaper.Adapt{Quiet: 30 * time.Second}, 6*time.Second, 10*time.Second, 3)
}

// TestLongLearnsTheVendorsRealLimit configures each vendor that announces
// its limit at twice its real limit (40/s against 20 per fixed second at a
// random phase) and checks that shaper learns: after 10 s, no more than a
// handful of 429s in the following minute, and calls still accepted (the
// share of the real limit delivered is logged).
func TestLongLearnsTheVendorsRealLimit(t *testing.T) {
	redistest.Long(t)
	t.Parallel()
	learnsTheRealLimit(t, shaper.Adapt{}, 10*time.Second, 60*time.Second, 5)
}

// learnsTheRealLimit runs every learning scenario side by side (light
// traffic), with adapt as the vendor's adaptation settings: learn, then
// measure 429s and delivery over measure. Wall clock: the 429s are
// asserted, the delivered share is logged.
func learnsTheRealLimit(t *testing.T, adapt shaper.Adapt, learn, measure time.Duration, max429 int) {
	const trueRate, configured = 20, 40
	scenarios := []struct {
		name       string
		retryAfter string
		headers    string
		replicas   int
	}{
		{"X-RateLimit headers", "none", "x-ratelimit", 1},
		{"IETF RateLimit headers", "none", "ietf", 1},
	}
	for _, sc := range scenarios {
		t.Run(sc.name, func(t *testing.T) {
			t.Parallel()
			e := newEnv(t)
			vend := &vendorsim.Mock{Rate: trueRate, Window: time.Second, Phase: randomPhase(time.Second),
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
			if lateOK == 0 {
				t.Errorf("no call accepted in the %s after learning", measure)
			}
		})
	}
}

// convergence is one vendor a convergence test runs against.
type convergence struct {
	kind       string // vendorsim Kind
	retryAfter string
	replicas   int
}

func (c convergence) String() string {
	return fmt.Sprintf("%s, Retry-After %s, %d replica(s)", c.kind, c.retryAfter, c.replicas)
}

// converges configures a vendor at twice its true limit (60/s against
// 30/s), with no rate-limit headers, and measures over run from the first
// call: the share of the true limit delivered and the HTTP 429s.
func converges(t *testing.T, sc convergence, run time.Duration) (share float64, refused int) {
	t.Helper()
	const trueRate, configured = 30, 60
	e := newEnv(t)
	vend := &vendorsim.Mock{Kind: sc.kind, Rate: trueRate, Window: time.Second, Phase: randomPhase(time.Second),
		RetryAfter: sc.retryAfter, Burst: 2}
	name := e.vendor("conv", shaper.Policy{Limits: []shaper.Limit{{Rate: configured, Window: time.Second}}}, 0, vend)
	c := e.newClient()
	enqueueN(t, c, name, int(run.Seconds()*trueRate*1.3))
	for range sc.replicas {
		e.startWorker(nil)
	}
	waitFor(t, 30*time.Second, "the first call", func() bool { return len(vend.Requests()) > 0 })
	first := vend.Requests()[0].At
	time.Sleep(time.Until(first.Add(run))) // traffic: the measured run
	var ok int
	var when []string
	for _, r := range vend.Requests() {
		if r.At.Sub(first) >= run {
			break
		}
		switch {
		case r.Status == http.StatusTooManyRequests:
			refused++
			when = append(when, r.At.Sub(first).Round(time.Millisecond).String())
		case r.Status < 300:
			ok++
		}
	}
	st := e.stats(name)
	t.Logf("%s: 429s at %v; effective rate %.2f (%s: %s; guard %s)", sc, when, st.EffectiveRate, st.Source, st.RateReason, st.Guard)
	return float64(ok) / (run.Seconds() * trueRate), refused
}

// TestConvergesOnTheTrueLimit is issue 11's bar in make test, on a
// shorter run: configured at twice the true limit of a fixed-window,
// sliding-log and GCRA vendor, shaper learns the limit from the calls the
// vendor accepted before refusing one: over 10 s from the first call, at
// most 10 429s and calls accepted. TestLongConvergesOnTheTrueLimit holds
// every Retry-After form over a minute to 10 429s. On the wall clock the
// share of the true limit is logged, not asserted (issue 11 asks for 90%,
// 95% over a minute; measured in the README);
// TestLearningSimulated (./shaper) asserts it on simulated
// time.
func TestConvergesOnTheTrueLimit(t *testing.T) {
	t.Parallel()
	for _, sc := range []convergence{{"fixed", "seconds", 1}, {"sliding", "none", 3}, {"gcra", "date", 1}} {
		t.Run(sc.String(), func(t *testing.T) {
			t.Parallel()
			share, refused := converges(t, sc, 10*time.Second)
			t.Logf("%s: %.1f%% of the true limit over 10 s, %d 429s", sc, 100*share, refused)
			if share == 0 || refused > 10 {
				t.Errorf("%s: %.1f%% of the true limit, %d 429s; want calls accepted and <= 10 429s", sc, 100*share, refused)
			}
		})
	}
}

// TestConfiguredBelowTheTrueLimit configures a vendor at half its true
// limit (30/s against 60/s): nothing is learned, the configured rate is
// kept and never exceeded (the calls delivered in 10 s are logged).
func TestConfiguredBelowTheTrueLimit(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	vend := &vendorsim.Mock{Kind: "sliding", Rate: 60, Window: time.Second}
	name := e.vendor("below", shaper.Policy{Limits: []shaper.Limit{{Rate: 30, Window: time.Second}}}, 0, vend)
	c := e.newClient()
	enqueueN(t, c, name, 400)
	e.startWorker(nil)
	waitFor(t, 30*time.Second, "the first call", func() bool { return len(vend.Requests()) > 0 })
	first := vend.Requests()[0].At
	time.Sleep(time.Until(first.Add(10 * time.Second))) // traffic: the measured run
	var ts []time.Time
	refused := 0
	for _, r := range vend.Requests() {
		if r.At.Sub(first) < 10*time.Second {
			ts = append(ts, r.At)
			if r.Status == http.StatusTooManyRequests {
				refused++
			}
		}
	}
	most := windows.MaxSliding(ts, time.Second)
	st := e.stats(name)
	t.Logf("configured 30/s against a vendor allowing 60/s: %d calls in 10 s, at most %d in a sliding second, %d 429s; source %q", len(ts), most, refused, st.Source)
	if refused > 0 || most > 30 || st.Source != "configured" {
		t.Errorf("%d 429s, %d calls in a sliding second, source %q; want none, <= 30, configured", refused, most, st.Source)
	}
}

func TestLongConvergesOnTheTrueLimit(t *testing.T) {
	redistest.Long(t)
	// Not parallel with the package's other tests: nine scenarios side by
	// side (make test-long runs them with -parallel 9), each a minute.
	// Every kind with every Retry-After form, each kind and each form at
	// 1 and at 3 replicas.
	replicas := map[string][]int{"fixed": {1, 3, 1}, "sliding": {3, 1, 3}, "gcra": {1, 3, 3}}
	for _, kind := range []string{"fixed", "sliding", "gcra"} {
		for i, ra := range []string{"seconds", "date", "none"} {
			sc := convergence{kind, ra, replicas[kind][i]}
			t.Run(sc.String(), func(t *testing.T) {
				t.Parallel()
				share, refused := converges(t, sc, time.Minute)
				t.Logf("%s: %.1f%% of the true limit over 60 s from the first call, %d 429s", sc, 100*share, refused)
				t.Logf("learn-report: | configured 60/s, %s, 60 s from the first call | %.1f%% | %d | |", sc, 100*share, refused)
				if share == 0 || refused > 10 {
					t.Errorf("%s: %.1f%% of the true limit, %d 429s; want calls accepted and <= 10 429s", sc, 100*share, refused)
				}
			})
		}
	}
}

// stats reads the stats of vendor name's bucket.
func (e *env) stats(name string) shaper.Stats {
	e.t.Helper()
	for _, v := range e.vendors {
		if v.Name != name {
			continue
		}
		b, err := shaper.NewGate(e.rdb(), shaper.Config{KeyPrefix: e.prefix}).Bucket(bucketName(name), v.Policy)
		if err != nil {
			e.t.Fatal(err)
		}
		st, err := b.Stats(context.Background())
		if err != nil {
			e.t.Fatal(err)
		}
		return st
	}
	e.t.Fatalf("no vendor %s", name)
	return shaper.Stats{}
}
