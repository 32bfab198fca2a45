package shaper

import (
	"fmt"
	"math"
	"time"
)

// Adapt is the learning model: what a bucket believes about a vendor that
// refuses calls without announcing its limit, and how each answer changes
// that belief. Every parameter of it is here; the zero value of a field
// selects its default.
//
// The belief, kept in the bucket's control hash and shared by every
// replica, is three things: the rate the vendor accepts (calls per window
// of the primary limit; the configured rate until a refusal says less),
// the margin its calls need (the guard, by which every window is widened
// when the spacing is computed), and how sure the last lesson was (which
// one it was, and at which tick). The evidence is every tick granted
// lately, less those refused or given up (accepted calls), and the ticks
// refused.
//
// A 2xx answer only adds to the evidence. A refusal of the call ticked at
// t is judged on the window limits consistent with every window seen, at
// every phase (estimateWindowLimit: lo..hi; the calls accepted in the
// window before t when no fixed window explains them), against what the
// spacing puts in a window (full):
//
//   - hi within Slack of full: the calls went out at a rate the vendor
//     accepts and came too close together (a network that bunches them
//     up, a vendor that enforces spacing). A margin lesson widens the
//     guard; refusals among accepted calls once a margin was learned or
//     is at its cap (at most Tolerated of a window's calls) are left
//     alone, each costing one call and no pause.
//   - Otherwise, when refusals go on after a margin lesson (Escalate of
//     them within a window, fewer accepted among them), or once the
//     margin is at MaxMargin: a rate
//     lesson lowers the rate to lo (between MaxCut and MinCut of it).
//   - Within a window (+ guard) of a rate lesson, refusals teach nothing
//     new: the calls were on their way before it.
//
// Whether an answer carries Retry-After does not change the judgement: it
// says how long to wait, not what kind of limit was hit. Quiet periods
// raise a learned rate again (Increase per Quiet, below the rate that
// failed until Probe).
type Adapt struct {
	// Decrease multiplies the rate when the refused call is unknown
	// (a rate lesson); default 0.7.
	Decrease float64
	// Increase is the share of the configured rate a learned rate
	// regains per Quiet period; default 0.05.
	Increase float64
	// Quiet is the time without refusals before a learned rate steps up;
	// default 10s.
	Quiet time.Duration
	// Probe is the quiet time after which the rate that failed is
	// forgotten (and the configured rate tried again); default 1m.
	Probe time.Duration
	// Ceiling is the share of the rate that last failed that a learned
	// rate's quiet-period steps stay at or below, until Probe; default
	// 0.97.
	Ceiling float64
	// Floor is the lowest learned rate, as a share of the configured
	// rate; default 0.02.
	Floor float64

	// MaxCut is the most one rate lesson lowers the rate, as a share of
	// it (a refusal of a vendor that is not window-based, a token bucket
	// refusing the second call of a burst, teaches little); default 0.5.
	MaxCut float64
	// MinCut is the least one rate lesson lowers the rate; default 0.9.
	MinCut float64
	// Slack is how many calls short of what the spacing puts in a window
	// a window may be and still count as sent at the full rate; default
	// 1.5.
	Slack float64
	// MarginGrowth multiplies the guard on a margin lesson; default 1.5.
	MarginGrowth float64
	// MarginOver is what a margin lesson's guard has at least over the
	// measured network jitter; default 2ms.
	MarginOver time.Duration
	// MaxMargin caps the learned guard, as a share of the window; default
	// 0.1.
	MaxMargin float64
	// EdgeGrowth multiplies the configured guard on a rate lesson:
	// shaping then runs at the vendor's very edge; default 1.25.
	EdgeGrowth float64
	// Tolerance is how late after its tick a call may start once a margin
	// was learned (a vendor that refuses calls closer than its spacing
	// also refuses a late call followed by one on time); default 3ms.
	Tolerance time.Duration
	// Tolerated is the share of a window's calls whose refusals are left
	// alone once a margin was learned; default 0.05.
	Tolerated float64
	// Escalate is how many refusals within a window of a margin lesson,
	// with fewer than twice as many calls accepted among them, make it a
	// rate lesson after all (a window vendor refuses every call until its
	// window ends, a token bucket sent calls at 1.5 to 2 times its rate
	// every third to every other one; a margin that answers leaves a
	// refusal now and then among dozens accepted); default 5.
	Escalate int
	// Recheck is how many windows after a margin lesson a refusal at the
	// full rate is judged on lo (a fixed window whose boundary fell
	// mid-way looks like a margin once); default 3.
	Recheck int
	// Resolution is the widest range of consistent window limits (calls
	// per window) that is not probed after a rate lesson: the estimator's
	// own slack, one call at either end (a window may hold one call more
	// than another, or one after its first refusal); default 2.
	Resolution int
	// Keep is how long the belief outlives the last refusal; default 10m.
	Keep time.Duration

	// The measured margin, for a policy without a configured Guard. A call
	// that starts later than the tolerance gives its tick up (and takes
	// the next one its process holds, its place in its lane; the
	// process's newest caller asks again); one that starts within it
	// reaches the vendor within the tolerance and the spread of round
	// trips after its tick, and the guard covers both and MarginOver, at
	// most MaxMargin of the window: rate consecutive calls then reach the
	// vendor more than a window apart. The tolerance, at least
	// MinTolerance (default 3ms), is the one that costs the fewest calls:
	// the starts later than it (each a tick given up) against what its
	// guard costs every call (chooseTolerance). Both follow what the last
	// one or two MeasurePeriods (default 10s) measured; until
	// MeasureSamples calls (default 32) were seen, the default guard
	// holds.
	MinTolerance   time.Duration
	MeasurePeriod  time.Duration
	MeasureSamples int
}

