package shaper

import (
	"context"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/shaper-dev/shaper/internal/redistest"
	"github.com/shaper-dev/shaper/internal/windows"
)

// waitGone polls until key no longer exists (it expires in Redis time).
func waitGone(t *testing.T, r *replica, key string) {
	t.Helper()
	deadline := time.Now().Add(10 * time.Second)
	for r.rdb.Exists(context.Background(), key).Val() == 1 {
		if time.Now().After(deadline) {
			t.Fatalf("%s never expired (TTL %s)", key, r.rdb.PTTL(context.Background(), key).Val())
		}
		time.Sleep(10 * time.Millisecond)
	}
}

// TestStateExpiresAfterIdle: a bucket's state expires once no tick it
// granted can still fall in a window, and its next caller is granted at
// once (no horizon wait); a state that goes missing while it should still
// be there (lost) is treated as a reset.
func TestStateExpiresAfterIdle(t *testing.T) {
	r := newReplica(t, redistest.Addr(t), redistest.Prefix(t), nil)
	ctx := context.Background()
	b, err := r.gate.Bucket("acme", Policy{Limits: []Limit{{Rate: 10, Window: 100 * time.Millisecond}}, Guard: 5 * time.Millisecond})
	if err != nil {
		t.Fatal(err)
	}
	first, err := b.reserve(ctx, Request{})
	if err != nil || first.ok || first.reason != stateReset {
		t.Fatalf("first use: %+v, %v; want a state reset (no epoch yet)", first, err)
	}
	if _, err := b.Acquire(ctx); err != nil {
		t.Fatal(err)
	}
	if ttl := r.rdb.PTTL(ctx, b.keys.gate).Val(); ttl <= 0 || ttl > 5*minKeep+100*time.Millisecond {
		t.Fatalf("gate key TTL %s: want at most five keeps (%s) after its last tick (reachLua)", ttl, minKeep)
	}
	waitGone(t, r, b.keys.gate)
	again, err := b.reserve(ctx, Request{})
	if err != nil || !again.ok || again.wait > 5*time.Millisecond {
		t.Fatalf("after idle: %+v, %v; want granted at once", again, err)
	}
	// Lost: the state vanishes while its expiry entry says it should live.
	if err := r.rdb.Del(ctx, b.keys.gate).Err(); err != nil {
		t.Fatal(err)
	}
	lost, err := b.reserve(ctx, Request{})
	if err != nil || lost.ok || lost.reason != stateReset {
		t.Fatalf("after a loss: %+v, %v; want a state reset", lost, err)
	}
	st, _ := b.Stats(ctx)
	if st.Resets != 2 {
		t.Errorf("resets = %d, want 2 (first use and the loss; not the idle expiry)", st.Resets)
	}
}

// TestManyBucketsComeAndGo: 5,000 buckets of one group used once leave
// no key behind once idle but the group's epoch and stats.
func TestManyBucketsComeAndGo(t *testing.T) {
	t.Parallel()
	prefix := redistest.Prefix(t)
	r := newReplica(t, redistest.Addr(t), prefix, nil)
	ctx := context.Background()
	grp, err := r.gate.Group("shop", &Policy{Limits: []Limit{{Rate: 1_000_000, Window: 100 * time.Millisecond}}, Guard: time.Millisecond})
	if err != nil {
		t.Fatal(err)
	}
	p := Policy{Limits: []Limit{{Rate: 100, Window: 100 * time.Millisecond}}, Guard: time.Millisecond}
	if b, _ := grp.Bucket("warm-up", p); true {
		if _, err := b.Acquire(ctx); err != nil { // the group's first use waits out the horizon once
			t.Fatal(err)
		}
	}
	// For a window, a guard and a horizon after the group's epoch is made, a new bucket
	// counts as lost too (Redis may have lost everything): then it is new.
	time.Sleep(300 * time.Millisecond)
	for i := range 5000 {
		b, err := grp.Bucket("store-"+itoa(i), p)
		if err != nil {
			t.Fatal(err)
		}
		res, err := b.reserve(ctx, Request{})
		if err != nil || !res.ok {
			t.Fatalf("bucket %d: %+v, %v: a new bucket of a known group is granted at once", i, res, err)
		}
	}
	deadline := time.Now().Add(15 * time.Second)
	for {
		keys := r.rdb.Keys(ctx, prefix+":*").Val()
		if len(keys) <= 2 {
			t.Logf("left after idle: %v", keys)
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("%d keys left after idle, want the epoch and the stats: %v", len(keys), keys[:min(len(keys), 10)])
		}
		time.Sleep(50 * time.Millisecond)
	}
}

