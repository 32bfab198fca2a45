package queue

import (
	"context"
	"log/slog"
	"net/http"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/hibiken/asynq"
	"github.com/redis/go-redis/v9"

	"github.com/shaper-dev/shaper/internal/logtest"
	"github.com/shaper-dev/shaper/internal/redistest"
	"github.com/shaper-dev/shaper/shaper"
)

// TestRequeueHeldTask pins what requeueScript assumes of asynq v0.26's
// keys: a task an asynq server holds (active, under a lease) goes back to
// pending as asynq's Inspector sees it, and asynq's server runs it again;
// a task no longer active is left alone. It fails when asynq changes the
// layout of its keys.
func TestRequeueHeldTask(t *testing.T) {
	rdb := redistest.Client(t)
	q := "requeue-" + redistest.Prefix(t)[5:]
	ac := asynq.NewClientFromRedisClient(rdb)
	if _, err := ac.Enqueue(asynq.NewTask("held", nil), asynq.Queue(q), asynq.TaskID("t1")); err != nil {
		t.Fatal(err)
	}
	var runs atomic.Int32
	dead := &Worker{live: &liveness{worker: "dead-worker"}}
	holding := make(chan string, 1)
	release := make(chan struct{})
	srv := asynq.NewServerFromRedisClient(rdb, asynq.Config{Concurrency: 2, Queues: map[string]int{q: 1}, LogLevel: asynq.FatalLevel})
	if err := srv.Start(asynq.HandlerFunc(func(ctx context.Context, _ *asynq.Task) error {
		if runs.Add(1) == 1 {
			holding <- dead.tagOf(ctx)
			<-release // the dead worker's handler: it never returns in time
		}
		return nil
	})); err != nil {
		t.Fatal(err)
	}
	defer srv.Shutdown()
	var tag string
	select {
	case tag = <-holding:
	case <-time.After(30 * time.Second):
		t.Fatal("asynq did not run the task")
	}
	worker, holder := taskOfTag(tag)
	if worker != "dead-worker" || holder != q+"|t1" {
		t.Fatalf("tagOf = %q (worker %q, task %q), want dead-worker|%s|t1", tag, worker, holder, q)
	}
	insp := asynq.NewInspectorFromRedisClient(rdb)
	if info, err := insp.GetTaskInfo(q, "t1"); err != nil || info.State != asynq.TaskStateActive {
		t.Fatalf("before: %+v %v, want active", info, err)
	}
	ctx := context.Background()
	// The first run still holds its copy (a dead worker's); the second
	// slot of the server takes the task back from pending.
	// A lease newer than the one given (another worker took the task
	// since) keeps the task where it is.
	if ok, err := requeueHeld(ctx, rdb, holder, time.Now()); err != nil || ok {
		t.Fatalf("requeueHeld under a newer lease = %v, %v; want false", ok, err)
	}
	ok, err := requeueHeld(ctx, rdb, holder, time.Now().Add(time.Minute))
	if err != nil || !ok {
		t.Fatalf("requeueHeld = %v, %v; want true", ok, err)
	}
	if leased, err := rdb.ZScore(ctx, "asynq:{"+q+"}:lease", "t1").Result(); err == nil {
		t.Errorf("the task keeps its lease (%v)", leased)
	}
	waitFor(t, 30*time.Second, "asynq's server to run the task again", func() bool { return runs.Load() >= 2 })
	close(release)
	waitFor(t, 30*time.Second, "the task to be done", func() bool {
		info, err := insp.GetTaskInfo(q, "t1")
		return err != nil || info.State == asynq.TaskStateCompleted
	})
	if ok, err := requeueHeld(ctx, rdb, holder, time.Now().Add(time.Minute)); err != nil || ok {
		t.Errorf("requeueHeld of a task no longer active = %v, %v; want false", ok, err)
	}
}