// defaultAdapt holds every default of Adapt.
var defaultAdapt = Adapt{
	Decrease: 0.7, Increase: 0.05, Quiet: 10 * time.Second, Probe: time.Minute,
	Floor: 0.02, Ceiling: 0.97, MaxCut: 0.5, MinCut: 0.9, Slack: 1.5, MarginGrowth: 1.5, MarginOver: 2 * time.Millisecond,
	MaxMargin: 0.1, EdgeGrowth: 1.25, Tolerance: 3 * time.Millisecond, Tolerated: 0.05, Escalate: 5, Recheck: 3, Resolution: 2,
	Keep: 10 * time.Minute, MinTolerance: 3 * time.Millisecond,
	MeasurePeriod: 10 * time.Second, MeasureSamples: 32,
}

func (a Adapt) withDefaults() Adapt {
	d := defaultAdapt
	share := func(v *float64, def float64) { // a share in (0, 1)
		if *v <= 0 || *v >= 1 {
			*v = def
		}
	}
	share(&a.Decrease, d.Decrease)
	share(&a.MaxCut, d.MaxCut)
	share(&a.MinCut, d.MinCut)
	share(&a.MaxMargin, d.MaxMargin)
	share(&a.Tolerated, d.Tolerated)
	share(&a.Ceiling, d.Ceiling)
	if a.Floor <= 0 || a.Floor > 1 {
		a.Floor = d.Floor
	}
	for _, f := range []struct{ v, def *float64 }{{&a.Increase, &d.Increase}, {&a.Slack, &d.Slack}} {
		if *f.v <= 0 {
			*f.v = *f.def
		}
	}
	for _, f := range []struct{ v, def *float64 }{{&a.MarginGrowth, &d.MarginGrowth}, {&a.EdgeGrowth, &d.EdgeGrowth}} {
		if *f.v < 1 {
			*f.v = *f.def
		}
	}
	for _, f := range []struct{ v, def *time.Duration }{{&a.Quiet, &d.Quiet}, {&a.Probe, &d.Probe},
		{&a.MarginOver, &d.MarginOver}, {&a.Tolerance, &d.Tolerance}, {&a.Keep, &d.Keep},
		{&a.MeasurePeriod, &d.MeasurePeriod}, {&a.MinTolerance, &d.MinTolerance}} {
		if *f.v <= 0 {
			*f.v = *f.def
		}
	}
	if a.Escalate <= 0 {
		a.Escalate = d.Escalate
	}
	if a.MeasureSamples <= 0 {
		a.MeasureSamples = d.MeasureSamples
	}
	if a.Recheck <= 0 {
		a.Recheck = d.Recheck
	}
	if a.Resolution <= 0 {
		a.Resolution = d.Resolution
	}
	if a.MinCut < a.MaxCut {
		a.MinCut = a.MaxCut
	}
	return a
}

