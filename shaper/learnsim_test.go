package shaper

import (
	"container/heap"
	"context"
	"flag"
	"fmt"
	"math/rand/v2"
	"strings"
	"testing"
	"time"

	"github.com/shaper-dev/shaper/internal/redistest"
	"github.com/shaper-dev/shaper/internal/windows"
)

// The learning simulator runs the real gate (the reserve script on a real
// Redis, with Redis time overridden) and the real learning code
// (Control.Refused) against model vendors on a virtual clock: each call
// starts at its tick, reaches the vendor after a network delay, and a
// refusal is judged at the moment it arrives. Nothing sleeps, so the
// figures are the same on every machine.

// simTrace logs every refusal and the belief once a second of virtual
// time: go test ./shaper -run TestLearningSimulated/runs/fixed_20 -v -simtrace.
var simTrace = flag.Bool("simtrace", false, "log the simulator's refusals and the rate each virtual second")

// simVendor is a model vendor: admit says whether a call arriving at at
// (virtual µs, in arrival order) is accepted.
type simVendor interface{ admit(at int64) bool }

// fixedVendor allows limit calls per window of w starting at phase.
type fixedVendor struct {
	limit, w, phase int64
	k, n            int64
}

func (v *fixedVendor) admit(at int64) bool {
	if k := windows.FloorDiv(at-v.phase, v.w); k != v.k {
		v.k, v.n = k, 0
	}
	v.n++
	return v.n <= v.limit
}

// slidingVendor allows limit calls in any window of w (a sliding log).
type slidingVendor struct {
	limit, w int64
	log      []int64
}

func (v *slidingVendor) admit(at int64) bool {
	for len(v.log) > 0 && v.log[0] <= at-v.w {
		v.log = v.log[1:]
	}
	if int64(len(v.log)) >= v.limit {
		return false
	}
	v.log = append(v.log, at)
	return true
}

// gcraVendor is a token bucket of limit per w with a burst of two.
type gcraVendor struct {
	limit, w, tat int64
}

func (v *gcraVendor) admit(at int64) bool {
	T := v.w / v.limit
	if at < v.tat-T {
		return false
	}
	v.tat = max(v.tat, at) + T
	return true
}

// spacingVendor refuses a call that comes less than gap after the last
// one it accepted (nginx limit_req without burst).
type spacingVendor struct {
	gap, last int64
}

func (v *spacingVendor) admit(at int64) bool {
	if v.last != 0 && at-v.last < v.gap {
		return false
	}
	v.last = at
	return true
}

// simLate is how late after its tick a simulated call starts, at most
// (a quiet host).
const simLate = time.Millisecond

// simScenario is one simulated run.
type simScenario struct {
	kind       string // fixed, sliding, gcra, spacing
	limit      int    // the vendor's limit per second
	configured int    // shaper's configured rate per second
	retryAfter bool   // the vendor sends Retry-After: 1
	jitter     time.Duration
	phase      time.Duration
	replicas   int
	run        time.Duration
	strict     bool // configured with strict_spacing
	// fromRefusal: the run and its share count from the first 429, not
	// from the first call.
	fromRefusal bool
	guard       time.Duration // a configured (fixed) guard; 0: the default, measured
	seed        uint64
}

func (sc simScenario) String() string {
	ra := "no Retry-After"
	if sc.retryAfter {
		ra = "Retry-After"
	}
	s := fmt.Sprintf("%s %d/s, configured %d/s, %s, jitter 0-%s, phase %s", sc.kind, sc.limit, sc.configured, ra, sc.jitter, sc.phase)
	if sc.strict {
		s += ", strict_spacing"
	}
	if sc.guard > 0 {
		s += ", guard " + sc.guard.String()
	}
	if sc.fromRefusal {
		s += ", counted from the first 429"
	}
	if sc.run > 0 && sc.run != time.Minute {
		s += ", " + sc.run.String()
	}
	return s
}

// simResult is what the vendor saw.
type simResult struct {
	accepted, refused int
	gaveUp            int     // ticks given up: the start waited longer than its tolerance for the one before
	share             float64 // accepted calls over what the limit allows in the run, from the first call
	rate              float64 // the effective rate at the end
	guard             time.Duration
}

type arrival struct {
	arrive int64
	p      *Permit
}

type arrivals []arrival

