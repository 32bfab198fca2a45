package shaper

import (
	"context"
	"strconv"
	"testing"
	"time"

	"github.com/shaper-dev/shaper/internal/redistest"
)

// TestMeter: the measured margin waits for MeasureSamples; its tolerance
// is the one that costs the fewest calls (starts later than it against
// what its guard costs), so a rare late start does not widen the guard
// and common ones do; its guard covers the tolerance, the round trips'
// spread and MarginOver (at most MaxMargin); it widens at once, narrows
// only a period after it last changed, and forgets a spike after two
// periods.
func TestMeter(t *testing.T) {
	a := Adapt{}.withDefaults()
	m := newMeter(nil)
	t0 := time.Unix(1_800_000_000, 0)
	feed := func(m *meter, at time.Time, n int, late, rtt, spread time.Duration) {
		for i := range n {
			m.late(a, at, late)
			m.roundTrip(a, at, rtt+time.Duration(i%2)*spread)
		}
	}
	margin := func(m *meter, at time.Time) (time.Duration, time.Duration, bool) {
		return m.margin(a, time.Second, DefaultGuard, at)
	}
	if _, _, ok := margin(m, t0); ok {
		t.Fatal("a margin before any call")
	}
	feed(m, t0, a.MeasureSamples-1, time.Millisecond, 5*time.Millisecond, time.Millisecond)
	if _, _, ok := margin(m, t0); ok {
		t.Fatalf("a margin after %d calls, want none before %d", a.MeasureSamples-1, a.MeasureSamples)
	}
	feed(m, t0, 1, time.Millisecond, 5*time.Millisecond, time.Millisecond)
	// Calls 1 ms late: the tolerance is MinTolerance (3 ms); + 1 ms of
	// spread + 2 ms over = 6 ms.
	if g, tol, ok := margin(m, t0); !ok || g != 6*time.Millisecond || tol != 3*time.Millisecond {
		t.Errorf("quiet: guard %s, tolerance %s (%v), want 6ms, 3ms", g, tol, ok)
	}
	// One start in a thousand 12 ms late: giving its tick up costs 0.1%
	// of the calls, a guard to cover it (15 ms) 0.9% more: the tolerance
	// stays.
	feed(m, t0, 1000, time.Millisecond, 5*time.Millisecond, time.Millisecond)
	feed(m, t0, 1, 12*time.Millisecond, 5*time.Millisecond, time.Millisecond)
	if g, tol, _ := margin(m, t0); g != 6*time.Millisecond || tol != 3*time.Millisecond {
		t.Errorf("a rare late start: guard %s, tolerance %s, want 6ms, 3ms", g, tol)
	}
	// A third of the starts 4 ms late: a tolerance of 4 ms and a guard of
	// 7 ms (0.1% of the calls) cost far less than their ticks.
	feed(m, t0, 600, 4*time.Millisecond, 5*time.Millisecond, time.Millisecond)
	if g, tol, _ := margin(m, t0); g != 7*time.Millisecond || tol != 4*time.Millisecond {
		t.Errorf("many starts 4 ms late: guard %s, tolerance %s, want 7ms, 4ms", g, tol)
	}
	// A jittery network: 40 ms of spread widens it at once, to cover it.
	feed(m, t0.Add(time.Second), 4, time.Millisecond, 5*time.Millisecond, 40*time.Millisecond)
	if g, _, _ := margin(m, t0.Add(time.Second)); g != 46*time.Millisecond {
		t.Errorf("jitter: guard %s, want 46ms (4 + 40 + 2)", g)
	}
	// Quiet again: the spike counts while it is in the last two periods,
	// and the guard narrows once a period.
	p := a.MeasurePeriod
	feed(m, t0.Add(p), a.MeasureSamples, time.Millisecond, 5*time.Millisecond, time.Millisecond)
	if g, _, _ := margin(m, t0.Add(p)); g != 46*time.Millisecond {
		t.Errorf("a period later: guard %s, want the spike's 46ms", g)
	}
	feed(m, t0.Add(2*p+time.Second), a.MeasureSamples, time.Millisecond, 5*time.Millisecond, time.Millisecond)
	if g, _, _ := margin(m, t0.Add(2*p+time.Second)); g != 6*time.Millisecond {
		t.Errorf("two periods later: guard %s, want 6ms again", g)
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
		b.observeRoundTrip(5 * time.Millisecond)
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

// TestMeasuredJumpRespaces: when the measured guard first covers a
// jittery network (20 ms -> 45 ms, a jump of MarginGrowth or more), the
// next caller restarts the bucket's line, so the ticks granted at the
// narrower guard go: its tick comes a moment after now, not after the
// second of ticks granted before. A new handle of the same group (a
// per-account vendor makes one per call) does not respace again, nor
// does a small widening. Virtual time: nothing sleeps.
func TestMeasuredJumpRespaces(t *testing.T) {
	ctx := context.Background()
	clk := &redisClock{}
	clk.set(1_800_000_000_000_000)
	r := newReplica(t, redistest.Addr(t), redistest.Prefix(t), virtualClock{clk})
	r.gate.testNow = clk.now
	grp, err := r.gate.Group("jumpy", nil)
	if err != nil {
		t.Fatal(err)
	}
	p := Policy{Limits: []Limit{{Rate: 100, Window: time.Second}}}
	a := p.Adapt.withDefaults()
	b, err := grp.Bucket("store-1", p)
	if err != nil {
		t.Fatal(err)
	}
	ticks := grantTicks(t, b, clk, 90) // most of a second of ticks, granted at the default guard
	for i := range a.MeasureSamples {
		b.observeLate(time.Millisecond)
		b.observeRoundTrip(5*time.Millisecond + time.Duration(i%2)*40*time.Millisecond)
	}
	if _, _, guard, _ := b.spacing(); guard != 45*time.Millisecond {
		t.Fatalf("guard %s, want 45ms (3 ms tolerance + 40 ms spread + 2 ms)", guard)
	}
	now := clk.now()
	if last := time.Duration(ticks[len(ticks)-1]-now) * time.Microsecond; last < 800*time.Millisecond {
		t.Fatalf("the last tick granted is %s after now, want most of a second", last)
	}
	pm, err := b.Acquire(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if at := time.Duration(pm.at-now) * time.Microsecond; at > 300*time.Millisecond {
		t.Errorf("the first call after the jump got the tick %s after now, want a moment after now (the line restarted; the ticks at 20 ms dropped)", at)
	}
	if b.meter.takeRespace() {
		t.Error("the jump asked for a second respace")
	}
	fresh, err := grp.Bucket("store-2", p)
	if err != nil {
		t.Fatal(err)
	}
	if fresh.spacing(); fresh.meter.takeRespace() {
		t.Error("a new handle of the group asked for a respace at the guard already in force")
	}
	for i := range 4 * a.MeasureSamples { // 40 -> 44 ms of spread: a small widening
		b.observeRoundTrip(5*time.Millisecond + time.Duration(i%2)*44*time.Millisecond)
	}
	if _, _, guard, _ := b.spacing(); guard != 49*time.Millisecond {
		t.Fatalf("guard %s, want 49ms", guard)
	}
	if b.meter.takeRespace() {
		t.Error("a widening by less than MarginGrowth asked for a respace")
	}
}