// evidence is what a refusal is judged on: the belief in force and the
// calls the vendor accepted and refused lately (ticks in Redis time, µs).
type evidence struct {
	tick        int64   // the refused call's tick; 0: unknown
	ok, limited []int64 // accepted and refused ticks
	complete    bool    // ok holds every call since traffic began
	window      int64   // the primary window
	configured  float64 // the configured rate
	rate        float64 // the rate in force
	full        float64 // calls the spacing in force puts in a window
	quiet       float64 // a rate that stayed quiet since the limit last moved; 0: none
	guard       time.Duration
	baseGuard   time.Duration // the configured guard
	jitter      time.Duration // spread of recent round trips
	inForce     Lesson        // the last lesson
	lessonTick  int64         // and the tick it was learned at
	// sinceMargin: within a window (+ guard) of a margin lesson.
	sinceMargin bool
	// strict: the vendor enforces spacing (Policy.StrictSpacing).
	strict bool
	// covered: the guard in force covers the start tolerance and the
	// round trips' spread measured (jitter cannot explain a refusal at
	// the full spacing: the vendor enforces spacing).
	covered bool
	// widened: the measured guard jumped (by MarginGrowth or more) less
	// than a window (+ guard) before the refused call started: its
	// window was spaced by a far narrower one, which the guard in force
	// already covers.
	widened bool
	// pausedUntil: when the last pause ended (µs; 0: none).
	pausedUntil int64
	// probeAt: when a learned rate last stepped toward the largest
	// limit consistent with what the vendor did (0: never).
	probeAt int64
}

// lesson is the update a refusal makes to the belief.
type lesson struct {
	kind    Lesson // lessonNone: the belief stands
	rate    float64
	guard   time.Duration
	lo, hi  int    // the window limits consistent with what the vendor did
	est     int    // after a rate lesson, the largest consistent limit above the rate, probed later (raise_rate); 0: none
	spacing bool   // read as calls too close together: no pause beyond a Retry-After
	because string // why, for the logs and stats
}

