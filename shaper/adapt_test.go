package shaper

import (
	"context"
	"math"
	"slices"
	"testing"
	"time"

	"github.com/shaper-dev/shaper/internal/redistest"
)

func near(a, b float64) bool { return math.Abs(a-b) < 1e-6 }

// The adaptation tests move the Redis time the scripts see (Gate.testNow)
// past cooldowns and quiet periods instead of sleeping through them, so they
// can check each boundary to the microsecond.

func TestLowerAndRaiseRate(t *testing.T) {
	g := NewGate(redistest.Client(t), Config{KeyPrefix: redistest.Prefix(t)})
	clk := fakeRedisTime(g, testEpoch)
	p := Policy{Limits: []Limit{{Rate: 100, Window: 100 * time.Millisecond}}, Guard: 5 * time.Millisecond,
		Adapt: Adapt{Quiet: 300 * time.Millisecond, Probe: 5 * time.Second}}
	b, err := g.Bucket("acme", p)
	if err != nil {
		t.Fatal(err)
	}
	ctl := b.Control()
	ctx := context.Background()
	const cooldown = 105 * time.Millisecond // window + guard
	r, err := ctl.lowerRate(ctx, "429 without hints")
	if err != nil || !near(r, 70) {
		t.Fatalf("first rate-limited answer: rate %v, %v; want 70", r, err)
	}
	clk.advance(cooldown - time.Microsecond)
	if r, _ := ctl.lowerRate(ctx, "again"); !near(r, 70) {
		t.Fatalf("a rate-limited answer within the cooldown lowered the rate again to %v", r)
	}
	clk.advance(time.Microsecond)
	if r, _ := ctl.lowerRate(ctx, "after cooldown"); !near(r, 49) {
		t.Fatalf("a rate-limited answer after the cooldown: %v, want 49", r)
	}
	st, err := b.Stats(ctx)
	if err != nil || st.RateSource != "learned" || st.RateReason != "after cooldown" || math.Abs(st.EffectiveRate-49*100.0/105) > 0.5 {
		t.Fatalf("stats %+v, %v", st, err)
	}
	// No step before a quiet period has passed since the last change.
	clk.advance(p.Adapt.Quiet - time.Microsecond)
	if _, changed, _ := ctl.raiseRate(ctx); changed {
		t.Fatal("raised before a quiet period")
	}
	clk.advance(time.Microsecond)
	r, changed, err := ctl.raiseRate(ctx)
	if err != nil || !changed || !near(r, 54) {
		t.Fatalf("raise: %v %v %v; want 54 (49 + 5%% of 100)", r, changed, err)
	}
	if _, changed, _ := ctl.raiseRate(ctx); changed {
		t.Fatal("two steps in one quiet period")
	}
	clk.advance(p.Adapt.Quiet)
	if r, _, _ := ctl.raiseRate(ctx); !near(r, 59) {
		t.Fatalf("second step: %v, want 59", r)
	}
	// A rate-limited answer at 59 falls back to the last quiet rate (54),
	// not to 41.3.
	if r, _ := ctl.lowerRate(ctx, "429"); !near(r, 54) {
		t.Fatalf("rate-limited above a quiet rate: %v, want 54", r)
	}
	// Steps now stop just below the rate that failed (59 * 0.97).
	clk.advance(p.Adapt.Quiet)
	if r, _, _ := ctl.raiseRate(ctx); !near(r, 57.23) {
		t.Fatalf("capped step: %v, want 57.23", r)
	}
	clk.advance(p.Adapt.Quiet)
	if _, changed, _ := ctl.raiseRate(ctx); changed {
		t.Fatal("stepped above 97% of the rate that failed")
	}
}

