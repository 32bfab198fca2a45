package shaper

import (
	"sync"
	"time"
)

// meter measures, for one bucket handle in this process, what the margin
// before each tick must cover: how late calls start after their tick, and
// the spread of round trips to the vendor (how far the network moves a
// call within its window). It keeps the maxima of two periods (the
// current and the last), so a spike counts for at least one period and
// is forgotten after two: a few numbers whatever the traffic.
type meter struct {
	mu         sync.Mutex
	start      time.Time // of the current period
	cur, prev  measured
	guard, tol time.Duration // in force (0: not measured yet)
	changed    time.Time     // when guard last narrowed or widened
}

// measured holds one period's maxima.
type measured struct {
	starts           int           // calls whose start lateness was seen
	late             time.Duration // the latest start
	trips            int           // round trips seen
	tripMin, tripMax time.Duration
}

// observe adds one sample to the period of now.
func (m *meter) observe(a Adapt, now time.Time, f func(*measured)) {
	m.mu.Lock()
	defer m.mu.Unlock()
	if now.Sub(m.start) >= a.MeasurePeriod {
		m.prev, m.cur = m.cur, measured{}
		if now.Sub(m.start) >= 2*a.MeasurePeriod {
			m.prev = measured{} // idle for a whole period: nothing of it is current
		}
		m.start = now
	}
	f(&m.cur)
}

// late records that a call started d after its tick.
func (m *meter) late(a Adapt, now time.Time, d time.Duration) {
	m.observe(a, now, func(s *measured) {
		s.starts++
		s.late = max(s.late, d)
	})
}

// roundTrip records one round trip to the vendor.
func (m *meter) roundTrip(a Adapt, now time.Time, d time.Duration) {
	m.observe(a, now, func(s *measured) {
		if s.trips == 0 || d < s.tripMin {
			s.tripMin = d
		}
		s.tripMax = max(s.tripMax, d)
		s.trips++
	})
}

// both is the last two periods' measurements together; m.mu is held.
func (m *meter) both() measured {
	out := m.cur
	p := m.prev
	out.starts += p.starts
	out.late = max(out.late, p.late)
	if p.trips > 0 {
		if out.trips == 0 || p.tripMin < out.tripMin {
			out.tripMin = p.tripMin
		}
		out.tripMax = max(out.tripMax, p.tripMax)
		out.trips += p.trips
	}
	return out
}

// spread is the spread of round trips over the last two periods (longest
// less shortest; 0 before any).
func (m *meter) spread() time.Duration {
	m.mu.Lock()
	defer m.mu.Unlock()
	s := m.both()
	return s.tripMax - s.tripMin
}

// margin is the guard and tolerance the measurements ask for: a tolerance
// of LateFactor times the latest start (within MinTolerance and the
// default guard's tolerance), and a guard that covers it, the round trips' spread
// and MarginOver (at most MaxMargin of the window), rounded
// up to a millisecond. ok is false until MeasureSamples starts and round
// trips were seen. A narrower guard applies at most once a period (it
// changes the bucket's configured tick, which other replicas compare); a
// wider one at once.
func (m *meter) margin(a Adapt, window time.Duration, now time.Time) (guard, tol time.Duration, ok bool) {
	m.mu.Lock()
	defer m.mu.Unlock()
	s := m.both()
	if s.starts < a.MeasureSamples || s.trips < a.MeasureSamples {
		return m.guard, m.tol, m.guard > 0
	}
	tol = min(max(time.Duration(a.LateFactor*float64(s.late)), a.MinTolerance), DefaultGuard*3/4)
	g := min(tol+(s.tripMax-s.tripMin)+a.MarginOver, time.Duration(a.MaxMargin*float64(window)))
	g = (g + time.Millisecond - 1).Truncate(time.Millisecond)
	if g > m.guard || g < m.guard && now.Sub(m.changed) >= a.MeasurePeriod {
		m.guard, m.changed = g, now
	}
	m.tol = min(tol, m.guard*3/4)
	return m.guard, m.tol, true
}

// spacing is the bucket's configured tick in this process, the guard it
// was computed with, and the start tolerance: the policy's, or, for a
// policy whose guard follows measurement, what the meter asks for.
func (b *Bucket) spacing() (iv time.Duration, burst int, guard, tol time.Duration) {
	p := b.policy
	if !p.MeasureGuard {
		return b.interval, b.burst, p.Guard, p.Tolerance
	}
	g, t, ok := b.meter.margin(p.Adapt.withDefaults(), p.Limits[0].Window, b.gate.clock.Now())
	if !ok {
		return b.interval, b.burst, p.Guard, p.Tolerance
	}
	iv, burst = tickFor(p.spaced(), p.Burst, g, 0)
	return iv, burst, g, t
}

// ObserveRoundTrip tells the bucket how long one call to the vendor took,
// from its start to its answer: the spread of round trips is the network
// jitter a refusal is judged with (Control.Refused), and a bucket whose
// guard follows measurement (Policy.MeasureGuard) widens or narrows its
// margin by it. vendorclients calls it for every answer.
func (b *Bucket) ObserveRoundTrip(d time.Duration) {
	if d >= 0 {
		b.meter.roundTrip(b.policy.Adapt.withDefaults(), b.gate.clock.Now(), d)
	}
}

// observeLate records how late after its tick a call woke (given up or
// not).
func (b *Bucket) observeLate(d time.Duration) {
	b.meter.late(b.policy.Adapt.withDefaults(), b.gate.clock.Now(), max(d, 0))
}
