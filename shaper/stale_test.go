package shaper

import (
	"context"
	"sync"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/shaper-dev/shaper/internal/redistest"
)

// copyKeys copies every key under prefix from one Redis to another, with
// its TTL: what a replica holds of its master at some moment.
func copyKeys(t *testing.T, from, to *redis.Client, prefix string) int {
	t.Helper()
	ctx := context.Background()
	keys, err := from.Keys(ctx, prefix+":*").Result()
	if err != nil {
		t.Fatal(err)
	}
	for _, k := range keys {
		dump, err := from.Dump(ctx, k).Result()
		if err == redis.Nil {
			continue
		} else if err != nil {
			t.Fatal(err)
		}
		ttl, err := from.PTTL(ctx, k).Result()
		if err != nil {
			t.Fatal(err)
		}
		if ttl < 0 {
			ttl = 0
		}
		if err := to.RestoreReplace(ctx, k, ttl, dump).Err(); err != nil {
			t.Fatal(err)
		}
	}
	return len(keys)
}

// TestGateStaleCopy is the failover that lost the last writes: the gate's
// state is copied from server A to server B (a replica's copy), A grants
// ticks for 400 ms more, and then every caller moves to B (the promoted
// replica), whose copy lacks those ticks. B's state was written by
// another server (its run_id differs), so it is treated as lost: no tick
// before the horizon A could have reserved up to, and G1 holds across
// the switch, for a bucket of its own and for one in a group with a
// total.
func TestGateStaleCopy(t *testing.T) {
	t.Parallel() // servers of its own; G1 is what it checks, not timing
	for _, sc := range []struct {
		name  string
		total *Policy // the group's total; the bucket's own limit is then 200/s
	}{{"bucket", nil}, {"group with a total", &Policy{Limits: []Limit{{100, time.Second}}}}} {
		t.Run(sc.name, func(t *testing.T) {
			t.Parallel()
			srvA, srvB := redistest.Start(t), redistest.Start(t)
			prefix := redistest.Prefix(t)
			a, b := newReplica(t, srvA.Addr, prefix, nil), newReplica(t, srvB.Addr, prefix, nil)
			p := Policy{Limits: []Limit{{100, time.Second}}}
			bucketOf := func(g *Gate) *Bucket {
				t.Helper()
				if sc.total == nil {
					bk, err := g.Bucket("acme", p)
					if err != nil {
						t.Fatal(err)
					}
					return bk
				}
				grp, err := g.Group("shop", sc.total)
				if err != nil {
					t.Fatal(err)
				}
				bk, err := grp.Bucket("store-1", Policy{Limits: []Limit{{200, time.Second}}})
				if err != nil {
					t.Fatal(err)
				}
				return bk
			}
			ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
			defer cancel()
			rec := &recorder{}
			run := func(bk *Bucket, until time.Time) {
				var wg sync.WaitGroup
				for range 16 {
					wg.Go(func() {
						for time.Now().Before(until) {
							if _, err := bk.Acquire(ctx); err != nil {
								t.Error(err)
								return
							}
							rec.add(time.Now())
						}
					})
				}
				wg.Wait()
			}
			start := time.Now()
			done := make(chan struct{})
			onA := bucketOf(a.gate) // on the test's goroutine: it may t.Fatal
			go func() {
				defer close(done)
				run(onA, start.Add(3*time.Second))
			}()
			// A Fatal below ends the test only once A's callers have
			// stopped (the context ends them).
			defer func() { cancel(); <-done }()
			time.Sleep(2600 * time.Millisecond)
			n := copyKeys(t, a.rdb, b.rdb, prefix) // the replica's copy, 400 ms before the failover
			time.Sleep(time.Until(start.Add(3 * time.Second)))
			// The failover: new callers ask B while the ticks A granted
			// last are still being used.
			switched := len(rec.times())
			run(bucketOf(b.gate), time.Now().Add(2500*time.Millisecond))
			<-done
			ts := rec.times()
			t.Logf("%d keys copied; %d calls on A, %d on B after the switch", n, switched, len(ts)-switched)
			if len(ts)-switched < 100 {
				t.Errorf("only %d calls on B after the switch: the gate did not recover", len(ts)-switched)
			}
			checkWindows(t, ts, p, 60)
		})
	}
}