// TestRaiseRateClearsAtTheConfiguredRate steps a learned rate back up: the
// step is capped below the rate that failed until that failure is older
// than Probe, and reaching the configured rate clears the learned one.
func TestRaiseRateClearsAtTheConfiguredRate(t *testing.T) {
	g := NewGate(redistest.Client(t), Config{KeyPrefix: redistest.Prefix(t)})
	clk := fakeRedisTime(g, testEpoch)
	b, err := g.Bucket("acme", Policy{Limits: []Limit{{Rate: 10, Window: 50 * time.Millisecond}}, Guard: time.Millisecond,
		Adapt: Adapt{Quiet: 100 * time.Millisecond, Increase: 0.5, Probe: 150 * time.Millisecond}})
	if err != nil {
		t.Fatal(err)
	}
	ctl := b.Control()
	ctx := context.Background()
	if r, err := ctl.lowerRate(ctx, "429"); err != nil || !near(r, 7) {
		t.Fatalf("lower: %v, %v; want 7", r, err)
	}
	// 120ms after the failure: capped at 97% of the rate that failed (10).
	// 240ms after: the failure is older than Probe, 7+5 > 10, cleared.
	for i, want := range []float64{9.7, 0} {
		clk.advance(120 * time.Millisecond)
		r, changed, err := ctl.raiseRate(ctx)
		if err != nil || !changed || !near(r, want) {
			t.Fatalf("step %d: %v, %v, %v; want %v", i+1, r, changed, err, want)
		}
	}
	st, err := b.Stats(ctx)
	if err != nil || st.RateSource != "" || st.RateReason != "" || !near(st.EffectiveRate, st.ConfiguredRate) {
		t.Errorf("after recovery: %+v, %v", st, err)
	}
	if _, changed, _ := ctl.raiseRate(ctx); changed {
		t.Error("raised a rate that was already back at the configured one")
	}
}

func TestAnnounce(t *testing.T) {
	g := NewGate(redistest.Client(t), Config{KeyPrefix: redistest.Prefix(t)})
	clk := fakeRedisTime(g, testEpoch)
	p := Policy{Limits: []Limit{{Rate: 100, Window: time.Second}}, Horizon: 50 * time.Millisecond}
	b, err := g.Bucket("acme", p)
	if err != nil {
		t.Fatal(err)
	}
	ctl := b.Control()
	ctx := context.Background()
	if err := ctl.Announce(ctx, 40, "X-RateLimit-Limit: 40"); err != nil {
		t.Fatal(err)
	}
	st, _ := b.Stats(ctx)
	iv, _ := p.withRate(40)
	if st.RateSource != "announced" || !near(st.EffectiveRate, EffectiveRate(iv, 1, time.Second)) || st.RateReason != "X-RateLimit-Limit: 40" {
		t.Fatalf("announced: %+v", st)
	}
	if _, changed, _ := ctl.raiseRate(ctx); changed {
		t.Error("RaiseRate changed an announced rate")
	}
	// The reserve script spaces ticks at the lowered rate.
	ticks := grantTicks(t, b, clk, 3)
	for i := 1; i < len(ticks); i++ {
		if gap := time.Duration(ticks[i]-ticks[i-1]) * time.Microsecond; gap != iv {
			t.Errorf("ticks %v apart at an announced 40/s, want %v", gap, iv)
		}
	}
	if err := ctl.Announce(ctx, 150, "RateLimit-Policy q=150"); err != nil {
		t.Fatal(err)
	}
	if st, _ := b.Stats(ctx); st.RateSource != "" {
		t.Errorf("an announced limit above the configured one should clear the old one: %+v", st)
	}
}

