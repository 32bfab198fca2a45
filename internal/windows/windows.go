// Package windows measures event times the way a vendor counts calls: the
// most events in any fixed window of a given phase, and in any sliding
// window. Tests use it to check window safety over many events.
package windows

import (
	"slices"
	"time"
)

// sorted returns the times as nanoseconds since the first, in order, on
// the wall clock: the clock a vendor counts its windows in, and the one
// the gate reads (Redis TIME). A time.Time's monotonic reading would
// measure another clock: on a loaded VM whose wall clock was stepped
// about 8 s ahead of its monotonic clock mid-run, a quota's minute,
// which the gate and the vendor's fixed windows both counted in full,
// measured 52 s.
func sorted(ts []time.Time) []int64 {
	if len(ts) == 0 {
		return nil
	}
	out := make([]int64, len(ts))
	for i, t := range ts {
		out[i] = t.UnixNano()
	}
	slices.Sort(out)
	first := out[0]
	for i := range out {
		out[i] -= first
	}
	return out
}

// MaxSliding returns the most events in any half-open interval [t, t+w).
func MaxSliding(ts []time.Time, w time.Duration) int {
	ns := sorted(ts)
	best, j := 0, 0
	for i := range ns {
		for ns[i]-ns[j] >= int64(w) {
			j++
		}
		best = max(best, i-j+1)
	}
	return best
}

// MaxFixed returns the most events in one of the fixed windows
// [phase + k*w, phase + (k+1)*w), aligned to the Unix epoch as a vendor's
// windows are aligned to its wall clock.
func MaxFixed(ts []time.Time, w, phase time.Duration) int {
	counts := map[int64]int{}
	best := 0
	for _, t := range ts {
		k := FloorDiv(t.UnixNano()-int64(phase), int64(w))
		counts[k]++
		best = max(best, counts[k])
	}
	return best
}

// FloorDiv is a/b rounded towards minus infinity (b > 0): the index of
// the window of length b that a falls in.
func FloorDiv(a, b int64) int64 {
	q := a / b
	if (a%b != 0) && ((a < 0) != (b < 0)) {
		q--
	}
	return q
}

// Rate returns events per second over the span from the first to the last
// event (n-1 gaps), or 0 for fewer than two events.
func Rate(ts []time.Time) float64 {
	ns := sorted(ts)
	if len(ns) < 2 || ns[len(ns)-1] == 0 {
		return 0
	}
	return float64(len(ns)-1) / time.Duration(ns[len(ns)-1]).Seconds()
}

// Gaps returns the sorted gaps between consecutive events.
func Gaps(ts []time.Time) []time.Duration {
	ns := sorted(ts)
	if len(ns) < 2 {
		return nil
	}
	gaps := make([]time.Duration, len(ns)-1)
	for i := 1; i < len(ns); i++ {
		gaps[i-1] = time.Duration(ns[i] - ns[i-1])
	}
	slices.Sort(gaps)
	return gaps
}

// Percentile returns the p-th percentile (0..100) of sorted durations.
func Percentile(sorted []time.Duration, p float64) time.Duration {
	if len(sorted) == 0 {
		return 0
	}
	i := int(p / 100 * float64(len(sorted)-1))
	return sorted[i]
}

// Wall is b - a on the wall clock (see sorted): what a window check
// measures between two calls, where b.Sub(a) would use their monotonic
// readings.
func Wall(a, b time.Time) time.Duration { return time.Duration(b.UnixNano() - a.UnixNano()) }
