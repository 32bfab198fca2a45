package shaper

import (
	"testing"
	"time"
)

// TestMeter: the measured margin waits for MeasureSamples, covers twice
// the latest start plus the round trips' spread and MarginOver, widens at
// once, narrows only a period after it last changed, and forgets a spike
// after two periods.
func TestMeter(t *testing.T) {
	a := Adapt{}.withDefaults()
	var m meter
	t0 := time.Unix(1_800_000_000, 0)
	feed := func(at time.Time, n int, late, rtt, spread time.Duration) {
		for i := range n {
			m.late(a, at, late)
			m.roundTrip(a, at, rtt+time.Duration(i%2)*spread)
		}
	}
	if _, _, ok := m.margin(a, time.Second, t0); ok {
		t.Fatal("a margin before any call")
	}
	feed(t0, a.MeasureSamples-1, time.Millisecond, 5*time.Millisecond, time.Millisecond)
	if _, _, ok := m.margin(a, time.Second, t0); ok {
		t.Fatalf("a margin after %d calls, want none before %d", a.MeasureSamples-1, a.MeasureSamples)
	}
	feed(t0, 1, time.Millisecond, 5*time.Millisecond, time.Millisecond)
	// The tolerance: 2 x 1 ms late, at least MinTolerance (3 ms); + 1 ms
	// spread + 2 ms over = 6 ms.
	if g, tol, ok := m.margin(a, time.Second, t0); !ok || g != 6*time.Millisecond || tol != 3*time.Millisecond {
		t.Errorf("quiet: guard %s, tolerance %s (%v), want 6ms, 3ms", g, tol, ok)
	}
	feed(t0, a.MeasureSamples, 4*time.Millisecond, 5*time.Millisecond, time.Millisecond)
	if g, tol, _ := m.margin(a, time.Second, t0); g != 11*time.Millisecond || tol != 8*time.Millisecond {
		t.Errorf("4 ms late: guard %s, tolerance %s, want 11ms, 8ms", g, tol)
	}
	// A jittery network: 40 ms of spread widens it at once.
	feed(t0.Add(time.Second), 4, time.Millisecond, 5*time.Millisecond, 40*time.Millisecond)
	if g, _, _ := m.margin(a, time.Second, t0.Add(time.Second)); g != 50*time.Millisecond {
		t.Errorf("jitter: guard %s, want 50ms", g)
	}
	// Quiet again: the spike counts while it is in the last two periods,
	// and the guard narrows once a period.
	p := a.MeasurePeriod
	feed(t0.Add(p), a.MeasureSamples, time.Millisecond, 5*time.Millisecond, time.Millisecond)
	if g, _, _ := m.margin(a, time.Second, t0.Add(p)); g != 50*time.Millisecond {
		t.Errorf("a period later: guard %s, want the spike's 50ms", g)
	}
	feed(t0.Add(2*p+time.Second), a.MeasureSamples, time.Millisecond, 5*time.Millisecond, time.Millisecond)
	if g, _, _ := m.margin(a, time.Second, t0.Add(2*p+time.Second)); g != 6*time.Millisecond {
		t.Errorf("two periods later: guard %s, want 6ms again", g)
	}
	// Never more than MaxMargin of the window, never less than
	// MinTolerance + MarginOver.
	feed(t0.Add(3*p), a.MeasureSamples, 0, time.Millisecond, 0)
	m2 := meter{}
	feed2 := func(late, spread time.Duration) {
		for i := range a.MeasureSamples {
			m2.late(a, t0, late)
			m2.roundTrip(a, t0, time.Duration(i%2)*spread)
		}
	}
	feed2(0, 0)
	if g, _, _ := m2.margin(a, time.Second, t0); g != a.MinTolerance+a.MarginOver {
		t.Errorf("nothing late, no spread: guard %s, want %s", g, a.MinTolerance+a.MarginOver)
	}
	feed2(0, time.Second)
	if g, _, _ := m2.margin(a, time.Second, t0); g != 100*time.Millisecond {
		t.Errorf("a second of spread: guard %s, want a tenth of the window", g)
	}
}
