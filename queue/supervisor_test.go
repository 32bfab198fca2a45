package queue

import (
	"context"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/hibiken/asynq"

	"github.com/shaper-dev/shaper/internal/vendorsim"
	"github.com/shaper-dev/shaper/shaper"
)

// TestQueuePausedWithNoMarkIsUnpaused: a vendor's queue that shaper
// paused stays paused only while the gate asks for it, whatever became of
// shaper's mark. Before, the supervisor unpaused only while the mark
// (SETNX, wait + 1 min) existed, and asynq's paused key never expires: a
// longer wait after a shorter one, or every worker down longer than the
// mark's TTL, left the calls pending for good with no error.
func TestQueuePausedWithNoMarkIsUnpaused(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	p := shaper.Policy{Limits: []shaper.Limit{{Rate: 20, Window: time.Second}}}
	vend := &vendorsim.Mock{Rate: 20, Window: time.Second}
	name := e.vendor("unmarked", p, 0, vend)
	c := e.newClient()
	rdb := e.rdb()
	gate := shaper.NewGate(rdb, shaper.Config{KeyPrefix: e.prefix})
	b, err := gate.Bucket(bucketName(name), p)
	if err != nil {
		t.Fatal(err)
	}
	ctx := context.Background()
	if _, err := b.Control().Pause(ctx, 6*time.Second, "test: Retry-After 6"); err != nil {
		t.Fatal(err)
	}
	const n = 5
	enqueueN(t, c, name, n)
	e.startWorker(nil)
	insp := asynq.NewInspectorFromRedisClient(rdb)
	waitFor(t, 20*time.Second, "the calls sent back and the queue paused", func() bool {
		info, err := insp.GetQueueInfo(QueueName(name))
		return err == nil && info.Paused && info.Active == 0 && info.Retry > 0
	})
	// The mark runs out while the queue is paused (as when a longer wait
	// outlived it, or the workers were down past its TTL).
	if err := rdb.Del(ctx, queuePausedKey(e.prefix, name)).Err(); err != nil {
		t.Fatal(err)
	}
	waitFor(t, 30*time.Second, "every call done after the pause", func() bool { return vend.Summarize().DistinctKeys == n })
	if n, _ := rdb.Exists(ctx, asynqKey(QueueName(name), "paused")).Result(); n != 0 {
		t.Error("the queue is still paused")
	}
}

// TestLongerWaitExtendsTheMark: a pause for a longer wait than the one
// that marked the queue keeps the mark until the longer wait is over, and
// a wait of every lane after a normal lane's pauses the high lane too
// (SETNX kept the first mark's expiry and lanes).
func TestLongerWaitExtendsTheMark(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	name := e.vendor("extend", shaper.Policy{Limits: []shaper.Limit{{Rate: 20, Window: time.Second}}}, 0, &vendorsim.Mock{Rate: 20, Window: time.Second})
	rdb := e.rdb()
	w, err := NewWorker(rdb, WorkerConfig{Vendors: e.vendors, KeyPrefix: e.prefix, MaxWait: 3 * time.Second})
	if err != nil {
		t.Fatal(err)
	}
	rt := w.vendors[name]
	ctx := context.Background()
	key := queuePausedKey(e.prefix, name)
	t.Cleanup(func() {
		rdb.Del(ctx, key, asynqKey(rt.queue, "paused"), asynqKey(rt.high, "paused"))
	})
	w.pauseQueue(ctx, rt, 6*time.Second, shaper.Normal)
	w.pauseQueue(ctx, rt, 10*time.Minute, shaper.High)
	ttl, err := rdb.PTTL(ctx, key).Result()
	if err != nil {
		t.Fatal(err)
	}
	if ttl < 10*time.Minute {
		t.Errorf("the mark expires in %s after a wait of 10m", ttl)
	}
	if lanes := rdb.Get(ctx, key).Val(); lanes != "both" {
		t.Errorf("the mark covers %q after a wait of every lane, want both", lanes)
	}
	for _, q := range []string{rt.queue, rt.high} {
		v, err := rdb.Get(ctx, asynqKey(q, "paused")).Result()
		if err != nil || !strings.HasPrefix(v, pausedByShaper) {
			t.Errorf("queue %s: paused key %q (%v), want paused by shaper", q, v, err)
		}
	}
	// A shorter wait after it never shortens the mark.
	w.pauseQueue(ctx, rt, time.Second, shaper.Normal)
	if ttl, _ := rdb.PTTL(ctx, key).Result(); ttl < 10*time.Minute-time.Minute {
		t.Errorf("a shorter wait cut the mark to %s", ttl)
	}
}

// TestWorkerStartHealsAPausedQueue: a queue shaper paused and left with no
// mark (its workers all stopped past the mark's TTL) is unpaused by the
// next worker to serve it; a queue an operator paused (asynqmon's Pause)
// stays paused.
func TestWorkerStartHealsAPausedQueue(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	p := shaper.Policy{Limits: []shaper.Limit{{Rate: 20, Window: time.Second}}}
	healed := &vendorsim.Mock{Rate: 20, Window: time.Second}
	byHand := &vendorsim.Mock{Rate: 20, Window: time.Second}
	healedName := e.vendor("healed", p, 0, healed)
	byHandName := e.vendor("byhand", p, 0, byHand)
	c := e.newClient()
	rdb := e.rdb()
	ctx := context.Background()
	const n = 3
	enqueueN(t, c, healedName, n)
	enqueueN(t, c, byHandName, n)
	// Left as shaper's pause leaves it, with the mark gone.
	if err := rdb.Set(ctx, asynqKey(QueueName(healedName), "paused"), pausedByShaper+strconv.FormatInt(time.Now().Add(-time.Hour).Unix(), 10), 0).Err(); err != nil {
		t.Fatal(err)
	}
	insp := asynq.NewInspectorFromRedisClient(rdb)
	if err := insp.PauseQueue(QueueName(byHandName)); err != nil {
		t.Fatal(err)
	}
	e.startWorker(nil)
	waitFor(t, 30*time.Second, "the calls of the queue shaper had paused", func() bool { return healed.Summarize().DistinctKeys == n })
	// Both vendors' supervisors had their first look by now (both
	// servers started with the worker, their queues having work).
	time.Sleep(time.Second)
	paused, err := rdb.Exists(ctx, asynqKey(QueueName(byHandName), "paused")).Result()
	if got := byHand.Summarize().Requests; err != nil || got != 0 || paused != 1 {
		t.Errorf("the queue an operator paused: %d requests, paused %d (%v); want it left paused", got, paused, err)
	}
}
