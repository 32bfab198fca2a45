package shaper

import (
	"math"
	"math/rand/v2"
	"strconv"
	"testing"
	"time"

	"github.com/shaper-dev/shaper/internal/redistest"
)

// TestMeter: the measured margin waits for MeasureSamples; its tolerance
// is the one that costs the fewest calls (starts later than it against
// what its guard costs), so a rare late start does not widen the guard
// and common ones do; its guard is the edge model's for calls arriving
// within the tolerance and the round trips' spread (at least the
// tolerance and MarginOver, at most MaxMargin); it widens at once,
// narrows only a period after it last changed, and forgets a spike after
// two periods.
func TestMeter(t *testing.T) {
	a := Adapt{}.withDefaults()
	m := newMeter(nil)
	const calls, burst = 100, 1
	// edge is the model's guard for 100 calls a second reaching the
	// vendor within spread of their tick, rounded up to a millisecond.
	edge := func(spread time.Duration) time.Duration {
		g := edgeGuard(calls, burst, time.Second, spread, 100*time.Millisecond, a.Overrun)
		return (g + time.Millisecond - 1).Truncate(time.Millisecond)
	}
	if g := edge(43 * time.Millisecond); g < 15*time.Millisecond || g > 30*time.Millisecond {
		t.Fatalf("the model's guard for 43 ms of spread at 100/s: %s, want 15-30 ms", g)
	}
	t0 := time.Unix(1_800_000_000, 0)
	feed := func(m *meter, at time.Time, n int, late, rtt, spread time.Duration) {
		for i := range n {
			m.late(a, at, late)
			m.roundTrip(a, at, rtt+time.Duration(i%2)*spread)
		}
	}
	margin := func(m *meter, at time.Time) (time.Duration, time.Duration, bool) {
		return m.margin(a, calls, burst, time.Second, at)
	}
	if _, _, ok := margin(m, t0); ok {
		t.Fatal("a margin before any call")
	}
	feed(m, t0, a.MeasureSamples-1, time.Millisecond, 5*time.Millisecond, time.Millisecond)
	if _, _, ok := margin(m, t0); ok {
		t.Fatalf("a margin after %d calls, want none before %d", a.MeasureSamples-1, a.MeasureSamples)
	}
	feed(m, t0, 1, time.Millisecond, 5*time.Millisecond, time.Millisecond)
	// Calls 1 ms late: the tolerance is MinTolerance (3 ms); calls arrive
	// within it and 1 ms of spread, where the model asks less than the
	// tolerance + 2 ms over = 5 ms.
	if e := edge(4 * time.Millisecond); e >= 5*time.Millisecond {
		t.Fatalf("the model's guard for 4 ms of spread: %s, want less than 5 ms", e)
	}
	if g, tol, ok := margin(m, t0); !ok || g != 5*time.Millisecond || tol != 3*time.Millisecond {
		t.Errorf("quiet: guard %s, tolerance %s (%v), want 5ms, 3ms", g, tol, ok)
	}
	// One start in a thousand 12 ms late: giving its tick up costs 0.1%
	// of the calls, a guard to cover it (14 ms) 0.9% more: the tolerance
	// stays.
	feed(m, t0, 1000, time.Millisecond, 5*time.Millisecond, time.Millisecond)
	feed(m, t0, 1, 12*time.Millisecond, 5*time.Millisecond, time.Millisecond)
	if g, tol, _ := margin(m, t0); g != 5*time.Millisecond || tol != 3*time.Millisecond {
		t.Errorf("a rare late start: guard %s, tolerance %s, want 5ms, 3ms", g, tol)
	}
	// A third of the starts 4 ms late: a tolerance of 4 ms and a guard of
	// 6 ms (0.1% of the calls) cost far less than their ticks. No new
	// latest start: the choice is made again a tenth of a period later.
	feed(m, t0, 600, 4*time.Millisecond, 5*time.Millisecond, time.Millisecond)
	if g, tol, _ := margin(m, t0); g != 5*time.Millisecond || tol != 3*time.Millisecond {
		t.Errorf("many starts 4 ms late, at once: guard %s, tolerance %s, want 5ms, 3ms until the next choice", g, tol)
	}
	if g, tol, _ := margin(m, t0.Add(a.MeasurePeriod/10)); g != 6*time.Millisecond || tol != 4*time.Millisecond {
		t.Errorf("many starts 4 ms late: guard %s, tolerance %s, want 6ms, 4ms", g, tol)
	}
	// A jittery network: 40 ms of spread widens it at once.
	jittery := edge(44 * time.Millisecond)
	feed(m, t0.Add(time.Second), 4, time.Millisecond, 5*time.Millisecond, 40*time.Millisecond)
	if g, _, _ := margin(m, t0.Add(time.Second)); g != jittery {
		t.Errorf("jitter: guard %s, want %s", g, jittery)
	}
	// Quiet again: the spike counts while it is in the last two periods,
	// and the guard narrows once a period.
	p := a.MeasurePeriod
	feed(m, t0.Add(p), a.MeasureSamples, time.Millisecond, 5*time.Millisecond, time.Millisecond)
	if g, _, _ := margin(m, t0.Add(p)); g != jittery {
		t.Errorf("a period later: guard %s, want the spike's %s", g, jittery)
	}
	feed(m, t0.Add(2*p+time.Second), a.MeasureSamples, time.Millisecond, 5*time.Millisecond, time.Millisecond)
	if g, _, _ := margin(m, t0.Add(2*p+time.Second)); g != 5*time.Millisecond {
		t.Errorf("two periods later: guard %s, want 5ms again", g)
	}
	// Never more than MaxMargin of the window, never less than
	// MinTolerance + MarginOver.
	m2 := newMeter(nil)
	feed(m2, t0, a.MeasureSamples, 0, 0, 0)
	if g, _, _ := margin(m2, t0); g != a.MinTolerance+a.MarginOver {
		t.Errorf("nothing late, no spread: guard %s, want %s", g, a.MinTolerance+a.MarginOver)
	}
	feed(m2, t0, a.MeasureSamples, 0, 0, time.Second)
	if g, _, _ := margin(m2, t0); g != 100*time.Millisecond {
		t.Errorf("a second of spread: guard %s, want a tenth of the window", g)
	}
}

