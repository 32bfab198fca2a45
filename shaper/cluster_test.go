package shaper

import (
	"context"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/shaper-dev/shaper/internal/redistest"
)

// TestOwnRedisCluster runs the gate's scripts on a three-master Redis
// Cluster: a bucket with a quota, calls of several units in both lanes, a
// group with a total and a quota of its own, a plan, the stats and a
// vendor's count. Every key one script touches carries the group's hash
// tag, so Cluster takes each script (CROSSSLOT otherwise).
func TestOwnRedisCluster(t *testing.T) {
	t.Parallel() // safety only: runs beside the other gate tests
	rdb := redis.NewClusterClient(&redis.ClusterOptions{Addrs: redistest.StartCluster(t, 3)})
	defer rdb.Close()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	g := NewGate(rdb, Config{KeyPrefix: redistest.Prefix(t)})
	b, err := g.Bucket("crm", Policy{Limits: []Limit{{Rate: 50, Window: time.Second}, {Rate: 20, Window: time.Minute}}})
	if err != nil {
		t.Fatal(err)
	}
	for i := range 10 {
		if _, err := b.Acquire(ctx, Request{Cost: 2, Lane: Lane(i % 2)}); err != nil {
			t.Fatal(err)
		}
	}
	if use, err := b.limitUse(ctx); err != nil || use[1].Used != 20 || use[1].Left != 0 {
		t.Fatalf("the quota after 10 calls of 2 units: %+v, %v", use, err)
	}
	if _, err := b.Control().CountUsed(ctx, 1, 20); err != nil {
		t.Fatal(err)
	}
	if st, err := b.Stats(ctx); err != nil || st.NextTick < 30*time.Second {
		t.Fatalf("stats of a spent quota: next tick %v, %v; want about a minute", st.NextTick, err)
	}
	grp, err := g.Group("shop", &Policy{Limits: []Limit{{Rate: 40, Window: time.Second}, {Rate: 100, Window: time.Hour}}})
	if err != nil {
		t.Fatal(err)
	}
	for _, a := range []string{"a", "b", "c"} {
		ab, err := grp.Bucket(a, Policy{Limits: []Limit{{Rate: 10, Window: time.Second}}})
		if err != nil {
			t.Fatal(err)
		}
		for i := range 3 {
			if _, err := ab.Acquire(ctx, Request{Cost: 1 + i}); err != nil {
				t.Fatal(err)
			}
		}
		if _, _, err := ab.plan(ctx, 3); err != nil {
			t.Fatal(err)
		}
	}
	ab, _ := grp.Bucket("a", Policy{Limits: []Limit{{Rate: 10, Window: time.Second}}})
	if use, err := ab.totalLimitUse(ctx); err != nil || use[1].Used != 18 {
		t.Fatalf("the total's quota after 9 calls of 18 units: %+v, %v", use, err)
	}
}
