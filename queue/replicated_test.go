package queue

import (
	"context"
	"errors"
	"strings"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/shaper-dev/shaper/internal/redistest"
	"github.com/shaper-dev/shaper/shaper"
)

// TestOwnRedisEnqueueWaitsForReplicas: with WaitReplicas set, an enqueue returns
// once a replica holds it; with the replica gone (or more asked for than
// there are), it says the calls are queued on the master only, after
// WaitTimeout, and the calls are still queued.
func TestOwnRedisEnqueueWaitsForReplicas(t *testing.T) {
	t.Parallel()
	master := redistest.Start(t)
	replica := redistest.StartReplica(t, master)
	e := &env{t: t, addr: master.Addr, prefix: redistest.Prefix(t)}
	name := e.vendor("durable", shaper.Policy{Limits: []shaper.Limit{{Rate: 10, Window: time.Second}}}, 0, nil)
	rdb := redis.NewClient(&redis.Options{Addr: master.Addr})
	defer rdb.Close()
	ctx := context.Background()
	newClient := func(n int) *Client {
		c := NewClient(rdb, ClientConfig{Vendors: e.vendors, KeyPrefix: e.prefix, WaitReplicas: n, WaitTimeout: 300 * time.Millisecond})
		t.Cleanup(func() { _ = c.Close() })
		return c
	}
	one, two := newClient(1), newClient(2)

	if _, err := one.Enqueue(ctx, Call{Vendor: name, ID: "a", Path: "/x"}); err != nil {
		t.Fatalf("one replica asked for, one there: %v", err)
	}
	res, err := one.EnqueueBatch(ctx, name, []Call{{ID: "b", Path: "/x"}, {ID: "c", Path: "/x"}})
	if err != nil || res.Enqueued != 2 {
		t.Fatalf("batch with one replica: %+v, %v", res, err)
	}
	// The replica holds them.
	rc := redis.NewClient(&redis.Options{Addr: replica.Addr})
	defer rc.Close()
	if n, err := rc.Exists(ctx, "asynq:{"+QueueName(name)+"}:t:c").Result(); err != nil || n != 1 {
		t.Errorf("the replica does not hold call c after the enqueue returned: %d, %v", n, err)
	}

	begin := time.Now()
	_, err = two.Enqueue(ctx, Call{Vendor: name, ID: "d", Path: "/x"})
	if !errors.Is(err, ErrNotReplicated) || !strings.Contains(err.Error(), "1 of the 2 replica(s)") {
		t.Errorf("two replicas asked for, one there: %v", err)
	}
	if took := time.Since(begin); took < 250*time.Millisecond {
		t.Errorf("gave up after %s, before the 300ms timeout", took)
	}

	replica.Kill()
	res, err = one.EnqueueBatch(ctx, name, []Call{{ID: "e", Path: "/x"}})
	if !errors.Is(err, ErrNotReplicated) || res.Enqueued != 1 || !strings.Contains(err.Error(), "0 of the 1 replica(s)") {
		t.Errorf("replica gone: %+v, %v", res, err)
	}
	if n, err := one.Waiting(ctx, name); err != nil || n != 5 {
		t.Errorf("%d calls queued (%v), want 5: an unreplicated enqueue still queues", n, err)
	}
}