func itoa(i int) string {
	return string(rune('a'+i%26)) + "-" + time.Duration(i).String()
}

// TestTotalIsSharedFairly: a group with a total of 40 per second and four
// buckets wanting more than their share: one is limited to 5 per second
// on its own, the others to 20. Max-min fairness gives 5 and 35/3 each:
// each bucket's calls per second are logged beside its share, not asserted
// (on the wall clock load moves them). Every bucket's limit and the total
// hold in every window, and every bucket is served.
func TestTotalIsSharedFairly(t *testing.T) {
	t.Parallel() // safety only: runs beside the other gate tests
	addr, prefix := redistest.Addr(t), redistest.Prefix(t)
	total := Policy{Limits: []Limit{{Rate: 40, Window: time.Second}}}
	own := map[string]int{"small": 5, "a": 20, "b": 20, "c": 20}
	want := map[string]float64{"small": 5, "a": 35.0 / 3, "b": 35.0 / 3, "c": 35.0 / 3}
	reps := []*replica{newReplica(t, addr, prefix, nil), newReplica(t, addr, prefix, nil)}
	ctx, cancel := context.WithTimeout(context.Background(), 12*time.Second)
	defer cancel()
	var mu sync.Mutex
	starts := map[string][]time.Time{}
	var all []time.Time
	var stop atomic.Bool
	var wg sync.WaitGroup
	for _, r := range reps {
		grp, err := r.gate.Group("shop", &total)
		if err != nil {
			t.Fatal(err)
		}
		for name, rate := range own {
			b, err := grp.Bucket(name, Policy{Limits: []Limit{{Rate: rate, Window: time.Second}}})
			if err != nil {
				t.Fatal(err)
			}
			// About as many callers as a worker holds: enough for a
			// horizon and a half of the bucket's own ticks, split between
			// the replicas.
			for range (rate*3/2+2)/len(reps) + 1 {
				wg.Go(func() {
					for !stop.Load() {
						p, err := b.Acquire(ctx)
						if err != nil {
							return
						}
						now := time.Now()
						mu.Lock()
						starts[name] = append(starts[name], now)
						all = append(all, now)
						mu.Unlock()
						_ = p.Release(ctx)
					}
				})
			}
		}
	}
	time.Sleep(10 * time.Second) // traffic flows; measured below
	stop.Store(true)
	cancel()
	wg.Wait()
	if n := windows.MaxSliding(all, time.Second); n > 40 {
		t.Errorf("total: %d calls in a sliding second, limit 40", n)
	}
	// Measure the middle 6 s: after the first use's horizon, before the end.
	lo, hi := all[0].Add(2*time.Second), all[0].Add(8*time.Second)
	for name, ts := range starts {
		if n := windows.MaxSliding(ts, time.Second); n > own[name] {
			t.Errorf("%s: %d calls in a sliding second, its own limit %d", name, n, own[name])
		}
		in := 0
		for _, x := range ts {
			if x.After(lo) && x.Before(hi) {
				in++
			}
		}
		got := float64(in) / hi.Sub(lo).Seconds()
		t.Logf("%s: %.2f calls/s, max-min share %.2f", name, got, want[name])
		if in == 0 {
			t.Errorf("%s: no call in the middle 6 s: starved", name)
		}
	}
}

