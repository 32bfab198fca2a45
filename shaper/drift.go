package shaper

import (
	"math"
	"sync"
	"time"
)

// The measured guard's model of a vendor's fixed windows seen through a
// spread of delays. Calls are ticked every d = burst x (window + g) /
// calls, burst calls a tick; each reaches the vendor some time between
// its tick and spread after it, independently of the others, uniformly
// (the widest of the spreads the meter's maxima allow). A window, at any
// phase of the ticks, then holds the ticks well inside it, plus those
// that drift in across its start, less those that drift out across its
// end: on average window/d calls, calls x g / (window + g) fewer than
// the limit, and more only when the drift in exceeds the drift out by
// that much. edgeGuard is the narrowest guard for which that happens in
// at most a share overrun of the windows.

// edgePhases is how many phases of the ticks against a window the model
// averages over.
const edgePhases = 32

// edgeExact is how many calls drifting across a window's edges the model
// counts exactly (a Poisson-binomial distribution, per phase); beyond it
// the count is taken as normal, which it then is to well within the
// model's other approximations, with the mean and variance of uniform
// drift (no phase matters then).
const edgeExact = 64

// edgeOverrun is the share of windows, over the phases of the ticks, that
// hold more than calls calls when they are spaced with guard g (see the
// model above). Times in µs. Only the ticks within spread of a window's
// edges are looked at one by one: those between hold calls that arrive
// within the window whatever their delay.
func edgeOverrun(calls, burst int, window, g, spread float64) float64 {
	d := float64(burst) * (window + g) / float64(calls)
	if spread <= 0 {
		// Ticks at any phase: at most ceil(window / d) of them in a window.
		if float64(burst)*math.Ceil(window/d-1e-9) > float64(calls) {
			return 1
		}
		return 0
	}
	spread = min(spread, window) // a longer spread is no worse for the count than the window itself
	if 2*float64(burst)*spread/d > edgeExact {
		// Many calls drift: the count is normal, of mean window / d calls
		// and, each edge's drifting calls being independent chances
		// spread evenly from 0 to 1, variance burst x spread / (3d).
		mean := float64(burst) * window / d
		sd := math.Sqrt(float64(burst) * spread / (3 * d))
		return 0.5 * math.Erfc((float64(calls)+0.5-mean)/(sd*math.Sqrt2))
	}
	var over float64
	ps := make([]float64, 0, 2*edgeExact)
	for ph := range edgePhases {
		phi := (float64(ph) + 0.5) / edgePhases * d // the first tick at or after the window's start
		ps = ps[:0]
		// The ticks before the window whose calls may arrive in it, and
		// the first ticks inside it while their calls may arrive after
		// it (a spread as long as the window).
		for t := phi - d; t > -spread; t -= d {
			for range burst {
				ps = append(ps, p(t, window, spread))
			}
		}
		// Inside: ticks phi, phi + d, ... below window; those at or below
		// window - spread arrive within it for sure.
		inside := int(math.Ceil((window-phi)/d - 1e-9))
		sureN := 0
		if window-spread >= phi {
			sureN = int(math.Floor((window-spread-phi)/d+1e-9)) + 1
		}
		for k := sureN; k < inside; k++ {
			for range burst {
				ps = append(ps, p(phi+float64(k)*d, window, spread))
			}
		}
		over += driftAbove(ps, calls-burst*sureN)
	}
	return over / edgePhases
}

// p is the chance that a call ticked at t, arriving uniformly within
// spread after it, arrives within a window [0, window).
func p(t, window, spread float64) float64 {
	return max(0, min(t+spread, window)-max(t, 0)) / spread
}

// driftAbove is the chance that more than k of independent events of
// chances ps happen.
func driftAbove(ps []float64, k int) float64 {
	switch {
	case k < 0:
		return 1
	case k >= len(ps):
		return 0
	}
	dist := make([]float64, len(ps)+1) // dist[i]: the chance of i events among those seen
	dist[0] = 1
	for n, p := range ps {
		for i := n + 1; i > 0; i-- {
			dist[i] = dist[i]*(1-p) + dist[i-1]*p
		}
		dist[0] *= 1 - p
	}
	var above float64
	for _, q := range dist[k+1:] {
		above += q
	}
	return above
}

// edgeGuard is the narrowest guard, to 100µs and at most most, for which
// calls per window, ticked burst at a time and reaching the vendor within
// spread of their tick, overrun at most a share overrun of the windows.
// Its answers are kept (edgeMemo): the meter asks for the same few
// spreads again and again.
func edgeGuard(calls, burst int, window, spread, most time.Duration, overrun float64) time.Duration {
	if calls <= 0 || burst <= 0 || window <= 0 {
		return 0
	}
	in := edgeQuestion{calls, burst, window, spread, most, overrun}
	edgeMemo.Lock()
	g, ok := edgeMemo.m[in]
	edgeMemo.Unlock()
	if ok {
		return g
	}
	g = searchGuard(in)
	edgeMemo.Lock()
	if len(edgeMemo.m) >= edgeMemoSize {
		clear(edgeMemo.m)
	}
	edgeMemo.m[in] = g
	edgeMemo.Unlock()
	return g
}

// edgeQuestion is what edgeGuard is asked.
type edgeQuestion struct {
	calls, burst         int
	window, spread, most time.Duration
	overrun              float64
}

// edgeMemo keeps edgeGuard's answers, at most edgeMemoSize of them (all
// forgotten when full): a few kB whatever the buckets.
var edgeMemo = struct {
	sync.Mutex
	m map[edgeQuestion]time.Duration
}{m: map[edgeQuestion]time.Duration{}}

const edgeMemoSize = 1024

// searchGuard answers q by bisection on the guard.
func searchGuard(q edgeQuestion) time.Duration {
	w, s := float64(q.window.Microseconds()), float64(q.spread.Microseconds())
	if edgeOverrun(q.calls, q.burst, w, 0, s) <= q.overrun {
		return 0
	}
	lo, hi := int64(0), q.most.Microseconds() // overruns at lo; at hi, taken as enough
	for hi-lo > 100 {
		mid := (lo + hi) / 2
		if edgeOverrun(q.calls, q.burst, w, float64(mid), s) <= q.overrun {
			hi = mid
		} else {
			lo = mid
		}
	}
	return time.Duration(hi) * time.Microsecond
}
