package shaper

import (
	"sync"
	"time"
)

// meter is what the margin before each tick must cover, for one bucket
// handle: the record of measurements it shares with the other handles of
// its group in this process (how late calls start after their tick, and
// the spread of round trips to the vendor: the host's and the network's,
// the same for every account of a vendor, whose handles are made per
// call), and the guard and tolerance in force for the handle.
type meter struct {
	rec        *record
	mu         sync.Mutex
	guard, tol time.Duration // in force (0: not measured yet)
	changed    time.Time     // when guard last narrowed or widened
	widened    time.Time     // when guard last jumped (widened by MarginGrowth or more)
	respace    bool          // guard jumped since takeRespace
}

// newMeter returns a meter on the record rec (nil: a record of its own).
func newMeter(rec *record) *meter {
	if rec == nil {
		rec = &record{}
	}
	return &meter{rec: rec}
}

// record keeps the measurements of two periods (the current and the
// last), so that a spike counts for at least one period and is forgotten
// after two: a few numbers and a short record of lateness whatever the
// traffic.
type record struct {
	mu        sync.Mutex
	start     time.Time // of the current period
	cur, prev measured
	guard     time.Duration // the guard a handle of the group last put in force (0: none)
}

// lateStep is the resolution of a period's record of how late calls
// start; lateSteps of them reach the largest tolerance (3/4 of the
// default guard), and a later start counts in the last.
const (
	lateStep  = 250 * time.Microsecond
	lateSteps = int(DefaultGuard*3/4/lateStep) + 1
)

// measured holds one period's measurements.
type measured struct {
	starts           int              // calls whose start lateness was seen
	lates            [lateSteps]int32 // starts by lateness: lates[i] those later than (i-1) steps, at most i (see lateStep)
	trips            int              // round trips seen
	tripMin, tripMax time.Duration
}

// observe adds one sample to the record's period of now.
func (m *meter) observe(a Adapt, now time.Time, f func(*measured)) {
	r := m.rec
	r.mu.Lock()
	defer r.mu.Unlock()
	if now.Sub(r.start) >= a.MeasurePeriod {
		r.prev, r.cur = r.cur, measured{}
		if now.Sub(r.start) >= 2*a.MeasurePeriod {
			r.prev = measured{} // idle for a whole period: nothing of it is current
		}
		r.start = now
	}
	f(&r.cur)
}