// TestEdgeModel checks the measured guard's model of a fixed window's
// edges (edgeOverrun) against a count of the same thing: calls ticked at
// the model's spacing, at random phases, each delayed uniformly within
// the spread, counted in one window. It also checks that edgeGuard is the
// narrowest guard the model allows, and that a wider spread, a burst or
// a tighter overrun asks for more.
func TestEdgeModel(t *testing.T) {
	rng := rand.New(rand.NewPCG(1, 2))
	for _, c := range []struct {
		calls, burst int
		g, spread    float64 // µs
	}{
		{100, 1, 0, 40000}, {100, 1, 10000, 43000}, {100, 1, 20000, 43000}, {100, 1, 5000, 6000},
		{10, 1, 5000, 43000}, {20, 2, 10000, 30000}, {1000, 1, 5000, 43000}, {2, 1, 2000, 43000},
	} {
		const w = 1e6
		d := float64(c.burst) * (w + c.g) / float64(c.calls)
		const windows = 40000
		over := 0
		for range windows {
			phi := rng.Float64() * d
			n := 0
			for t := phi - float64(int(c.spread/d)+1)*d; t < w; t += d {
				for range c.burst {
					if a := t + rng.Float64()*c.spread; a >= 0 && a < w {
						n++
					}
				}
			}
			if n > c.calls {
				over++
			}
		}
		counted := float64(over) / windows
		model := edgeOverrun(c.calls, c.burst, w, c.g, c.spread)
		// Within four standard errors of the count, and 0.002 for the
		// phases the model averages over.
		se := math.Sqrt(max(model*(1-model), 1e-4) / windows)
		if math.Abs(counted-model) > 4*se+0.002 {
			t.Errorf("%d calls a window, burst %d, guard %.1f ms, spread %.1f ms: the model says %.4f of the windows overrun, counted %.4f",
				c.calls, c.burst, c.g/1000, c.spread/1000, model, counted)
		}
	}
	if o := edgeOverrun(100, 1, 1e6, 0, 0); o != 0 {
		t.Errorf("no spread, no guard: %.4f of the windows overrun, want none", o)
	}
	most := 100 * time.Millisecond
	g := edgeGuard(100, 1, time.Second, 43*time.Millisecond, most, 0.01)
	if o := edgeOverrun(100, 1, 1e6, float64(g.Microseconds()), 43000); o > 0.01 {
		t.Errorf("at edgeGuard's %s the model overruns %.4f of the windows, want at most 0.01", g, o)
	}
	if o := edgeOverrun(100, 1, 1e6, float64(g.Microseconds()-100), 43000); o <= 0.01 {
		t.Errorf("100 µs below edgeGuard's %s the model overruns %.4f of the windows: a narrower guard would do", g, o)
	}
	for _, wider := range []struct {
		name string
		g    time.Duration
	}{
		{"a wider spread", edgeGuard(100, 1, time.Second, 60*time.Millisecond, most, 0.01)},
		{"a tighter overrun", edgeGuard(100, 1, time.Second, 43*time.Millisecond, most, 0.001)},
	} {
		if wider.g <= g {
			t.Errorf("%s: guard %s, want more than %s", wider.name, wider.g, g)
		}
	}
	if g := edgeGuard(100, 1, time.Second, 0, most, 0.01); g != 0 {
		t.Errorf("no spread: guard %s, want none", g)
	}
	// A million calls a second: the drift of 5 ms of spread is about
	// 41 calls either way (normal), a tenth of a millisecond of the
	// window's million.
	if g := edgeGuard(1_000_000, 1, time.Second, 5*time.Millisecond, most, 0.01); g <= 0 || g > time.Millisecond {
		t.Errorf("a million calls a second, 5 ms of spread: guard %s, want (0, 1ms]", g)
	}
}

