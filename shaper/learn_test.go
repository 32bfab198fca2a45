package shaper

import (
	"strings"
	"testing"
	"time"
)

// evenTicks returns n ticks iv apart from start (µs).
func evenTicks(start, iv int64, n int) []int64 {
	ts := make([]int64, n)
	for i := range ts {
		ts[i] = start + int64(i)*iv
	}
	return ts
}

// TestJudge takes the update rule (Adapt.judge) through each of its
// cases on hand-made evidence: a window of 1 s, calls at an even spacing.
func TestJudge(t *testing.T) {
	const w = 1_000_000
	a := Adapt{}.withDefaults()
	base := func(rate float64, ok []int64, refusedAt int64) evidence {
		iv, burst := tickFor([]Limit{{Rate: int(rate), Window: time.Second}}, 1, 20*time.Millisecond, rate)
		return evidence{tick: refusedAt, ok: ok, limited: []int64{refusedAt}, complete: true, window: w, configured: rate,
			rate: rate, full: EffectiveRate(iv, burst, time.Second), guard: 20 * time.Millisecond, baseGuard: 20 * time.Millisecond,
			jitter: time.Millisecond}
	}
	atFull := evenTicks(0, 10_200, 300) // 98 per window, three windows
	refusedAtFull := int64(300 * 10_200)
	for _, tc := range []struct {
		name  string
		e     func() evidence
		want  Lesson
		rate  float64       // want this rate (rate lessons)
		guard time.Duration // want this guard (0: not checked)
	}{
		{"a cold start: the evidence cannot tell, the margin costs less when wrong", func() evidence {
			// 30 calls 16.7 ms apart from 0, the 31st refused.
			return base(60, evenTicks(0, 16_667, 30), 30*16_667)
		}, LessonMargin, 0, 30 * time.Millisecond},
		{"refusals in a row after a cold start's margin: the smallest consistent limit, at most a halving", func() evidence {
			// The 31st call refused and a margin learned; the next five refused too.
			e := base(60, evenTicks(0, 16_667, 30), 35*16_667)
			e.inForce, e.lessonTick, e.sinceMargin, e.guard = LessonMargin, 30*16_667, true, 30*time.Millisecond
			e.limited = []int64{30 * 16_667, 31 * 16_667, 32 * 16_667, 33 * 16_667, 34 * 16_667, 35 * 16_667}
			return e
		}, LessonRate, 30, 25 * time.Millisecond},
		{"twice the limit after a window of history: the smallest consistent limit, at most a halving", func() evidence {
			// Two windows at 30, then 60/s from 2 s: the 31st call of the third window refused.
			ok := append(evenTicks(0, 33_333, 60), evenTicks(2*w, 16_667, 30)...)
			e := base(60, ok, 2*w+30*16_667)
			e.complete = false
			return e
		}, LessonRate, 30, 25 * time.Millisecond},
		{"refused after three full windows: the margin", func() evidence {
			return base(100, atFull, refusedAtFull)
		}, LessonMargin, 0, 30 * time.Millisecond},
		{"the margin grows to the jitter", func() evidence {
			e := base(100, atFull, refusedAtFull)
			e.jitter = 40 * time.Millisecond
			return e
		}, LessonMargin, 0, 42 * time.Millisecond},
		{"a margin learned long ago, a refusal now and then: left alone", func() evidence {
			e := base(100, atFull, refusedAtFull)
			e.inForce, e.lessonTick = LessonMargin, 100
			return e
		}, lessonNone, 0, 0},
		{"within Recheck windows of a margin lesson, at the full rate: judged on lo", func() evidence {
			e := base(100, atFull, refusedAtFull)
			e.inForce, e.lessonTick = LessonMargin, refusedAtFull-2*w
			e.limited = []int64{refusedAtFull, refusedAtFull - 2*w}
			return e
		}, LessonRate, 90, 0},
		{"spacing learned, the first refusal in a window that holds the lesson's pause: left alone", func() evidence {
			e := base(100, atFull, refusedAtFull)
			e.inForce, e.lessonTick, e.guard = LessonMargin, refusedAtFull-2*w, 100*time.Millisecond
			e.limited = []int64{refusedAtFull, refusedAtFull - 2*w}
			e.pausedUntil = refusedAtFull - w/2
			return e
		}, lessonNone, 0, 0},
		{"spacing learned, a second refusal since the lesson in a window that holds its pause: judged on lo", func() evidence {
			e := base(100, atFull, refusedAtFull)
			e.inForce, e.lessonTick, e.guard = LessonMargin, refusedAtFull-2*w, 100*time.Millisecond
			e.limited = []int64{refusedAtFull, refusedAtFull - w, refusedAtFull - 2*w}
			e.pausedUntil = refusedAtFull - w/2
			return e
		}, LessonRate, 90, 25 * time.Millisecond},
		{"the margin at its cap, refusals more than Tolerated: the rate", func() evidence {
			e := base(100, atFull, refusedAtFull)
			e.guard = 100 * time.Millisecond
			e.inForce, e.lessonTick = LessonMargin, 100
			for i := range 10 {
				e.limited = append(e.limited, refusedAtFull-int64(i+1)*50_000)
			}
			return e
		}, LessonRate, 90, 25 * time.Millisecond}, // spacing was not the answer: the guard goes back to the base (x EdgeGrowth)
		{"the margin at its cap with strict_spacing, refusals more than Tolerated: the rate, the guard kept", func() evidence {
			e := base(100, atFull, refusedAtFull)
			e.guard, e.strict = 100*time.Millisecond, true
			e.inForce, e.lessonTick = LessonMargin, 100
			for i := range 10 {
				e.limited = append(e.limited, refusedAtFull-int64(i+1)*50_000)
			}
			return e
		}, LessonRate, 90, 100 * time.Millisecond},
		{"the margin at its cap, one refusal: left alone", func() evidence {
			e := base(100, atFull, refusedAtFull)
			e.guard = 100 * time.Millisecond
			return e
		}, lessonNone, 0, 0},
		{"refusals go on within a window of a margin lesson: the rate, the margin undone", func() evidence {
			e := base(100, atFull[:295], refusedAtFull)
			e.inForce, e.lessonTick, e.sinceMargin, e.guard = LessonMargin, 295*10_200-1, true, 30*time.Millisecond
			e.limited = []int64{295 * 10_200, 296 * 10_200, 297 * 10_200, 298 * 10_200, 299 * 10_200, refusedAtFull}
			return e
		}, LessonRate, 90, 25 * time.Millisecond},
		{"a few refusals among many accepted within a window of a margin lesson: left alone", func() evidence {
			e := base(100, atFull, refusedAtFull)
			e.inForce, e.lessonTick, e.sinceMargin = LessonMargin, refusedAtFull-500_000, true
			e.limited = []int64{refusedAtFull - 400_000, refusedAtFull - 300_000, refusedAtFull - 200_000, refusedAtFull - 100_000, refusedAtFull}
			return e
		}, lessonNone, 0, 0},
		{"a vendor that enforces spacing: the margin at its cap at once, even at a cold start's count", func() evidence {
			e := base(100, evenTicks(0, 10_200, 20), 20*10_200)
			e.strict = true
			return e
		}, LessonMargin, 0, 100 * time.Millisecond},
		{"refused at the full spacing by a guard that covers the jitter measured: spacing learned, the margin at its cap", func() evidence {
			e := base(100, atFull, refusedAtFull)
			e.covered = true
			return e
		}, LessonMargin, 0, 100 * time.Millisecond},
		{"spaced by a narrower measured guard than the one in force: nothing new", func() evidence {
			e := base(100, atFull, refusedAtFull)
			e.widened, e.covered = true, true
			return e
		}, lessonNone, 0, 0},
		{"a token bucket below the rate after a margin lesson: five refusals with seven calls accepted among them, the rate", func() evidence {
			// 40/s from 0 (25 ms apart), a margin learned 200 ms before; a
			// refusal every 45 ms since.
			tick := int64(3*w + 200_000)
			e := base(60, evenTicks(0, 25_000, int(tick/25_000)), tick)
			e.inForce, e.lessonTick, e.sinceMargin, e.guard = LessonMargin, tick-200_000, true, 30*time.Millisecond
			e.limited = []int64{tick, tick - 45_000, tick - 90_000, tick - 135_000, tick - 180_000}
			return e
		}, LessonRate, 40, 25 * time.Millisecond},
		{"a vendor that enforces spacing, refusals go on at the widest margin: the rate", func() evidence {
			e := base(100, atFull, refusedAtFull)
			e.strict, e.guard = true, 100*time.Millisecond
			for i := range 10 {
				e.limited = append(e.limited, refusedAtFull-int64(i+1)*50_000)
			}
			return e
		}, LessonRate, 90, 0},
		{"the refused call unknown: Decrease", func() evidence {
			e := base(100, atFull, 0)
			e.limited = nil
			return e
		}, LessonRate, 70, 0},
		{"never below a rate that stayed quiet", func() evidence {
			ok := append(evenTicks(0, 33_333, 60), evenTicks(2*w, 16_667, 30)...)
			e := base(60, ok, 2*w+30*16_667)
			e.complete, e.quiet = false, 40
			return e
		}, LessonRate, 40, 0},
	} {
		t.Run(tc.name, func(t *testing.T) {
			l := a.judge(tc.e())
			if l.kind != tc.want {
				t.Fatalf("lesson %s (%+v), want %s", l.kind, l, tc.want)
			}
			if tc.want == LessonRate && (l.rate < tc.rate-0.01 || l.rate > tc.rate+0.01) {
				t.Errorf("rate %.2f, want %.2f (%s)", l.rate, tc.rate, l.because)
			}
			if tc.guard > 0 && l.guard != tc.guard {
				t.Errorf("guard %s, want %s (%s)", l.guard, tc.guard, l.because)
			}
			if tc.want != lessonNone && !strings.Contains(l.because, "rate lowered") && !strings.Contains(l.because, "guard widened") {
				t.Errorf("reason %q says neither what changed nor why", l.because)
			}
		})
	}
}

// TestAdaptDefaults: every zero field takes its default, set fields
// stay, and shares outside (0, 1) fall back.
func TestAdaptDefaults(t *testing.T) {
	if got := (Adapt{}).withDefaults(); got != defaultAdapt {
		t.Errorf("zero Adapt: %+v, want %+v", got, defaultAdapt)
	}
	got := Adapt{Decrease: 0.5, Quiet: 30 * time.Second, MaxCut: 2, MarginGrowth: 0.5, Escalate: 3}.withDefaults()
	if got.Decrease != 0.5 || got.Quiet != 30*time.Second || got.MaxCut != defaultAdapt.MaxCut ||
		got.MarginGrowth != defaultAdapt.MarginGrowth || got.Escalate != 3 {
		t.Errorf("withDefaults: %+v", got)
	}
}
