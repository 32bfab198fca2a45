package shaper

import (
	"math"
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
// counts exactly (a Poisson-binomial distribution); beyond it, the sum
// is taken as normal, which it then is to well within the model's other
// approximations.
const edgeExact = 256

// edgeOverrun is the share of windows, over the phases of the ticks, that
// hold more than calls calls when they are spaced with guard g (see the
// model above). Times in µs.
func edgeOverrun(calls, burst int, window, g, spread float64) float64 {
	d := float64(burst) * (window + g) / float64(calls)
	var over float64
	ps := make([]float64, 0, 64)
	for ph := range edgePhases {
		phi := (float64(ph) + 0.5) / edgePhases * d // the first tick at or after the window's start
		sure := 0
		ps = ps[:0]
		for t := phi - math.Ceil(spread/d)*d; t < window; t += d {
			var p float64 // the chance that a call of the tick at t arrives within the window
			switch {
			case spread <= 0 && t >= 0:
				p = 1
			case spread > 0:
				p = max(0, min(t+spread, window)-max(t, 0)) / spread
			}
			switch {
			case p >= 1:
				sure += burst
			case p > 0:
				for range burst {
					ps = append(ps, p)
				}
			}
		}
		over += driftAbove(ps, calls-sure)
	}
	return over / edgePhases
}

// driftAbove is the chance that more than k of independent events of
// chances ps happen.
func driftAbove(ps []float64, k int) float64 {
	switch {
	case k < 0:
		return 1
	case k >= len(ps):
		return 0
	case len(ps) > edgeExact:
		var mean, v float64
		for _, p := range ps {
			mean += p
			v += p * (1 - p)
		}
		return 0.5 * math.Erfc((float64(k)+0.5-mean)/math.Sqrt(2*v))
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
func edgeGuard(calls, burst int, window, spread, most time.Duration, overrun float64) time.Duration {
	if calls <= 0 || burst <= 0 || window <= 0 {
		return 0
	}
	w, s := float64(window.Microseconds()), float64(spread.Microseconds())
	if edgeOverrun(calls, burst, w, 0, s) <= overrun {
		return 0
	}
	lo, hi := int64(0), most.Microseconds() // overruns at lo; at hi, taken as enough
	for hi-lo > 100 {
		mid := (lo + hi) / 2
		if edgeOverrun(calls, burst, w, float64(mid), s) <= overrun {
			hi = mid
		} else {
			lo = mid
		}
	}
	return time.Duration(hi) * time.Microsecond
}