func (h arrivals) Len() int           { return len(h) }
func (h arrivals) Less(i, j int) bool { return h[i].arrive < h[j].arrive }
func (h arrivals) Swap(i, j int)      { h[i], h[j] = h[j], h[i] }
func (h *arrivals) Push(x any)        { *h = append(*h, x.(arrival)) }
func (h *arrivals) Pop() any {
	old := *h
	c := old[len(old)-1]
	*h = old[:len(old)-1]
	return c
}

// simulateLearning runs sc: replicas gates share one bucket, taking turns to
// reserve the next tick.
func simulateLearning(t *testing.T, sc simScenario) simResult {
	t.Helper()
	ctx := context.Background()
	const w = int64(time.Second / time.Microsecond)
	start := int64(1_800_000_000)*w + sc.phase.Microseconds()
	clk := &redisClock{}
	clk.set(start)
	addr, prefix := redistest.Addr(t), redistest.Prefix(t)
	var buckets []*Bucket
	for range max(sc.replicas, 1) {
		r := newReplica(t, addr, prefix, virtualClock{clk})
		r.gate.testNow = clk.now
		b, err := r.gate.Bucket("sim", Policy{Limits: []Limit{{Rate: sc.configured, Window: time.Second}}, StrictSpacing: sc.strict, Guard: sc.guard})
		if err != nil {
			t.Fatal(err)
		}
		buckets = append(buckets, b)
	}
	// The state's expiry runs on the wall clock: held, it is the same on
	// a busy machine as on an idle one.
	defer holdState(t, redistest.Client(t), buckets[0])()
	var vendor simVendor
	switch sc.kind {
	case "fixed":
		vendor = &fixedVendor{limit: int64(sc.limit), w: w, k: -1 << 62}
	case "sliding":
		vendor = &slidingVendor{limit: int64(sc.limit), w: w}
	case "gcra":
		vendor = &gcraVendor{limit: int64(sc.limit), w: w}
	case "spacing":
		vendor = &spacingVendor{gap: w / int64(sc.limit)}
	default:
		t.Fatalf("unknown vendor kind %q", sc.kind)
	}
	rng := rand.New(rand.NewPCG(sc.seed, 7))
	var res simResult
	pending := &arrivals{}
	var lastSec int64
	var first int64 // the first call's arrival (or refusal, fromRefusal): shares count from it
	deliverUntil := func(to int64) {
		for pending.Len() > 0 && (*pending)[0].arrive <= to {
			c := heap.Pop(pending).(arrival)
			clk.set(c.arrive)
			ok := vendor.admit(c.arrive)
			if first == 0 && (!sc.fromRefusal || !ok) {
				first = c.arrive
			}
			if first == 0 {
				continue // before the count starts
			}
			if ok {
				res.accepted++
				continue
			}
			res.refused++
			ans := Answer{Reason: "HTTP 429", Pause: time.Second, PauseReason: "HTTP 429 without Retry-After", Jitter: sc.jitter}
			if sc.retryAfter {
				ans.RetryAfter, ans.PauseReason = true, "HTTP 429, Retry-After: 1"
			}
			d, err := c.p.bucket.Control().Refused(ctx, c.p, ans)
			if err != nil {
				t.Fatal(err)
			}
			if *simTrace {
				t.Logf("TRACE %.3f refused tick=%.3f %+v", float64(c.arrive-start)/1e6, float64(c.p.at-start)/1e6, d)
			}
		}
	}
	for i := 0; first == 0 || clk.now() < first+sc.run.Microseconds(); i++ {
		b := buckets[i%len(buckets)]
		if *simTrace && (clk.now()-start)/1000000 != lastSec {
			lastSec = (clk.now() - start) / 1000000
			st, _ := b.Stats(ctx)
			t.Logf("TRACE %d s: accepted %d refused %d rate %.2f guard %s reason %q", lastSec, res.accepted, res.refused, st.EffectiveRate, st.Guard, st.RateReason)
		}
		r := reserveOnce(t, b)
		if !r.ok {
			to := clk.now() + r.wait.Microseconds()
			deliverUntil(to)
			clk.set(to)
			continue
		}
		tick := clk.now() + r.wait.Microseconds()
		deliverUntil(tick)
		clk.set(tick)
		// The call starts up to simLate after its tick (what Acquire
		// measures), and the network takes up to the jitter (what the
		// transport measures as round trips).
		late := rng.Int64N(simLate.Microseconds() + 1)
		b.observeLate(time.Duration(late) * time.Microsecond)
		if gap := b.startGap(r); gap > 0 {
			// Spaced by actual starts (what holdTick does): the start
			// is stamped, and waits for the one before it.
			deliverUntil(tick + late)
			clk.set(tick + late)
			_, _, _, tol := b.spacing()
			if r.tolerance > 0 {
				tol = min(tol, r.tolerance)
			}
			wait, ok, err := b.stampStart(ctx, gap, tol-time.Duration(late)*time.Microsecond)
			if err != nil {
				t.Fatal(err)
			}
			if !ok {
				if err := b.giveUp(ctx, r.lease, gaveUpLate, r.tick, 1, r.tag); err != nil {
					t.Fatal(err)
				}
				res.gaveUp++
				continue
			}
			late += wait.Microseconds()
		}
		var delay int64
		if sc.jitter > 0 {
			delay = rng.Int64N(sc.jitter.Microseconds() + 1)
		}
		b.observeRoundTrip(time.Duration(delay) * time.Microsecond)
		heap.Push(pending, arrival{arrive: tick + late + delay, p: &Permit{bucket: b, lease: r.lease, at: r.tick}})
	}
	deliverUntil(first + sc.run.Microseconds())
	res.share = float64(res.accepted) / (float64(sc.limit) * sc.run.Seconds())
	st, err := buckets[0].Stats(ctx)
	if err != nil {
		t.Fatal(err)
	}
	res.rate, res.guard = st.EffectiveRate, st.Guard
	return res
}

