package shaper

import (
	"context"
	"fmt"
	"math"
	"testing"
	"time"

	"github.com/shaper-dev/shaper/internal/redistest"
)

func near(a, b float64) bool { return math.Abs(a-b) < 1e-6 }

func TestThrottleAndRecover(t *testing.T) {
	rdb := redistest.Client(t)
	g := NewGate(rdb, Config{KeyPrefix: redistest.Prefix(t)})
	p := Policy{Limits: []Limit{{100, 100 * time.Millisecond}}, Guard: 5 * time.Millisecond,
		Adapt: Adapt{Quiet: 300 * time.Millisecond, Probe: 5 * time.Second}}
	b, err := g.Bucket("acme", p)
	if err != nil {
		t.Fatal(err)
	}
	ctx := context.Background()
	r, err := b.Throttled(ctx, "429 without hints")
	if err != nil || !near(r, 70) {
		t.Fatalf("first 429: rate %v, %v; want 70", r, err)
	}
	if r, _ := b.Throttled(ctx, "again"); !near(r, 70) {
		t.Fatalf("429 within the cooldown lowered the rate again to %v", r)
	}
	time.Sleep(120 * time.Millisecond)
	if r, _ := b.Throttled(ctx, "after cooldown"); !near(r, 49) {
		t.Fatalf("429 after the cooldown: %v, want 49", r)
	}
	st, err := b.Stats(ctx)
	if err != nil || st.RateSource != "learned" || math.Abs(st.EffectiveRate-49*100.0/105) > 0.5 {
		t.Fatalf("stats %+v, %v", st, err)
	}
	// Quiet: no step before the quiet period.
	if _, changed, _ := b.Recover(ctx); changed {
		t.Fatal("recovered before a quiet period")
	}
	time.Sleep(350 * time.Millisecond)
	r, changed, err := b.Recover(ctx)
	if err != nil || !changed || !near(r, 54) {
		t.Fatalf("recover: %v %v %v; want 54 (49 + 5%% of 100)", r, changed, err)
	}
	if _, changed, _ := b.Recover(ctx); changed {
		t.Fatal("two steps in one quiet period")
	}
	time.Sleep(350 * time.Millisecond)
	if r, _, _ := b.Recover(ctx); !near(r, 59) {
		t.Fatalf("second step: %v, want 59", r)
	}
	// A 429 at 59 falls back to the last quiet rate (54), not to 41.3.
	if r, _ := b.Throttled(ctx, "429"); !near(r, 54) {
		t.Fatalf("429 above a quiet rate: %v, want 54", r)
	}
	// Steps now stop just below the rate that failed (59 * 0.97).
	time.Sleep(350 * time.Millisecond)
	if r, _, _ := b.Recover(ctx); !near(r, 57.23) {
		t.Fatalf("capped step: %v, want 57.23", r)
	}
	time.Sleep(350 * time.Millisecond)
	if _, changed, _ := b.Recover(ctx); changed {
		t.Fatal("stepped above 97% of the rate that failed")
	}
}

func TestRecoverClearsAtTheConfiguredRate(t *testing.T) {
	rdb := redistest.Client(t)
	g := NewGate(rdb, Config{KeyPrefix: redistest.Prefix(t)})
	b, _ := g.Bucket("acme", Policy{Limits: []Limit{{10, 50 * time.Millisecond}}, Guard: time.Millisecond,
		Adapt: Adapt{Quiet: 100 * time.Millisecond, Increase: 0.5, Probe: 150 * time.Millisecond}})
	ctx := context.Background()
	if _, err := b.Throttled(ctx, "429"); err != nil {
		t.Fatal(err)
	}
	deadline := time.Now().Add(5 * time.Second)
	for {
		time.Sleep(120 * time.Millisecond)
		r, changed, err := b.Recover(ctx)
		if err != nil {
			t.Fatal(err)
		}
		if changed && r == 0 {
			break
		}
		if time.Now().After(deadline) {
			t.Fatal("never recovered to the configured rate")
		}
	}
	st, _ := b.Stats(ctx)
	if st.RateSource != "" || !near(st.EffectiveRate, st.ConfiguredRate) {
		t.Errorf("after recovery: %+v", st)
	}
}