// TestGrantsRaiseALearnedRate: a learned rate steps back up with the
// bucket's own grants after a quiet period, with no process calling
// RaiseRate.
func TestGrantsRaiseALearnedRate(t *testing.T) {
	r := newReplica(t, redistest.Addr(t), redistest.Prefix(t), nil)
	var now atomic.Int64
	now.Store(1_000_000_000_000)
	r.gate.testNow = now.Load
	ctx := context.Background()
	b, err := r.gate.Bucket("acme", Policy{Limits: []Limit{{Rate: 100, Window: time.Second}}, Horizon: time.Hour,
		Adapt: Adapt{Quiet: time.Second}})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := b.reserve(ctx, Request{}); err != nil { // first use
		t.Fatal(err)
	}
	lowered, err := b.Control().lowerRate(ctx, "429")
	if err != nil || lowered != 70 {
		t.Fatalf("LowerRate = %v, %v; want 70", lowered, err)
	}
	now.Add(2 * time.Second.Microseconds()) // a quiet period passes
	if _, err := b.reserve(ctx, Request{}); err != nil {
		t.Fatal(err)
	}
	st, err := b.Stats(ctx)
	if err != nil {
		t.Fatal(err)
	}
	want, _ := b.Policy().withRate(75)
	if got, _ := b.Policy().withRate(70); st.EffectiveRate <= EffectiveRate(got, 1, time.Second) ||
		!near(st.EffectiveRate, EffectiveRate(want, 1, time.Second)) {
		t.Errorf("after a quiet period and a grant: effective rate %.2f, want the 75 step (%.2f)", st.EffectiveRate, EffectiveRate(want, 1, time.Second))
	}
}

// TestPlan: plans follow each other one pace apart, at the bucket's
// effective rate, and keep its state alive until the planned calls.
func TestPlan(t *testing.T) {
	r := newReplica(t, redistest.Addr(t), redistest.Prefix(t), nil)
	var now atomic.Int64
	now.Store(2_000_000_000_000)
	r.gate.testNow = now.Load
	ctx := context.Background()
	b, err := r.gate.Bucket("acme", Policy{Limits: []Limit{{Rate: 10, Window: time.Second}}, NoGuard: true})
	if err != nil {
		t.Fatal(err)
	}
	first, pace, err := b.plan(ctx, 50)
	if err != nil || first != 0 || pace != 100*time.Millisecond {
		t.Fatalf("first plan: %s every %s, %v; want now, every 100ms", first, pace, err)
	}
	first, _, err = b.plan(ctx, 10)
	if err != nil || first != 5*time.Second {
		t.Fatalf("second plan starts %s from now, %v; want after the 50 planned before (5s)", first, err)
	}
	if err := b.Control().overrideRate(ctx, 5, "test"); err != nil {
		t.Fatal(err)
	}
	_, pace, _ = b.plan(ctx, 1)
	if pace != 200*time.Millisecond {
		t.Errorf("pace at a lowered rate of 5/s: %s, want 200ms", pace)
	}
	if ttl := r.rdb.PTTL(ctx, b.keys.gate).Val(); ttl < 6*time.Second {
		t.Errorf("gate state TTL %s: it must outlive the planned calls (6 s)", ttl)
	}
}

// TestBacklogs: the buckets with calls planned ahead, furthest first.
func TestBacklogs(t *testing.T) {
	r := newReplica(t, redistest.Addr(t), redistest.Prefix(t), nil)
	ctx := context.Background()
	grp, err := r.gate.Group("shop", nil)
	if err != nil {
		t.Fatal(err)
	}
	p := Policy{Limits: []Limit{{Rate: 10, Window: time.Second}}, NoGuard: true}
	for name, n := range map[string]int{"big": 100, "mid": 20, "small": 2} {
		b, _ := grp.Bucket(name, p)
		if _, _, err := b.plan(ctx, n); err != nil {
			t.Fatal(err)
		}
	}
	top, count, err := grp.backlogs(ctx, 2)
	if err != nil {
		t.Fatal(err)
	}
	if count != 3 || len(top) != 2 || top[0].Bucket != "big" || top[1].Bucket != "mid" ||
		top[0].Ahead < 9*time.Second || top[0].Ahead > 10*time.Second {
		t.Errorf("backlogs %+v of %d; want big (about 10 s ahead) then mid, of 3", top, count)
	}
}