// judge is the update rule (see Adapt).
func (a Adapt) judge(e evidence) lesson {
	w := e.window
	capGuard := time.Duration(a.MaxMargin*float64(w)) * time.Microsecond
	if e.tick == 0 {
		return a.rateLesson(e, e.rate*a.Decrease, -1, -1, "the refused call is unknown")
	}
	if e.widened && e.inForce == lessonNone {
		// Spaced by a narrower measured guard than the one in force:
		// the wider one is the lesson, learned already.
		return lesson{lo: -1, hi: -1, spacing: true}
	}
	refused := len(sortedWithin(e.limited, e.tick-w, e.tick+1))
	accepted := slidingCount(e.ok, e.tick, w)
	lo, hi, fits := estimateWindowLimit(e.ok, e.limited, e.tick, w, e.complete)
	if !fits {
		// No fixed window explains what the vendor did: the limit is the
		// rate at which it accepted calls over the last window (or the
		// history, when shorter).
		lo = accepted
		if span := e.tick - max(e.tick-w, oldest(e.ok)); span > 0 && span < w {
			lo = int(float64(accepted) * float64(w) / float64(span))
		}
		hi = lo
	}
	// Refusals among accepted calls once a margin was learned, or once
	// it is at its cap, cost a call each and no pause: rare ones are left
	// alone.
	rare := float64(refused) <= max(1, a.Tolerated*float64(refused+accepted))
	tolerated := rare && (e.inForce == LessonMargin || e.guard >= capGuard)
	if e.strict {
		// A vendor that enforces spacing: every refusal is one of calls
		// too close together, until the margin is spent.
		switch {
		case tolerated:
			return lesson{lo: lo, hi: hi, spacing: true}
		case e.guard < capGuard:
			return a.marginLesson(e, lo, hi, capGuard)
		}
		return a.rateLesson(e, float64(lo), lo, hi, "refusals go on at the widest margin")
	}
	if e.probeAt > 0 && e.tick > e.probeAt && e.tick-e.probeAt < int64(a.Recheck)*w {
		// Refused soon after a step toward the largest consistent limit:
		// the step failed. The step was the experiment that narrows the
		// range, so the rate goes to the estimate's lo, between the last
		// quiet rate and the rate that failed (not MinCut below it).
		l := a.rateLesson(e, float64(lo), lo, hi, "a step up failed")
		if to := float64(lo); to < e.rate && to >= e.quiet {
			l = a.backTo(e, l, to)
		}
		return l
	}
	if e.sinceMargin {
		// Refusals that go on after a margin lesson: a vendor over its
		// window limit refuses every call until the window ends (a token
		// bucket every other one); calls the network bunched up are
		// refused here and there among accepted ones.
		recent := sortedWithin(e.limited, e.lessonTick+1, e.tick+1)
		recent = sortedWithin(recent, e.tick-w, e.tick+1)
		if len(recent) < a.Escalate {
			return lesson{lo: lo, hi: hi}
		}
		from := recent[len(recent)-a.Escalate]
		if slidingCount(e.ok, e.tick, e.tick-from) >= 2*a.Escalate {
			return lesson{lo: lo, hi: hi}
		}
		e.guard = e.baseGuard // the margin was not the answer
		return a.rateLesson(e, float64(lo), lo, hi, fmt.Sprintf("%d refusals within a window of widening the margin", len(recent)))
	}
	// Within Recheck windows of a margin lesson, a refusal that a fixed
	// window explains is judged on lo: a window whose boundary fell
	// mid-way looks like the full rate once.
	recheck := fits && e.inForce == LessonMargin && e.tick-e.lessonTick < int64(a.Recheck)*w
	if recheck && e.guard >= capGuard && e.pausedUntil > e.tick-w && e.pausedUntil > e.lessonTick &&
		len(sortedWithin(e.limited, e.lessonTick+1, e.tick)) == 0 {
		// Spacing learned (the margin at its cap), and the window
		// before the refusal holds the lesson's pause: its count says
		// nothing of a window limit. The first such refusal is left
		// alone; a window vendor's next one, a window later, is judged
		// on lo.
		return lesson{lo: lo, hi: hi, spacing: true}
	}
	if recheck {
		e.guard = e.baseGuard // the margin was not the answer
	}
	// Before a window of history (a cold start) the evidence cannot tell
	// a window limit from calls bunched up or too close: the margin is
	// the lesson that costs less when wrong, and refusals that go on
	// after it make it a rate lesson (Escalate).
	cold := e.complete && len(sortedWithin(e.ok, -1<<62, e.tick-w+1)) == 0
	atFull := (float64(max(hi, accepted)) >= e.full-a.Slack || cold) && !recheck
	switch {
	case atFull && tolerated:
		return lesson{lo: lo, hi: hi, spacing: true}
	case atFull && e.guard < capGuard:
		return a.marginLesson(e, lo, hi, capGuard)
	}
	return a.rateLesson(e, float64(lo), lo, hi, "")
}