func TestAnnounce(t *testing.T) {
	rdb := redistest.Client(t)
	g := NewGate(rdb, Config{KeyPrefix: redistest.Prefix(t)})
	p := Policy{Limits: []Limit{{100, time.Second}}, Horizon: 50 * time.Millisecond}
	b, _ := g.Bucket("acme", p)
	ctx := context.Background()
	if err := b.Announce(ctx, 40, "X-RateLimit-Limit: 40"); err != nil {
		t.Fatal(err)
	}
	st, _ := b.Stats(ctx)
	iv, _ := p.WithRate(40)
	if st.RateSource != "announced" || !near(st.EffectiveRate, EffectiveRate(iv, 1, time.Second)) || st.RateReason != "X-RateLimit-Limit: 40" {
		t.Fatalf("announced: %+v", st)
	}
	if _, changed, _ := b.Recover(ctx); changed {
		t.Error("Recover changed an announced rate")
	}
	// The reserve script spaces ticks at the lowered rate.
	var ticks []time.Time
	for len(ticks) < 3 {
		r, err := b.Reserve(ctx)
		if err != nil {
			t.Fatal(err)
		}
		if r.OK {
			ticks = append(ticks, time.Now().Add(r.Wait))
		}
	}
	if gap := ticks[2].Sub(ticks[1]); gap < iv-time.Millisecond {
		t.Errorf("ticks %v apart at an announced 40/s, want about %v", gap, iv)
	}
	if err := b.Announce(ctx, 150, "RateLimit-Policy q=150"); err != nil {
		t.Fatal(err)
	}
	if st, _ := b.Stats(ctx); st.RateSource != "" {
		t.Errorf("an announced limit above the configured one should clear the old one: %+v", st)
	}
}

func TestStatsCountsTheLastMinute(t *testing.T) {
	rdb := redistest.Client(t)
	g := NewGate(rdb, Config{KeyPrefix: redistest.Prefix(t)})
	b, _ := g.Bucket("acme", Policy{Limits: []Limit{{1000, time.Second}}, NoGuard: true, Horizon: time.Minute})
	ctx := context.Background()
	granted := 0
	for granted < 10 {
		r, err := b.Reserve(ctx)
		if err != nil {
			t.Fatal(err)
		}
		if r.OK {
			granted++
		}
	}
	for range 3 {
		if err := b.NoteThrottled(ctx); err != nil {
			t.Fatal(err)
		}
	}
	st, err := b.Stats(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if st.Granted != 10 || st.GrantedLastMinute != 10 || st.Throttled != 3 || st.ThrottledLastMinute != 3 {
		t.Errorf("stats %+v: want 10 granted and 3 throttled, all in the last minute", st)
	}
}

func TestLastMinuteEstimate(t *testing.T) {
	num := func(s string) int64 { var n int64; fmt.Sscan(s, &n); return n }
	now := int64(100)*60_000_000 + 15_000_000 // a quarter into minute 100
	if got := lastMinute(now, []string{"100", "4", "99", "40"}, num); got != 4+30 {
		t.Errorf("got %d, want 34 (4 now + 3/4 of the previous 40)", got)
	}
	if got := lastMinute(now, []string{"98", "50", "100", "2"}, num); got != 2 {
		t.Errorf("stale slot counted: %d", got)
	}
}

// TestReplicasDisagree has two replicas with different configs (a rolling
// edit): the gate must space ticks by the more conservative one, and say
// that they disagree.
func TestReplicasDisagree(t *testing.T) {
	rdb := redistest.Client(t)
	g := NewGate(rdb, Config{KeyPrefix: redistest.Prefix(t)})
	fast, _ := g.Bucket("acme", Policy{Limits: []Limit{{100, time.Second}}, Horizon: 50 * time.Millisecond})
	slow, _ := g.Bucket("acme", Policy{Limits: []Limit{{25, time.Second}}, Horizon: 50 * time.Millisecond})
	ctx := context.Background()
	if err := fast.Heartbeat(ctx, "new"); err != nil {
		t.Fatal(err)
	}
	if err := slow.Heartbeat(ctx, "old"); err != nil {
		t.Fatal(err)
	}
	reps, err := fast.Replicas(ctx)
	if err != nil || len(reps) != 2 {
		t.Fatalf("replicas %+v, %v", reps, err)
	}
	var ticks []time.Time
	for len(ticks) < 3 {
		r, err := fast.Reserve(ctx)
		if err != nil {
			t.Fatal(err)
		}
		if r.OK {
			ticks = append(ticks, time.Now().Add(r.Wait))
		}
	}
	slowIv, _ := slow.Tick()
	if gap := ticks[2].Sub(ticks[1]); gap < slowIv-2*time.Millisecond {
		t.Errorf("ticks %v apart while a live replica is configured for %v", gap, slowIv)
	}
}
