package shaper

import (
	"sort"

	"github.com/shaper-dev/shaper/internal/windows"
)

// estimateWindowLimit estimates how many calls a vendor allows per window
// of w from what it did: ok holds the ticks of the calls it accepted and
// limited those of the calls it answered rate-limited, t the latest of
// them (all Redis-time µs, any order). complete says that ok holds every
// accepted call since traffic began (a log that was never trimmed); else
// windows that start before its oldest entry are not judged.
//
// The model is a fixed window of unknown phase, which also fits a sliding
// log seen from a cold start: the window holding t starts at some s in
// (t-w, t]; the calls accepted in a window before its first rate-limited
// one are the limit, and a window without one held no more than the
// limit, and accepted nothing after it (one call of slack). Every start
// s that a call's tick makes distinct is tried; among
// those consistent with every window observed, the largest limit is the
// answer (a wrong guess costs one more rate-limited answer, which rules
// its phase out). It reports false when no phase is consistent (a vendor
// that counts otherwise).
func estimateWindowLimit(ok, limited []int64, t, w int64, complete bool) (lo, hi int, found bool) {
	ok = sortedWithin(ok, t-3*w, t)
	limited = sortedWithin(limited, t-3*w, t+1)
	if len(limited) == 0 {
		return 0, 0, false
	}
	from := int64(-1 << 62)
	if !complete && len(ok) > 0 {
		from = ok[0]
	}
	var starts []int64
	for _, xs := range [][]int64{ok, limited} {
		for _, x := range xs {
			for _, s := range []int64{x, x + 1} {
				// The start of t's window, moved by whole windows.
				s = t - floorMod(t-s, w)
				if s > t-w && s <= t {
					starts = append(starts, s)
				}
			}
		}
	}
	var fits []int
	for _, s := range starts {
		if l, ok := limitAt(ok, limited, s, w, from); ok {
			fits = append(fits, l)
		}
	}
	if len(fits) == 0 {
		return 0, 0, false
	}
	sort.Ints(fits)
	return fits[0], fits[len(fits)-1], true
}

// limitAt is the limit that windows starting at s (mod w) imply, and
// whether every window agrees with it (see estimateWindowLimit).
func limitAt(ok, limited []int64, s, w, from int64) (int, bool) {
	type win struct {
		accepted  int   // accepted calls before the first rate-limited one (or all)
		after     int   // accepted calls after it
		firstLim  int64 // tick of the first rate-limited call; 0: none
		hasLimits bool
	}
	wins := map[int64]*win{}
	at := func(x int64) *win {
		k := windows.FloorDiv(x-s, w)
		if wins[k] == nil {
			wins[k] = &win{}
		}
		return wins[k]
	}
	for _, x := range limited {
		if v := at(x); !v.hasLimits || x < v.firstLim {
			v.hasLimits, v.firstLim = true, x
		}
	}
	for _, x := range ok {
		if v := at(x); !v.hasLimits || x < v.firstLim {
			v.accepted++
		} else {
			v.after++
		}
	}
	lo, hi, quiet := -1, -1, 0
	for k, v := range wins {
		judged := s+k*w >= from
		if v.after > 1 {
			return 0, false // a window vendor refuses every call once its limit is spent
		}
		switch {
		case v.hasLimits && judged:
			if lo < 0 || v.accepted < lo {
				lo = v.accepted
			}
			hi = max(hi, v.accepted)
		case !v.hasLimits:
			quiet = max(quiet, v.accepted)
		}
	}
	if lo < 0 || hi-lo > 1 || quiet > lo {
		return 0, false
	}
	return lo, true
}

// slidingCount is the number of accepted calls in [t-w, t): the limit of
// a sliding-log vendor that refused the call at t.
func slidingCount(ok []int64, t, w int64) int {
	return len(sortedWithin(ok, t-w, t))
}

// sortedWithin returns the xs in [from, to), sorted.
func sortedWithin(xs []int64, from, to int64) []int64 {
	var out []int64
	for _, x := range xs {
		if x >= from && x < to {
			out = append(out, x)
		}
	}
	sort.Slice(out, func(i, j int) bool { return out[i] < out[j] })
	return out
}

func floorMod(a, b int64) int64 { return a - windows.FloorDiv(a, b)*b }
