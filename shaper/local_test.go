package shaper

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/shaper-dev/shaper/internal/redistest"
)

// deleteKeys removes every key under prefix when the test ends: tests that
// make thousands of buckets should not leave them in a shared Redis.
func deleteKeys(t *testing.T, rdb *redis.Client, prefix string) {
	t.Cleanup(func() {
		ctx := context.Background()
		iter := rdb.Scan(ctx, 0, prefix+":*", 1000).Iterator()
		var keys []string
		for iter.Next(ctx) {
			if keys = append(keys, iter.Val()); len(keys) == 1000 {
				rdb.Unlink(ctx, keys...)
				keys = keys[:0]
			}
		}
		if len(keys) > 0 {
			rdb.Unlink(ctx, keys...)
		}
	})
}

// heardPause reports whether g holds a pause of bucket for its waiting
// callers.
func heardPause(g *Gate, bucket string) bool {
	g.mu.Lock()
	defer g.mu.Unlock()
	l, ok := g.active[bucket]
	return ok && !l.pausedUntil.IsZero()
}

// waitUntil polls cond until it holds; the test fails after 10 s.
func waitUntil(t *testing.T, what string, cond func() bool) {
	t.Helper()
	for deadline := time.Now().Add(10 * time.Second); !cond(); {
		if time.Now().After(deadline) {
			t.Fatalf("waited 10s for %s", what)
		}
		time.Sleep(time.Millisecond)
	}
}

// TestProcessStateIsBounded uses 10,000 buckets once each and hears pauses
// of 2,000 buckets that have no caller in this process: afterwards the gate
// holds state for no bucket. Process state follows the callers waiting now,
// not the buckets ever used or paused (a map that only grows is a leak).
func TestProcessStateIsBounded(t *testing.T) {
	rdb := redis.NewClient(&redis.Options{Addr: redistest.Addr(t), PoolSize: 32})
	t.Cleanup(func() { _ = rdb.Close() })
	prefix := redistest.Prefix(t)
	deleteKeys(t, rdb, prefix)
	g := NewGate(rdb, Config{KeyPrefix: prefix})
	other := NewGate(rdb, Config{KeyPrefix: prefix}) // another replica: it pauses, g only hears of it
	ctx, cancel := context.WithCancel(context.Background())
	var wg sync.WaitGroup
	defer wg.Wait()
	defer cancel()
	startWatch(t, ctx, &wg, g)

	// A new bucket waits out its horizon (1ms here) before its first grant;
	// the tolerance covers a slow round trip on a busy test machine.
	fast := Policy{Limits: []Limit{{Rate: 1_000_000, Window: time.Second}}, NoGuard: true, Horizon: time.Millisecond, Tolerance: time.Second}
	const buckets, callers = 10_000, 32
	var next atomic.Int64
	var users sync.WaitGroup
	for range callers {
		users.Go(func() {
			for i := next.Add(1) - 1; i < buckets; i = next.Add(1) - 1 {
				b, err := g.Bucket(fmt.Sprintf("account-%d", i), fast)
				if err != nil {
					t.Error(err)
					return
				}
				p, err := b.Acquire(ctx)
				if err != nil {
					t.Error(err)
					return
				}
				if err := p.Release(ctx); err != nil {
					t.Error(err)
					return
				}
			}
		})
	}
	users.Wait()
	if t.Failed() {
		return
	}
	if n := g.activeBuckets(); n != 0 {
		t.Fatalf("after %d buckets were used once, the gate holds state for %d of them, want 0", buckets, n)
	}

	// One caller waits (a bucket shaped at one call an hour waits out its
	// first tick). Pauses of buckets without callers here, used before or
	// never, come first; the pause of the waiting caller's bucket last, so
	// once g has heard of it, it has heard of them all.
	slow := Policy{Limits: []Limit{{Rate: 1, Window: time.Hour}}}
	waiting, err := g.Bucket("waiting", slow)
	if err != nil {
		t.Fatal(err)
	}
	var waiter sync.WaitGroup
	defer waiter.Wait()
	waitCtx, stopWaiting := context.WithCancel(ctx)
	defer stopWaiting() // before waiter.Wait, also when the test fails
	waiter.Go(func() {
		if _, err := waiting.Acquire(waitCtx); !errors.Is(err, context.Canceled) {
			t.Errorf("the waiting caller's Acquire returned %v, want context.Canceled", err)
		}
	})
	waitUntil(t, "the caller to wait", func() bool { return g.activeBuckets() == 1 })
	for i := range 2000 {
		name := fmt.Sprintf("account-%d", i) // used above, no caller now
		if i%2 == 1 {
			name = fmt.Sprintf("never-used-%d", i)
		}
		b, err := other.Bucket(name, slow)
		if err != nil {
			t.Fatal(err)
		}
		if _, err := b.Control().Pause(ctx, time.Hour, "429"); err != nil {
			t.Fatal(err)
		}
	}
	b, err := other.Bucket("waiting", slow)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := b.Control().Pause(ctx, time.Hour, "429"); err != nil {
		t.Fatal(err)
	}
	waitUntil(t, "Watch to hear the pauses", func() bool { return heardPause(g, "waiting") })
	if n := g.activeBuckets(); n != 1 {
		t.Errorf("after 2,000 pauses of buckets without callers, the gate holds state for %d buckets, want 1 (the waiting caller's)", n)
	}
	stopWaiting()
	waiter.Wait()
	if n := g.activeBuckets(); n != 0 {
		t.Errorf("after the last caller left, the gate holds state for %d buckets, want 0", n)
	}
}
