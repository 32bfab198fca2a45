package queue

import (
	"context"
	"encoding/json"
	"fmt"
	"testing"
	"time"

	"github.com/hibiken/asynq"
	"github.com/redis/go-redis/v9"

	"github.com/shaper-dev/shaper/internal/redistest"
	"github.com/shaper-dev/shaper/shaper"
	"github.com/shaper-dev/shaper/vendorclients"
)

// allocated is what Redis holds from its allocator (MEMORY STATS
// allocator.allocated), once its cron has refreshed the figure.
func allocated(t *testing.T, rdb *redis.Client) int64 {
	t.Helper()
	time.Sleep(300 * time.Millisecond) // Redis refreshes its allocator stats in its cron
	st, err := rdb.Do(context.Background(), "MEMORY", "STATS").Result()
	if err != nil {
		t.Fatal(err)
	}
	n, ok := st.(map[any]any)["allocator.allocated"].(int64)
	if !ok {
		t.Fatalf("MEMORY STATS: %v", st)
	}
	return n
}

// TestLongQueuedCallMemory: 100,000 calls queued for one account of a
// per-account vendor (a backlog the client plans into asynq's schedule)
// cost no more Redis memory per call than the same tasks enqueued with
// plain asynq into its schedule, plus 64 bytes.
func TestLongQueuedCallMemory(t *testing.T) {
	redistest.Long(t)
	srv := redistest.Start(t)
	rdb := redis.NewClient(&redis.Options{Addr: srv.Addr})
	t.Cleanup(func() { _ = rdb.Close() })
	ctx := context.Background()
	const n = 100_000
	calls := make([]Call, n)
	for i := range calls {
		calls[i] = Call{Account: "store-1", ID: fmt.Sprintf("order-%06d", i), Method: "POST", Path: "/orders"}
	}

	// Plain asynq: the same payloads, ids and queue, scheduled.
	aq := asynq.NewClientFromRedisClient(rdb)
	base := allocated(t, rdb)
	for i, c := range calls {
		c.Vendor = "plain"
		payload, _ := json.Marshal(c)
		if _, err := aq.EnqueueContext(ctx, asynq.NewTask(TypeCall, payload), asynq.Queue(QueueName("plain")),
			asynq.TaskID(c.ID), asynq.ProcessIn(time.Hour+time.Duration(i)*time.Second)); err != nil {
			t.Fatal(err)
		}
	}
	plain := float64(allocated(t, rdb)-base) / n

	vendor := Vendor{Endpoint: vendorclients.Endpoint{Name: "shop", BaseURL: "https://api.shop.example/stores/{account}"},
		Policy: shaper.Policy{Limits: []shaper.Limit{{Rate: 5, Window: time.Second}}}, PerAccount: true}
	c := NewClient(rdb, ClientConfig{Vendors: []Vendor{vendor}})
	t.Cleanup(func() { _ = c.Close() })
	base = allocated(t, rdb)
	if _, err := c.EnqueueBatch(ctx, "shop", calls); err != nil {
		t.Fatal(err)
	}
	shaped := float64(allocated(t, rdb)-base) / n
	st, _ := c.QueueStats(ctx, "shop")
	t.Logf("%d calls queued: %.0f bytes each with plain asynq, %.0f with shaper (%+.0f); %d scheduled, %d pending",
		n, plain, shaped, shaped-plain, st.Scheduled, st.Pending)
	if st.Scheduled < n-20 {
		t.Errorf("%d of %d calls in asynq's schedule: the backlog was not planned", st.Scheduled, n)
	}
	if shaped > plain+64 {
		t.Errorf("a queued call costs %.0f bytes, plain asynq's record %.0f: more than 64 bytes above", shaped, plain)
	}
	_ = aq.Close()
}