// marginLesson widens the guard by MarginGrowth, to at least the measured
// jitter and MarginOver, at most capGuard.
//
// A vendor that enforces spacing (said in the policy, or learned: the
// guard in force covered the jitter measured, so the refusal is not the
// network's) needs a margin on every call, not on every window: the
// guard goes to its cap at once, where the ladder would cost a refusal
// and its Retry-After pause at every step.
func (a Adapt) marginLesson(e evidence, lo, hi int, capGuard time.Duration) lesson {
	if e.strict || e.covered {
		return lesson{kind: LessonMargin, rate: e.rate, guard: capGuard, lo: lo, hi: hi, spacing: true,
			because: fmt.Sprintf("at the full spacing with a guard that covers the network jitter measured (%s): the vendor enforces spacing; guard widened to %s and calls spaced by their starts",
				e.jitter.Round(100*time.Microsecond), capGuard.Round(100*time.Microsecond))}
	}
	g := min(max(time.Duration(float64(e.guard)*a.MarginGrowth), e.jitter+a.MarginOver), capGuard)
	return lesson{kind: LessonMargin, rate: e.rate, guard: g, lo: lo, hi: hi, spacing: true,
		because: fmt.Sprintf("at the full spacing: guard widened to %s (network jitter %s, or a vendor that enforces spacing)",
			g.Round(100*time.Microsecond), e.jitter.Round(time.Millisecond))}
}

// oldest is the earliest of ts (0 when empty).
func oldest(ts []int64) int64 {
	var m int64
	for i, t := range ts {
		if i == 0 || t < m {
			m = t
		}
	}
	return m
}

// backTo is l with the rate set to to, a rate the evidence supports
// above MinCut of the rate in force.
func (a Adapt) backTo(e evidence, l lesson, to float64) lesson {
	l.rate = max(to, e.configured*a.Floor)
	l.est = 0
	if est := min(l.hi, int(math.Ceil(e.rate))-1); float64(est) > l.rate+float64(a.Resolution) { // below the step that failed
		l.est = est
	}
	l.because = fmt.Sprintf("rate back to %.4g per %s (a step up failed; the vendor accepted %d to %d calls in a window before refusing one)",
		l.rate, time.Duration(e.window)*time.Microsecond, l.lo, l.hi)
	return l
}

// rateLesson lowers the rate to to, within MaxCut..MinCut of the rate in
// force, and never below Floor or a rate that stayed quiet below it.
func (a Adapt) rateLesson(e evidence, to float64, lo, hi int, because string) lesson {
	rate := min(max(to, e.rate*a.MaxCut), e.rate*a.MinCut)
	rate = max(rate, e.configured*a.Floor)
	if e.quiet > rate && e.quiet < e.rate {
		rate = e.quiet
	}
	guard := e.guard
	if capGuard := time.Duration(a.MaxMargin*float64(e.window)) * time.Microsecond; guard >= capGuard && !e.strict {
		guard = e.baseGuard // spacing was learned, and was not the answer: the vendor counts calls
	}
	l := lesson{kind: LessonRate, rate: rate, guard: max(guard, time.Duration(float64(e.baseGuard)*a.EdgeGrowth)), lo: lo, hi: hi}
	if est := min(hi, int(e.rate*a.MinCut)); float64(est) > rate+float64(a.Resolution) {
		l.est = est
	}
	switch {
	case because != "":
		l.because = fmt.Sprintf("rate lowered to %.4g per %s (%s)", rate, time.Duration(e.window)*time.Microsecond, because)
	case lo == hi:
		l.because = fmt.Sprintf("rate lowered to %.4g per %s (the vendor accepted %d calls in a window before refusing one)",
			rate, time.Duration(e.window)*time.Microsecond, lo)
	default:
		l.because = fmt.Sprintf("rate lowered to %.4g per %s (the vendor accepted %d to %d calls in a window before refusing one)",
			rate, time.Duration(e.window)*time.Microsecond, lo, hi)
	}
	return l
}