// TestGroupSharesMeasurements: a per-account vendor's handles are made
// per call, so each account's bucket measures nothing on its own; the
// handles of one group share what they measure, and a handle made after
// enough calls spaces by the measured guard at once. A bucket whose
// guard is configured keeps it.
func TestGroupSharesMeasurements(t *testing.T) {
	g := NewGate(redistest.Client(t), Config{KeyPrefix: redistest.Prefix(t)})
	grp, err := g.Group("shared", &Policy{Limits: []Limit{{Rate: 100, Window: time.Second}}})
	if err != nil {
		t.Fatal(err)
	}
	p := Policy{Limits: []Limit{{Rate: 10, Window: time.Second}}}
	a := p.Adapt.withDefaults()
	for i := range a.MeasureSamples {
		b, err := grp.Bucket("store-"+strconv.Itoa(i), p)
		if err != nil {
			t.Fatal(err)
		}
		b.observeLate(time.Millisecond)
		b.ObserveRoundTrip(5 * time.Millisecond)
	}
	fresh, err := grp.Bucket("store-new", p)
	if err != nil {
		t.Fatal(err)
	}
	if _, _, guard, tol := fresh.spacing(); guard != a.MinTolerance+a.MarginOver || tol != a.MinTolerance {
		t.Errorf("a new account's handle after %d calls of others: guard %s, tolerance %s; want the measured %s, %s",
			a.MeasureSamples, guard, tol, a.MinTolerance+a.MarginOver, a.MinTolerance)
	}
	fixed, err := grp.Bucket("store-fixed", Policy{Limits: p.Limits, Guard: 30 * time.Millisecond})
	if err != nil {
		t.Fatal(err)
	}
	if _, _, guard, _ := fixed.spacing(); guard != 30*time.Millisecond {
		t.Errorf("a configured guard: %s, want 30ms", guard)
	}
	other, err := g.Group("other", nil)
	if err != nil {
		t.Fatal(err)
	}
	alone, err := other.Bucket("store-1", p)
	if err != nil {
		t.Fatal(err)
	}
	if _, _, guard, _ := alone.spacing(); guard != DefaultGuard {
		t.Errorf("another group's handle: guard %s, want the default %s until it has measured", guard, DefaultGuard)
	}
}
