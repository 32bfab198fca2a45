package shaper

import (
	"math"
	"math/rand/v2"
	"testing"
	"time"

	"github.com/shaper-dev/shaper/internal/windows"
)

// simulateLearning runs the lesson rule against a model vendor for a
// minute: calls at the bucket's spacing from a cold start, configured at
// cfg per second against a vendor allowing limit, a pause of retryAfter
// after each refusal. It returns the refusals and the accepted calls.
func simulateLearning(t *testing.T, kind string, cfg, limit int, phase time.Duration, retryAfter time.Duration) (refused, accepted int) {
	t.Helper()
	const w = int64(time.Second / time.Microsecond)
	guard := int64(20_000)
	rate := float64(cfg)
	var ok, lim []int64
	var lastLesson int64 = -1 << 62
	var lastMargin int64 = -1 << 62
	now := int64(1_000_000_000) + phase.Microseconds()
	end := now + 60*w
	// Vendor state.
	var winK, winN int64 = -1, 0
	var log []int64 // sliding: accepted calls
	var tat int64   // gcra
	for now < end {
		iv, _ := tickFor([]Limit{{Rate: cfg, Window: time.Second}}, 1, time.Duration(guard)*time.Microsecond, rate)
		admit := false
		switch kind {
		case "fixed":
			k := windows.FloorDiv(now, w)
			if k != winK {
				winK, winN = k, 0
			}
			winN++
			admit = winN <= int64(limit)
		case "sliding":
			n := 0
			for _, x := range log {
				if x > now-w {
					n++
				}
			}
			admit = n < limit
			if admit {
				log = append(log, now)
			}
		case "gcra":
			T := w / int64(limit)
			if now >= tat-T { // burst 2
				admit = true
				tat = max(tat, now) + T
			}
		}
		if admit {
			accepted++
			ok = append(ok, now)
			now += iv.Microseconds()
			continue
		}
		refused++
		lim = append(lim, now)
		if now-lastLesson >= w+guard {
			lastLesson = now
			full := float64(w) / float64(iv.Microseconds())
			v, r, _ := judge(ok, lim, now, w, len(ok) < 3*cfg+1, rate, full, true, now-lastMargin < 3*w)
			if v == tooFast {
				rate = r
				guard = max(guard, 25_000)
			} else {
				guard = guard * 3 / 2
				lastMargin = now
			}
		}
		now += retryAfter.Microseconds()
	}
	return refused, accepted
}

// TestLessonsConvergeOnModelVendors runs the lesson rule against model
// fixed-window, sliding-log and GCRA vendors configured at twice their
// limit, 200 random limits and phases each, with a 1 s Retry-After pause
// per refusal: at most 2 refusals and at least 95% of the limit over a
// minute counted from the first call.
func TestLessonsConvergeOnModelVendors(t *testing.T) {
	for _, kind := range []string{"fixed", "sliding", "gcra"} {
		worst, worstShare := 0, 1.0
		for range 200 {
			phase := time.Duration(rand.Int64N(int64(time.Second)))
			limit := 10 + rand.IntN(90)
			refused, accepted := simulateLearning(t, kind, 2*limit, limit, phase, time.Second)
			share := float64(accepted) / (60 * float64(limit))
			worst = max(worst, refused)
			worstShare = math.Min(worstShare, share)
			if refused > 2 || share < 0.95 {
				t.Errorf("%s vendor allowing %d/s at phase %s, configured at %d/s: %d refusals, %.1f%% of the limit", kind, limit, phase, 2*limit, refused, 100*share)
			}
		}
		t.Logf("%s: at most %d refusals in a minute, at least %.1f%% of the limit", kind, worst, 100*worstShare)
	}
}

func TestEstimateWindowLimit(t *testing.T) {
	const w = 1_000_000
	// 10 calls 50 ms apart from 0, the 11th refused: a window that began
	// at or before the first call allowed 10; one that began mid-way (at
	// most half-way, since the window before it held no more) allowed 5.
	var ok []int64
	for i := range 10 {
		ok = append(ok, int64(i)*50_000)
	}
	lo, hi, found := estimateWindowLimit(ok, []int64{500_000}, 500_000, w, true)
	if !found || lo != 5 || hi != 10 {
		t.Errorf("cold start: limit in [%d, %d] (found %v), want [5, 10]", lo, hi, found)
	}
	if v, r, _ := judge(ok, []int64{500_000}, 500_000, w, true, 40, 39.2, true, false); v != tooFast || r != 20 {
		t.Errorf("judge at twice the limit: %v %v, want tooFast at 20 (half: the smallest consistent limit is 5)", v, r)
	}
	// At the full spacing, every window 98 calls, then a refusal: the
	// vendor refused a call the rate allows (jitter or spacing).
	var full []int64
	for i := range 300 {
		full = append(full, int64(i)*10_200)
	}
	if v, _, _ := judge(full, []int64{300 * 10_200}, 300*10_200, w, true, 100, 98.04, true, false); v != tooClose {
		t.Errorf("judge at the full rate: %v, want tooClose", v)
	}
}