func TestStatsCountsTheLastMinute(t *testing.T) {
	g := NewGate(redistest.Client(t), Config{KeyPrefix: redistest.Prefix(t)})
	// One second into a clock minute: the grants, 1ms apart, all fall in it.
	clk := fakeRedisTime(g, testEpoch+time.Second.Microseconds())
	b, err := g.Bucket("acme", Policy{Limits: []Limit{{Rate: 1000, Window: time.Second}}, NoGuard: true, Horizon: time.Minute})
	if err != nil {
		t.Fatal(err)
	}
	ctx := context.Background()
	grantTicks(t, b, clk, 10)
	for range 3 {
		if err := b.Control().CountRateLimited(ctx); err != nil {
			t.Fatal(err)
		}
	}
	st, err := b.Stats(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if st.Granted != 10 || st.GrantedLastMinute != 10 || st.RateLimited != 3 || st.RateLimitedLastMinute != 3 {
		t.Errorf("stats %+v: want 10 granted and 3 rate-limited, all in the last minute", st)
	}
	// 18s into the next minute, 7/10 of the previous one is still inside
	// the last 60s.
	clk.set(testEpoch + (time.Minute + 18*time.Second).Microseconds())
	if st, err = b.Stats(ctx); err != nil {
		t.Fatal(err)
	}
	if st.Granted != 10 || st.GrantedLastMinute != 7 || st.RateLimitedLastMinute != 2 {
		t.Errorf("in the next minute: %d granted, %d in the last minute, %d rate-limited in it; want 10, 7 (7/10 of 10), 2 (7/10 of 3)",
			st.Granted, st.GrantedLastMinute, st.RateLimitedLastMinute)
	}
	// The gate hash folds its count into the stats hash every grantFold
	// grants and when the minute changes: the stats count every grant
	// whichever holds it, and in the right minute.
	grantTicks(t, b, clk, 3)
	if st, err = b.Stats(ctx); err != nil {
		t.Fatal(err)
	}
	if st.Granted != 13 || st.GrantedLastMinute != 10 {
		t.Errorf("after 3 more: %d granted, %d in the last minute; want 13, 10 (3 + 7/10 of 10)", st.Granted, st.GrantedLastMinute)
	}
	clk.set(testEpoch + (3*time.Minute + 30*time.Second).Microseconds())
	grantTicks(t, b, clk, grantFold+1)
	if st, err = b.Stats(ctx); err != nil {
		t.Fatal(err)
	}
	if want := int64(13 + grantFold + 1); st.Granted != want || st.GrantedLastMinute != grantFold+1 {
		t.Errorf("minutes later: %d granted, %d in the last minute; want %d, %d", st.Granted, st.GrantedLastMinute, want, grantFold+1)
	}
}

func TestLastMinuteEstimate(t *testing.T) {
	now := int64(100)*60_000_000 + 15_000_000 // a quarter into minute 100
	lookup := func(fields map[string]int64) func(string) int64 {
		return func(k string) int64 { return fields[k] }
	}
	tests := []struct {
		name   string
		fields map[string]int64
		want   int64
	}{
		{"current and previous minute", map[string]int64{"granted_m0": 100, "granted_c0": 4, "granted_m1": 99, "granted_c1": 40}, 4 + 30},
		{"slots swapped", map[string]int64{"granted_m1": 100, "granted_c1": 4, "granted_m0": 99, "granted_c0": 40}, 4 + 30},
		{"a stale slot is not counted", map[string]int64{"granted_m0": 98, "granted_c0": 50, "granted_m1": 100, "granted_c1": 2}, 2},
		{"another counter's slots are not read", map[string]int64{"rate_limited_m0": 100, "rate_limited_c0": 9}, 0},
		{"nothing yet", nil, 0},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			if got := int64(lastMinute(now, "granted", lookup(tt.fields)) + 0.5); got != tt.want {
				t.Errorf("lastMinute = %d, want %d", got, tt.want)
			}
		})
	}
}