// late records that a call started d after its tick.
func (m *meter) late(a Adapt, now time.Time, d time.Duration) {
	i := min(int((d+lateStep-1)/lateStep), lateSteps-1)
	m.observe(a, now, func(s *measured) {
		s.starts++
		s.lates[i]++
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

// both is the record's last two periods together.
func (m *meter) both() measured {
	r := m.rec
	r.mu.Lock()
	defer r.mu.Unlock()
	out := r.cur
	p := r.prev
	out.starts += p.starts
	for i, n := range p.lates {
		out.lates[i] += n
	}
	if p.trips > 0 {
		if out.trips == 0 || p.tripMin < out.tripMin {
			out.tripMin = p.tripMin
		}
		out.tripMax = max(out.tripMax, p.tripMax)
		out.trips += p.trips
	}
	return out
}

// takeRespace reports, once, that the guard widened by MarginGrowth or
// more: the ticks granted at the narrower one should be dropped.
func (m *meter) takeRespace() bool {
	m.mu.Lock()
	defer m.mu.Unlock()
	r := m.respace
	m.respace = false
	return r
}

// widenedAt is when the guard in force last jumped, widening by
// MarginGrowth or more (zero: never).
func (m *meter) widenedAt() time.Time {
	m.mu.Lock()
	defer m.mu.Unlock()
	return m.widened
}

// spread is the spread of round trips over the last two periods (longest
// less shortest; 0 before any).
func (m *meter) spread() time.Duration {
	s := m.both()
	return s.tripMax - s.tripMin
}

// margin is the guard and tolerance the measurements ask for, for a
// primary window of window (see Adapt): the tolerance that costs the
// fewest calls (chooseTolerance), and the guard that goes with it.
// ok is false until MeasureSamples starts and round trips were seen. A
// narrower guard applies at most once a period (it
// changes the bucket's configured tick, which other replicas compare), a
// wider one at once.
func (m *meter) margin(a Adapt, window, from time.Duration, now time.Time) (guard, tol time.Duration, ok bool) {
	s := m.both()
	m.mu.Lock()
	defer m.mu.Unlock()
	if s.starts < a.MeasureSamples || s.trips < a.MeasureSamples {
		return m.guard, m.tol, m.guard > 0
	}
	tol, g := chooseTolerance(a, s, window)
	if g > m.guard || g < m.guard && now.Sub(m.changed) >= a.MeasurePeriod {
		prev := m.guard
		if prev == 0 {
			prev = from // the first guard measured replaces the policy's
		}
		// Up to Horizon of ticks were granted at the narrower guard: a
		// jump as large as a margin lesson's restarts the line, as a
		// margin lesson does (see takeRespace), and refusals of calls
		// spaced before it teach nothing (widenedAt). Judged against the
		// group's last guard, so that the handles a per-account vendor
		// makes per call do not each respace. (A smaller widening, a
		// millisecond of spread, is no reason to ignore a refusal: a
		// window vendor's would go unheard until its window ends.)
		r := m.rec
		r.mu.Lock()
		last := r.guard
		if last == 0 {
			last = from
		}
		if g > prev && float64(g) >= a.MarginGrowth*float64(last) {
			m.respace, m.widened = true, now
		}
		r.guard = g
		r.mu.Unlock()
		m.guard, m.changed = g, now
	}
	m.tol = min(tol, m.guard*3/4)
	return m.guard, m.tol, true
}

// chooseTolerance is the tolerance, and the guard that goes with it, that
// cost the fewest calls by what s measured: a call that starts later than
// the tolerance gives its tick up (one call less), and the guard, which
// must cover the tolerance and the round trips' spread (guardFor), costs
// guard / (window + guard) of every call. The candidates are
// MinTolerance and the top of every step of the record with a start in
// it, up to 3/4 of the default guard: a few dozen steps, chosen again on
// every call.
func chooseTolerance(a Adapt, s measured, window time.Duration) (tol, guard time.Duration) {
	spread := s.tripMax - s.tripMin
	first := int((a.MinTolerance + lateStep - 1) / lateStep)
	best := -1.0
	var later int32 // the starts later than step i
	for i := lateSteps - 1; i >= min(first, lateSteps-1); i-- {
		if i < lateSteps-1 {
			later += s.lates[i+1]
		}
		if i != first && i != lateSteps-1 && s.lates[i] == 0 {
			continue // no start of its own: the step below costs as many late calls
		}
		t := time.Duration(i) * lateStep
		g := guardFor(a, t, spread, window)
		cost := float64(later)/float64(s.starts) + float64(g)/float64(window+g)
		if best < 0 || cost < best {
			best, tol, guard = cost, t, g
		}
	}
	return tol, guard
}

// guardFor is the guard for calls that start within tol of their tick
// and reach the vendor within spread more: tol + spread + MarginOver, so
// that rate consecutive calls reach the vendor more than a window apart
// (G1 at the vendor, for the spread measured), at most MaxMargin of the
// window, rounded up to a millisecond.
func guardFor(a Adapt, tol, spread, window time.Duration) time.Duration {
	g := min(tol+spread+a.MarginOver, time.Duration(a.MaxMargin*float64(window)))
	return (g + time.Millisecond - 1).Truncate(time.Millisecond)
}

// spacing is the bucket's configured tick in this process, the guard it
// was computed with, and the start tolerance: the policy's, or, for a
// policy whose guard follows measurement, what the meter asks for.
func (b *Bucket) spacing() (iv time.Duration, burst int, guard, tol time.Duration) {
	p := b.policy
	if !p.MeasureGuard {
		return b.interval, b.burst, p.Guard, p.Tolerance
	}
	g, t, ok := b.meter.margin(p.Adapt.withDefaults(), p.Limits[0].Window, p.Guard, b.gate.clock.Now())
	if !ok {
		return b.interval, b.burst, p.Guard, p.Tolerance
	}
	iv, burst = tickFor(p.spaced(), p.Burst, g, 0)
	return iv, burst, g, t
}

// observeRoundTrip tells the bucket how long one call to the vendor took,
// from its start to its answer: the spread of round trips is the network
// jitter a refusal is judged with (Control.Refused), and a bucket whose
// guard follows measurement (Policy.MeasureGuard) widens or narrows its
// margin by it. vendorclients calls it for every answer.
func (b *Bucket) observeRoundTrip(d time.Duration) {
	if d >= 0 {
		b.meter.roundTrip(b.policy.Adapt.withDefaults(), b.gate.clock.Now(), d)
	}
}

// observeLate records how late after its tick a call woke (given up or
// not).
func (b *Bucket) observeLate(d time.Duration) {
	b.meter.late(b.policy.Adapt.withDefaults(), b.gate.clock.Now(), max(d, 0))
}
