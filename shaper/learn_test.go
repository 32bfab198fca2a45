package shaper

import (
	"context"
	"testing"
	"time"
)

// TestMarginHoldsThroughABurstOfSpacingRefusals: a bucket whose margin is
// at its cap (guard a tenth of the window) and whose vendor accepted full
// windows at that spacing sees a burst of refusals among accepted calls
// (nginx limit_req, whose own scheduling stamps calls late now and then):
// without Retry-After the burst is left alone (a rate cut would not stop
// it, and cost 30% of the rate); the same burst with Retry-After lowers
// the rate, since each such refusal pauses the vendor.
func TestMarginHoldsThroughABurstOfSpacingRefusals(t *testing.T) {
	ctx := context.Background()
	g := watchingReplicas(t, 1)[0].gate
	for _, retryAfter := range []bool{false, true} {
		name := "quiet"
		if retryAfter {
			name = "retry-after"
		}
		t.Run(name, func(t *testing.T) {
			t.Parallel()
			b, err := g.Bucket(name, Policy{Limits: []Limit{{Rate: 100, Window: time.Second}}, Guard: 100 * time.Millisecond})
			if err != nil {
				t.Fatal(err)
			}
			// Three windows of calls at the full spacing, then refusals 20
			// calls apart as the calls go on: the first is judged (and
			// claims a window's cooldown), the next four fall within it,
			// and the sixth, past it, is judged with five refusals in its
			// window.
			refused := map[int]bool{300: true, 320: true, 340: true, 360: true, 380: true, 402: true}
			var l Learned
			for i := range 403 {
				p, err := b.Acquire(ctx)
				if err != nil {
					t.Fatal(err)
				}
				if refused[i] {
					if l, err = b.Control().RateLimited(ctx, p, Refusal{Reason: "HTTP 429", RetryAfter: retryAfter, Jitter: time.Millisecond}); err != nil {
						t.Fatal(err)
					}
				}
			}
			st, err := b.Stats(ctx)
			if err != nil {
				t.Fatal(err)
			}
			t.Logf("Retry-After %v: %+v; rate %.1f (%s)", retryAfter, l, st.EffectiveRate, st.Source)
			switch {
			case !retryAfter && (l.InForce != LessonMargin || st.EffectiveRate < 90):
				t.Errorf("a burst of refusals without Retry-After: lesson %s, rate %.1f; want the margin kept and the rate (90.9) unchanged", l.InForce, st.EffectiveRate)
			case retryAfter && (l.Lesson != LessonRate || st.EffectiveRate > 75):
				t.Errorf("a burst of refusals with Retry-After: lesson %s, rate %.1f; want a rate lesson", l.Lesson, st.EffectiveRate)
			}
		})
	}
}

func TestMostInWindow(t *testing.T) {
	for _, tc := range []struct {
		ts   []int64
		w    int64
		want int
	}{
		{nil, 10, 0},
		{[]int64{5}, 10, 1},
		{[]int64{30, 0, 10, 19, 20}, 10, 2}, // [10, 20) holds 10 and 19; 20 starts the next
		{[]int64{0, 1, 2, 3, 100}, 10, 4},
		{[]int64{0, 9, 10, 18}, 10, 3},
	} {
		if got := mostInWindow(tc.ts, tc.w); got != tc.want {
			t.Errorf("mostInWindow(%v, %d) = %d, want %d", tc.ts, tc.w, got, tc.want)
		}
	}
}