// TestPlannedBucketStartsAtOnce: an account whose calls were planned
// before any was granted lost nothing, so its first call is granted at
// once (its plan keeps its state alive before any tick exists); with
// the group's epoch gone too, Redis lost data, and the first tick waits
// out the horizon as any lost state does.
func TestPlannedBucketStartsAtOnce(t *testing.T) {
	r := newReplica(t, redistest.Addr(t), redistest.Prefix(t), nil)
	var now atomic.Int64
	now.Store(2_000_000_000_000)
	r.gate.testNow = now.Load
	ctx := context.Background()
	grp, err := r.gate.Group("shop", nil)
	if err != nil {
		t.Fatal(err)
	}
	p := Policy{Limits: []Limit{{Rate: 5, Window: time.Second}}, NoGuard: true}
	old, _ := grp.Bucket("old", p)
	if _, err := old.reserve(ctx, Request{}); err != nil { // the group is in service
		t.Fatal(err)
	}
	before, _ := old.Stats(ctx) // the group's stats: the first use counted a reset
	fresh, _ := grp.Bucket("fresh", p)
	if _, _, err := fresh.plan(ctx, 20); err != nil {
		t.Fatal(err)
	}
	res, err := fresh.reserve(ctx, Request{})
	if err != nil || !res.ok || res.wait != 0 {
		t.Fatalf("first call of a planned account: %+v, %v; want granted now", res, err)
	}
	if st, _ := fresh.Stats(ctx); st.Resets != before.Resets {
		t.Errorf("resets %d -> %d: a plan is not a lost state", before.Resets, st.Resets)
	}

	lost, _ := grp.Bucket("lost", p)
	if _, _, err := lost.plan(ctx, 20); err != nil {
		t.Fatal(err)
	}
	if err := r.rdb.Del(ctx, lost.keys.epoch).Err(); err != nil { // Redis lost the group
		t.Fatal(err)
	}
	res, err = lost.reserve(ctx, Request{})
	if err != nil || (res.ok && res.wait < p.withDefaults().Horizon) {
		t.Errorf("first call after the group's epoch was lost: %+v, %v; want no tick before the horizon", res, err)
	}
}

// TestControlOutlivesNoGate: a rate set in a bucket's control hash (an
// announced limit) lives as long as its gate hash, which grants extend
// only once in many (reachLua): written to live a keep from now, it
// lapsed before the next extension, and the bucket went back to its
// configured rate while its state lived on.
func TestControlOutlivesNoGate(t *testing.T) {
	t.Parallel()
	r := newReplica(t, redistest.Addr(t), redistest.Prefix(t), nil)
	ctx := context.Background()
	b, err := r.gate.Bucket("acme", Policy{Limits: []Limit{{Rate: 5, Window: time.Second}}})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := b.Acquire(ctx); err != nil {
		t.Fatal(err)
	}
	if err := b.Control().Announce(ctx, 2, "test"); err != nil {
		t.Fatal(err)
	}
	// The control hash's TTL first: read after it, the gate hash's can
	// only be shorter, whatever the time between the two reads.
	ctl := r.rdb.PTTL(ctx, b.keys.control).Val()
	gate := r.rdb.PTTL(ctx, b.keys.gate).Val()
	if ctl < gate-10*time.Millisecond {
		t.Errorf("control hash TTL %s, gate hash %s: the announced rate would lapse before the state", ctl, gate)
	}
}