// virtualClock is the local clock of a simulated gate: the virtual Redis
// time. Nothing in the simulator sleeps.
type virtualClock struct{ c *redisClock }

func (v virtualClock) Now() time.Time { return time.UnixMicro(v.c.now()) }
func (v virtualClock) Sleep(ctx context.Context, d time.Duration) error {
	v.c.advance(d)
	return ctx.Err()
}

// TestLearningSimulated holds the learning figures on the simulator, a
// minute of virtual time each, three replicas: configured at twice a
// fixed or sliding vendor's limit (30/s), with and without Retry-After,
// at several phases; 0-40 ms of network jitter before fixed and sliding
// vendors at 100/s with nothing but the rate configured; a vendor that
// enforces spacing (nginx limit_req without burst); a token bucket.
func TestLearningSimulated(t *testing.T) {
	t.Parallel()
	type bar struct {
		share   float64 // at least
		refused float64 // at most, per 1,000 calls (or in all, when perMil is false)
		perMil  bool
		// issue is the share issue 19 asks for, where the model does not
		// reach it yet: share is then a floor that catches a regression.
		issue float64
	}
	var cases []struct {
		sc  simScenario
		bar bar
	}
	add := func(sc simScenario, b bar) {
		sc.replicas = 3
		if sc.run == 0 {
			sc.run = time.Minute
		}
		cases = append(cases, struct {
			sc  simScenario
			bar bar
		}{sc, b})
	}
	for _, kind := range []string{"fixed", "sliding"} {
		for _, ra := range []bool{true, false} {
			for i, phase := range []time.Duration{137 * time.Millisecond, 503 * time.Millisecond, 911 * time.Millisecond} {
				add(simScenario{kind: kind, limit: 30, configured: 60, retryAfter: ra, phase: phase, jitter: 2 * time.Millisecond, seed: uint64(i)},
					bar{share: 0.94, refused: 10, issue: 0.95})
			}
		}
		// The first 429 teaches a margin (at least the round trips'
		// spread) and costs its pause: the sliding vendor with
		// Retry-After stays below the issue's 95%.
		b := bar{share: 0.94, refused: 3, perMil: true, issue: 0.95}
		add(simScenario{kind: kind, limit: 100, configured: 100, jitter: 40 * time.Millisecond, phase: 250 * time.Millisecond, seed: 1}, b)
		add(simScenario{kind: kind, limit: 100, configured: 100, jitter: 40 * time.Millisecond, retryAfter: true, phase: 750 * time.Millisecond, seed: 2}, b)
	}
	// shaper mock-vendor --rate 20 (a fixed window, Retry-After: 1) with
	// shaper configured at 30.
	add(simScenario{kind: "fixed", limit: 20, configured: 30, retryAfter: true, jitter: 2 * time.Millisecond, phase: 321 * time.Millisecond, seed: 6, fromRefusal: true},
		bar{share: 0.91, refused: 10, issue: 0.95})
	add(simScenario{kind: "gcra", limit: 30, configured: 60, retryAfter: true, jitter: 2 * time.Millisecond, seed: 3}, bar{share: 0.9, refused: 10})
	// Without strict_spacing, a spacing vendor's refusals among accepted
	// calls look like a sliding window a little below the rate: the
	// issue's 90% is not reached (about 74%); this floor catches a
	// regression only.
	add(simScenario{kind: "spacing", limit: 100, configured: 100, seed: 4}, bar{share: 0.7, refused: 10, perMil: true, issue: 0.9})
	add(simScenario{kind: "spacing", limit: 100, configured: 100, guard: 100 * time.Millisecond, seed: 4}, bar{share: 0.9, refused: 10, perMil: true})
	add(simScenario{kind: "spacing", limit: 100, configured: 100, strict: true, seed: 4}, bar{share: 0.9, refused: 10, perMil: true})
	// nginx limit_req without burst behind a front that sends
	// Retry-After: 1 on every 429, which pauses every replica for a
	// second: 1,000 calls' time (10 s), calls starting up to 1 ms after
	// their tick and reaching it within 0.5 ms of their start. Spaced by
	// their starts (stamped), a late start moves the next one: without
	// it these rows gave 41.6% and 52.0%. With nothing but the rate
	// configured, the first refusal and its second of pause cannot be
	// avoided: about 82% at most (issue 29 asks 90%).
	add(simScenario{kind: "spacing", limit: 100, configured: 100, retryAfter: true, jitter: 500 * time.Microsecond, run: 10 * time.Second, seed: 7},
		bar{share: 0.8, refused: 10, perMil: true, issue: 0.9})
	add(simScenario{kind: "spacing", limit: 100, configured: 100, retryAfter: true, strict: true, jitter: 500 * time.Microsecond, run: 10 * time.Second, seed: 7},
		bar{share: 0.9, refused: 10, perMil: true})
	// A quiet host: the measured guard (the default) gives 99%; a fixed
	// 20 ms one 98%.
	add(simScenario{kind: "fixed", limit: 100, configured: 100, jitter: 3 * time.Millisecond, phase: 400 * time.Millisecond, seed: 5}, bar{share: 0.99, refused: 0})
	add(simScenario{kind: "fixed", limit: 100, configured: 100, jitter: 3 * time.Millisecond, phase: 400 * time.Millisecond, seed: 5, guard: DefaultGuard}, bar{share: 0.975, refused: 0})

	var table strings.Builder
	fmt.Fprintf(&table, "\n| vendor | share of the limit | issue's bar | 429s | per 1,000 | rate at the end | guard |\n|---|---|---|---|---|---|---|\n")
	rows := make([]string, len(cases))
	t.Run("runs", func(t *testing.T) {
		for i, c := range cases {
			t.Run(c.sc.String(), func(t *testing.T) {
				t.Parallel() // virtual time: nothing here depends on the machine's speed
				res := simulateLearning(t, c.sc)
				perMil := 1000 * float64(res.refused) / float64(max(res.accepted+res.refused, 1))
				want := fmt.Sprintf("%.0f%%", 100*max(c.bar.share, c.bar.issue))
				if c.bar.issue > 0 && res.share < c.bar.issue {
					want += " (not reached)"
				}
				rows[i] = fmt.Sprintf("| %s | %.1f%% | %s | %d | %.1f | %.1f | %s |", c.sc, 100*res.share, want, res.refused, perMil, res.rate, res.guard)
				refused := float64(res.refused)
				if c.bar.perMil {
					refused = perMil
				}
				if res.share < c.bar.share || refused > c.bar.refused {
					t.Errorf("%s: %.1f%% of the limit, %d 429s (%.1f per 1,000); want >= %.0f%% and <= %g",
						c.sc, 100*res.share, res.refused, perMil, 100*c.bar.share, c.bar.refused)
				}
			})
		}
	})
	for _, row := range rows {
		fmt.Fprintln(&table, row)
		t.Log("sim-report: " + row) // make bench-learn copies these into docs/learning.md
	}
	t.Log(table.String())
}