// TestStalledCalls: a call whose lease nobody renewed for over
// StallAfter (a dead worker's, asynq's lease backdated as the passing
// time would) counts as stalled in QueueStats, with how long; a call
// under a renewed lease does not. stallLog says a stall once and its end
// once.
func TestStalledCalls(t *testing.T) {
	e := newEnv(t)
	rdb := e.rdb()
	vendor := "stall-" + e.prefix[5:]
	q := QueueName(vendor)
	ac := asynq.NewClientFromRedisClient(rdb)
	if _, err := ac.Enqueue(asynq.NewTask("held", nil), asynq.Queue(q), asynq.TaskID("s1")); err != nil {
		t.Fatal(err)
	}
	holding := make(chan struct{}, 1)
	release := make(chan struct{})
	srv := asynq.NewServerFromRedisClient(rdb, asynq.Config{Concurrency: 1, Queues: map[string]int{q: 1}, LogLevel: asynq.FatalLevel})
	if err := srv.Start(asynq.HandlerFunc(func(context.Context, *asynq.Task) error {
		holding <- struct{}{}
		<-release
		return nil
	})); err != nil {
		t.Fatal(err)
	}
	defer srv.Shutdown()
	defer close(release) // before the shutdown, which waits for the handler
	<-holding
	ctx := context.Background()
	qs, err := readQueueStats(ctx, rdb, vendor, queueStalls)
	if err != nil || qs.Active != 1 || qs.Stalled != 0 {
		t.Fatalf("a live worker's call: %+v %v, want 1 active, 0 stalled", qs, err)
	}
	// Backdate the lease to a renewal 40 s ago; the server's heartbeat
	// renews it every 5 s, so read at once (and try again if it won).
	for try := 0; ; try++ {
		last := time.Now().Add(-40 * time.Second)
		if err := rdb.ZAddXX(ctx, "asynq:{"+q+"}:lease", redis.Z{Score: float64(last.Add(asynqLease).Unix()), Member: "s1"}).Err(); err != nil {
			t.Fatal(err)
		}
		qs, err = readQueueStats(ctx, rdb, vendor, queueStalls)
		if err != nil {
			t.Fatal(err)
		}
		if qs.Stalled == 1 && qs.StalledFor >= 39*time.Second && qs.StalledFor <= 42*time.Second {
			break
		}
		if try == 3 {
			t.Fatalf("a call whose lease was renewed 40 s ago: %+v, want 1 stalled for about 40 s", qs)
		}
	}
	var logs logtest.Buffer
	s := stallLog{log: slog.New(slog.NewTextHandler(&logs, nil))}
	for range 3 {
		s.check(qs)
	}
	s.check(QueueStats{})
	s.check(QueueStats{})
	if out := logs.String(); strings.Count(out, "calls are stalled") != 1 || strings.Count(out, "no call is stalled") != 1 ||
		!strings.Contains(out, "1 calls are stalled") {
		t.Errorf("stall log:\n%s\nwant the stall once and its end once", out)
	}
}

// TestSweepStale: of the calls under a lease no worker renewed for
// staleAfter, the one the gate never granted a tick goes back to its
// queue; the one granted a tick that has passed (it may be at the
// vendor) stays for asynq's lease, and so does one whose lease was last
// renewed longer ago than the record of grants covers. The active
// tasks are made as asynq's dequeue makes them (TestRequeueHeldTask pins
// that layout against asynq's own server).
func TestSweepStale(t *testing.T) {
	e := newEnv(t)
	vendor := e.vendor("sweep", shaper.Policy{Limits: []shaper.Limit{{Rate: 10, Window: time.Second}}}, 0, http.NotFoundHandler())
	rdb := e.rdb()
	w, err := NewWorker(rdb, WorkerConfig{Vendors: e.vendors, KeyPrefix: e.prefix, Logger: slog.New(slog.DiscardHandler)})
	if err != nil {
		t.Fatal(err)
	}
	w.health.answered(time.Now().Add(-time.Minute)) // Redis has answered for a minute
	w.health.answered(time.Now())
	rt := w.vendors[vendor]
	q := QueueName(vendor)
	ctx := context.Background()
	ac := asynq.NewClientFromRedisClient(rdb)
	take := func(id string, renewed time.Duration) {
		t.Helper()
		if _, err := ac.Enqueue(asynq.NewTask("t", nil), asynq.Queue(q), asynq.TaskID(id)); err != nil {
			t.Fatal(err)
		}
		k := asynqKeys(q, id)
		pipe := rdb.TxPipeline()
		pipe.LRem(ctx, k[2], 0, id)
		pipe.LPush(ctx, k[0], id)
		pipe.ZAdd(ctx, k[1], redis.Z{Score: float64(time.Now().Add(asynqLease - renewed).Unix()), Member: id})
		pipe.HSet(ctx, k[3], "state", "active")
		if _, err := pipe.Exec(ctx); err != nil {
			t.Fatal(err)
		}
	}
	take("never-granted", 20*time.Second)
	take("granted", 20*time.Second)
	take("too-old", 40*time.Second)
	// A tick for "granted", which then passes.
	p, err := rt.bucket().Acquire(ctx, shaper.Request{Tag: "another-worker|" + q + "|granted"})
	if err != nil {
		t.Fatal(err)
	}
	time.Sleep(time.Until(p.Tick) + 10*time.Millisecond)
	n, err := w.sweepStale(ctx, rt)
	if err != nil || n != 1 {
		t.Fatalf("sweepStale = %d, %v; want 1", n, err)
	}
	insp := asynq.NewInspectorFromRedisClient(rdb)
	for id, want := range map[string]asynq.TaskState{"never-granted": asynq.TaskStatePending, "granted": asynq.TaskStateActive, "too-old": asynq.TaskStateActive} {
		if info, err := insp.GetTaskInfo(q, id); err != nil || info.State != want {
			t.Errorf("%s: %v %v, want %s", id, info, err, want)
		}
	}
}