// disagreeingReplicas returns the bucket "acme" as two replicas see it
// during a rolling edit, "new" at 100/s and "old" at 25/s, on gates
// reading Redis time from clk.
func disagreeingReplicas(t *testing.T) (fast, slow *Bucket, clk *redisClock) {
	t.Helper()
	rdb := redistest.Client(t)
	g := NewGate(rdb, Config{KeyPrefix: redistest.Prefix(t), Replica: "new"})
	old := NewGate(rdb, Config{KeyPrefix: g.prefix, Replica: "old"})
	now, err := rdb.Time(context.Background()).Result()
	if err != nil {
		t.Fatal(err)
	}
	clk = fakeRedisTime(g, now.UnixMicro())
	old.testNow = g.testNow
	fast, err = g.Bucket("acme", Policy{Limits: []Limit{{Rate: 100, Window: time.Second}}, Horizon: 50 * time.Millisecond})
	if err != nil {
		t.Fatal(err)
	}
	slow, err = old.Bucket("acme", Policy{Limits: []Limit{{Rate: 25, Window: time.Second}}, Horizon: 50 * time.Millisecond})
	if err != nil {
		t.Fatal(err)
	}
	return fast, slow, clk
}

// TestReplicasDisagree has two replicas with different configs (a rolling
// edit): the gate must space ticks by the more conservative one while both
// are live, say which it is, and forget it once its replica stops asking.
func TestReplicasDisagree(t *testing.T) {
	fast, slow, clk := disagreeingReplicas(t)
	ctx := context.Background()
	slowIv, _ := slow.Policy().Tick()
	fastIv, _ := fast.Policy().Tick()
	grantTicks(t, slow, clk, 1) // the old replica asks under its config
	w, ok, err := fast.Control().widest(ctx)
	if err != nil || !ok || w.Replica != "old" || w.Interval != slowIv {
		t.Fatalf("widest %+v, %v, %v; want the old replica's %v", w, ok, err, slowIv)
	}
	ticks := grantTicks(t, fast, clk, 3)
	if gap := time.Duration(ticks[2]-ticks[1]) * time.Microsecond; gap != slowIv {
		t.Errorf("ticks %v apart while a live replica is configured for %v", gap, slowIv)
	}
	// The old replica stops: its tick no longer counts after replicaLive,
	// and the ticks go back to the fast spacing.
	clk.advance(replicaLive)
	ticks = grantTicks(t, fast, clk, 3)
	if gap := time.Duration(ticks[2]-ticks[1]) * time.Microsecond; gap != fastIv {
		t.Errorf("ticks %v apart after the slow replica went silent, want %v", gap, fastIv)
	}
	if w, ok, err := fast.Control().widest(ctx); err != nil || !ok || w.Replica != "new" || w.Interval != fastIv {
		t.Errorf("widest %+v, %v, %v after the old replica went silent; want the new one's %v", w, ok, err, fastIv)
	}
}

// TestEditRaisesAtOnce: a config edit on one replica (a new handle,
// respaced) raises the rate at once, even when a call still under the
// old policy reaches the gate after the edit (it was on its way): the
// old, wider tick must not hold the new one back for replicaLive, and a
// late call under the old policy writes nothing.
func TestEditRaisesAtOnce(t *testing.T) {
	rdb := redistest.Client(t)
	g := NewGate(rdb, Config{KeyPrefix: redistest.Prefix(t), Replica: "r1"})
	now, err := rdb.Time(context.Background()).Result()
	if err != nil {
		t.Fatal(err)
	}
	clk := fakeRedisTime(g, now.UnixMicro())
	ctx := context.Background()
	p := Policy{Limits: []Limit{{Rate: 25, Window: time.Second}}, Horizon: 50 * time.Millisecond}
	slow, _ := g.Bucket("acme", p)
	slowIv, _ := slow.Policy().Tick()
	grantTicks(t, slow, clk, 2)
	p.Limits[0].Rate = 100
	fast, _ := g.Bucket("acme", p)
	fastIv, _ := fast.Policy().Tick()
	if err := fast.Control().Respace(ctx); err != nil {
		t.Fatal(err)
	}
	clk.advance(slowIv)
	grantTicks(t, slow, clk, 1) // a call under the old policy, late
	ticks := grantTicks(t, fast, clk, 3)
	if gap := time.Duration(ticks[2]-ticks[1]) * time.Microsecond; gap != fastIv {
		t.Errorf("ticks %v apart after the edit to %v", gap, fastIv)
	}
	late := grantTicks(t, slow, clk, 1)
	if gap := time.Duration(late[0]-ticks[2]) * time.Microsecond; gap != slowIv {
		t.Errorf("a late call under the old policy came %v after the last tick, want the wider %v", gap, slowIv)
	}
	if w, ok, err := fast.Control().widest(ctx); err != nil || !ok || w.Replica != "r1" || w.Interval != fastIv {
		t.Errorf("widest %+v, %v, %v after a late call under the old policy; want the new one's %v", w, ok, err, fastIv)
	}
}

