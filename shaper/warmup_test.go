package shaper

import (
	"context"
	"strings"
	"testing"
	"time"

	"github.com/shaper-dev/shaper/internal/redistest"
)

// perSecond counts ts in whole seconds from from.
func perSecond(ts []time.Time, from time.Time, n int) []int {
	out := make([]int, n)
	for _, x := range ts {
		if i := int(x.Sub(from) / time.Second); i >= 0 && i < n {
			out[i]++
		}
	}
	return out
}

// TestWarmupRamps drains a 100/s bucket with a 3 s warm-up from 25/s on
// two replicas, from a cold start and again after a 2 s pause: each ramp
// starts near 25 calls per second (never more than 45 in its first
// second), every call starts, and G1 holds throughout, in sliding windows
// and in fixed windows at 50 phases. The climb to the rate (the calls per
// second) is logged, as load moves it.
func TestWarmupRamps(t *testing.T) {
	t.Parallel()
	p := Policy{Limits: []Limit{{Rate: 100, Window: time.Second}}, Warmup: 3 * time.Second, WarmupFrom: 25}
	reps := watchingReplicas(t, 2)
	rec := &recorder{}
	var pausedAt time.Time
	done := make(chan struct{})
	go func() {
		defer close(done)
		time.Sleep(5 * time.Second) // past the ramp
		b, _ := reps[0].gate.Bucket("acme", p)
		pausedAt = time.Now()
		if _, err := b.Control().Pause(context.Background(), 2*time.Second, "test: Retry-After 2"); err != nil {
			t.Error(err)
		}
	}()
	drain(t, reps, "acme", p, 16, 800, rec)
	<-done
	ts := rec.times()
	if len(ts) != 800 {
		t.Fatalf("%d calls started, want 800", len(ts))
	}
	checkWindows(t, ts, p, 50)
	cold := perSecond(ts, ts[0], 5)
	resumed := pausedAt.Add(2 * time.Second)
	warm := perSecond(ts, resumed, 4)
	t.Logf("calls per second from a cold start (from the first call): %v; after a 2 s pause: %v", cold, warm)
	for name, trace := range map[string][]int{"cold start": cold, "after the pause": warm} {
		if trace[0] > 45 {
			t.Errorf("%s: %d calls in the ramp's first second, want at most 45 (from 25/s, rising)", name, trace[0])
		}
	}
}

func TestWarmupValidation(t *testing.T) {
	for _, tc := range []struct {
		p    Policy
		want string
	}{
		{Policy{Limits: []Limit{{Rate: 100, Window: time.Second}}, Warmup: -time.Second}, "must not be negative"},
		{Policy{Limits: []Limit{{Rate: 100, Window: time.Second}}, Warmup: time.Second, WarmupFrom: 200}, "warmup_from 200 is above the rate 100"},
	} {
		err := tc.p.Validate()
		if err == nil || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("%+v: err = %v, want %q", tc.p, err, tc.want)
		}
	}
	if got := (Policy{Limits: []Limit{{Rate: 100, Window: time.Second}}, Warmup: time.Second}).withDefaults().WarmupFrom; got != 25 {
		t.Errorf("default warmup_from = %v, want a quarter of the rate", got)
	}
}

// TestStatsSaysWhatSetsTheRate follows a bucket through a warm-up, a
// refusal at the full spacing (a margin) and a refusal after too many
// calls (a learned rate): Stats names each as the source of the
// effective rate, with the guard and the ramp left.
func TestStatsSaysWhatSetsTheRate(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	// In simulated time: whether a refusal teaches a margin or a rate
	// depends on how many calls the window held, which a busy host's late
	// starts would change.
	clk := &redisClock{}
	clk.set(testEpoch)
	r := newReplica(t, redistest.Addr(t), redistest.Prefix(t), virtualClock{clk})
	r.gate.testNow = clk.now
	g := r.gate
	p := Policy{Limits: []Limit{{Rate: 200, Window: time.Second}}, Warmup: 500 * time.Millisecond}
	b, err := g.Bucket("acme", p)
	if err != nil {
		t.Fatal(err)
	}
	var last *Permit
	acquire := func(n int) {
		for range n {
			if last, err = b.Acquire(ctx); err != nil {
				t.Fatal(err)
			}
		}
	}
	acquire(1)
	st, err := b.Stats(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if st.Source != "warmup" || st.WarmingFor <= 0 || st.EffectiveRate >= st.ConfiguredRate {
		t.Errorf("warming up: source %q, %s left, rate %.1f of %.1f", st.Source, st.WarmingFor, st.EffectiveRate, st.ConfiguredRate)
	}
	acquire(500) // past the ramp, at the full spacing for two seconds
	l, err := b.Control().Refused(ctx, last, Answer{Reason: "HTTP 429", RetryAfter: true, Pause: time.Second, Jitter: 5 * time.Millisecond})
	if err != nil {
		t.Fatal(err)
	}
	st, _ = b.Stats(ctx)
	t.Logf("refused at the full spacing: %+v; stats source %q, guard %s (%s), rate %.1f", l, st.Source, st.Guard, st.GuardReason, st.EffectiveRate)
	if l.Lesson != LessonMargin || st.Source != "margin" || st.Guard != 30*time.Millisecond || st.GuardReason == "" {
		t.Errorf("refused at the full spacing: lesson %s, source %q, guard %s (%q); want margin, guard 30ms", l.Lesson, st.Source, st.Guard, st.GuardReason)
	}
	// A bucket without warm-up refused 20 calls in, and every call after:
	// the vendor allows no more than 20 per second. The first refusal
	// (a cold start) widens the margin; the ones that go on lower the rate.
	b, err = g.Bucket("other", Policy{Limits: []Limit{{Rate: 200, Window: time.Second}}, Horizon: time.Millisecond})
	if err != nil {
		t.Fatal(err)
	}
	acquire(20)
	for i := range 6 {
		if i > 0 {
			acquire(1)
		}
		if l, err = b.Control().Refused(ctx, last, Answer{Reason: "HTTP 429"}); err != nil {
			t.Fatal(err)
		}
	}
	st, _ = b.Stats(ctx)
	t.Logf("refused after 20 calls: %+v; stats source %q, rate %.1f (%s)", l, st.Source, st.EffectiveRate, st.RateReason)
	if l.Lesson != LessonRate || st.Source != "learned" || st.RateSource != "learned" || st.EffectiveRate > 100 {
		t.Errorf("refused after 20 calls: lesson %s, source %q, rate %.1f; want a learned rate", l.Lesson, st.Source, st.EffectiveRate)
	}
	// What was learned outlives a worker restart: the control hash lives
	// Adapt.Keep after the last refusal, whatever the window.
	if ttl := r.rdb.PTTL(ctx, b.keys.control).Val(); ttl < defaultAdapt.Keep-time.Minute {
		t.Errorf("the learned rate expires in %s, want about %s", ttl, defaultAdapt.Keep)
	}
}