// TestEditLowersEveryReplicaAtOnce: a rolling edit lowers the rate on
// one replica (a new handle, respaced) while the other, not yet
// reloaded, holds the widest tick under the old policy and is the only
// one asking (its callers hold the backlog). Its calls space by the
// edited replica's tick from the respace on: the respace takes the
// widest tick's place with the new, wider one. Before, the respace only
// restarted the line, and the old replica went on at its own spacing
// until a caller of the edited one asked.
func TestEditLowersEveryReplicaAtOnce(t *testing.T) {
	fast, slow, clk := disagreeingReplicas(t)
	ctx := context.Background()
	fastIv, _ := fast.Policy().Tick()
	slowIv, _ := slow.Policy().Tick()
	grantTicks(t, fast, clk, 2) // the replica not yet edited (100/s) holds the widest tick
	if w, ok, err := fast.Control().widest(ctx); err != nil || !ok || w.Replica != "new" {
		t.Fatalf("widest %+v, %v, %v; want the 100/s replica's", w, ok, err)
	}
	// The other replica is edited to 25/s (a new handle) and respaced.
	edited, err := slow.gate.Bucket("acme", slow.Policy())
	if err != nil {
		t.Fatal(err)
	}
	if err := edited.Control().Respace(ctx); err != nil {
		t.Fatal(err)
	}
	clk.advance(time.Second)
	ticks := grantTicks(t, fast, clk, 3)
	if gap := time.Duration(ticks[2]-ticks[1]) * time.Microsecond; gap != slowIv {
		t.Errorf("the replica not yet edited (%v) spaced its ticks %v apart after another replica's edit to %v", fastIv, gap, slowIv)
	}
}

// TestWiderReplicaJoins: a replica of a narrower config grants from the
// line alone (its tick is the widest, fresh, see wide_entry); a replica
// of a wider config then asks, and is deferred (the horizon is full):
// its core grant hands the call to the full one (another tick than the
// line's, needWide), and the narrower one's next ticks must still come
// at the wider spacing, since every writer of the widest tick writes the
// line's entry with it.
func TestWiderReplicaJoins(t *testing.T) {
	fast, slow, clk := disagreeingReplicas(t)
	g, old := fast.gate, slow.gate
	slowIv, _ := slow.Policy().Tick()
	grantTicks(t, fast, clk, 3)
	// Fill the horizon without moving the clock: the last call is deferred.
	for r := reserveOnce(t, fast); r.ok; r = reserveOnce(t, fast) {
	}
	// The wider replica knows the server, so that its call runs the core
	// script (a first call runs the full one).
	id, _ := g.srv.known("acme", time.Now())
	old.srv.learn("acme", id, old.srv.dials.Load(), time.Now())
	var scripts []string
	old.testScript = func(kind string) { scripts = append(scripts, kind) }
	if r := reserveOnce(t, slow); r.ok || !slices.Equal(scripts, []string{"core", "full"}) {
		t.Fatalf("the wider replica: %+v by the grants %v; want the core grant handing over and a deferral by the full one, the horizon full", r, scripts)
	}
	clk.advance(time.Second)
	ticks := grantTicks(t, fast, clk, 3)
	if gap := time.Duration(ticks[2]-ticks[1]) * time.Microsecond; gap != slowIv {
		t.Errorf("ticks %v apart after a replica configured for %v asked", gap, slowIv)
	}
}
