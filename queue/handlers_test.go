package queue

import (
	"context"
	"fmt"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/hibiken/asynq"

	"github.com/shaper-dev/shaper/internal/redistest"
	"github.com/shaper-dev/shaper/internal/vendorsim"
	"github.com/shaper-dev/shaper/vendorclients"
)

// advertise says, once, on Redis time, that a worker named worker
// handles taskType on vendor's queue, as its heartbeat would: a worker
// that has a handler but is not running yet.
func advertise(t *testing.T, e *env, worker, vendor, taskType string) {
	t.Helper()
	l := newLiveness(e.rdb(), e.prefix, worker)
	l.handled = func() []string { return []string{handlerMember(vendor, taskType)} }
	if _, err := l.alive(context.Background()); err != nil {
		t.Fatal(err)
	}
}

// TestTaskLeftForTheWorkerWithItsHandler runs a stock worker and, on the
// same Redis, a worker with a handler for a task type of the user's. A
// task of that type the stock worker takes goes back to its queue without
// using a retry, and the worker with the handler runs it, with Retried 0:
// first a task the stock worker alone can take (the other advertised its
// handler before it started), then tasks queued while both run. (Before,
// the stock worker failed the task: each time it took it, a retry spent.)
func TestTaskLeftForTheWorkerWithItsHandler(t *testing.T) {
	e := newEnv(t)
	vendor := e.vendor("left", policy(50), 0, &vendorsim.Mock{Rate: 50, Window: time.Second})
	const taskType = "test:custom"
	c := e.newClient()
	insp := asynq.NewInspectorFromRedisClient(e.rdb())
	ctx := context.Background()

	e.startWorker(nil) // stock: no handler
	advertise(t, e, "custom-starting", vendor, taskType)
	first := "left-first"
	if _, err := c.EnqueueTask(ctx, Target{Vendor: vendor}, asynq.NewTask(taskType, nil), asynq.TaskID(first)); err != nil {
		t.Fatal(err)
	}
	var info *asynq.TaskInfo
	waitFor(t, 20*time.Second, "the stock worker to take the task", func() bool {
		i, err := insp.GetTaskInfo(QueueName(vendor), first)
		if err == nil && i.LastErr != "" {
			info = i
		}
		return info != nil
	})
	t.Logf("after the stock worker took it: %s, retried %d, %q", info.State, info.Retried, info.LastErr)
	if info.Retried != 0 || info.State == asynq.TaskStateArchived || !strings.Contains(info.LastErr, taskType) {
		t.Fatalf("the task the stock worker took is %s, retried %d, error %q; want it back in the queue, retried 0, its error naming %s",
			info.State, info.Retried, info.LastErr, taskType)
	}

	var mu sync.Mutex
	ran := map[string]int{} // task id -> its retry count when it ran
	e.startWorker(func(w *Worker) {
		if err := w.Handle(taskType, func(ctx context.Context, _ *asynq.Task, _ *vendorclients.Client) error {
			id, _ := asynq.GetTaskID(ctx)
			retried, _ := asynq.GetRetryCount(ctx)
			mu.Lock()
			ran[id] = retried
			mu.Unlock()
			return nil
		}); err != nil {
			t.Fatal(err)
		}
	})
	ids := []string{first}
	for i := range 20 {
		id := fmt.Sprintf("left-%02d", i)
		if _, err := c.EnqueueTask(ctx, Target{Vendor: vendor}, asynq.NewTask(taskType, nil), asynq.TaskID(id)); err != nil {
			t.Fatal(err)
		}
		ids = append(ids, id)
	}
	waitFor(t, 60*time.Second, "every task to run", func() bool {
		mu.Lock()
		defer mu.Unlock()
		return len(ran) == len(ids)
	})
	givenBack := 0
	for _, id := range ids {
		if ran[id] != 0 {
			t.Errorf("task %s ran with retry count %d, want 0", id, ran[id])
		}
		var i *asynq.TaskInfo
		waitFor(t, 10*time.Second, "task "+id+" to be recorded completed", func() bool {
			var err error
			i, err = insp.GetTaskInfo(QueueName(vendor), id)
			return err == nil && i.State == asynq.TaskStateCompleted
		})
		if i.Retried != 0 {
			t.Errorf("task %s completed with Retried %d, want 0", id, i.Retried)
		}
		if i.LastErr != "" {
			givenBack++
		}
	}
	t.Logf("%d of %d tasks were taken by the stock worker first and given back", givenBack, len(ids))
}

// TestTaskNoWorkerHandlesIsArchived queues tasks of a type no live worker
// handles on the task's vendor: one no worker advertises, and one a
// worker advertises on another vendor only. Each is archived the first
// time a worker takes it, with no retry spent, its error naming the type
// and the vendor and saying what to do. (Before, it was retried until
// its retries ran out.)
func TestTaskNoWorkerHandlesIsArchived(t *testing.T) {
	e := newEnv(t)
	vendor := e.vendor("orphan", policy(50), 0, &vendorsim.Mock{Rate: 50, Window: time.Second})
	other := e.vendor("elsewhere", policy(50), 0, &vendorsim.Mock{Rate: 50, Window: time.Second})
	c := e.newClient()
	insp := asynq.NewInspectorFromRedisClient(e.rdb())
	ctx := context.Background()
	e.startWorker(nil)
	advertise(t, e, "other-vendor-only", other, "test:elsewhere")
	for _, taskType := range []string{"test:nobody", "test:elsewhere"} {
		t.Run(taskType, func(t *testing.T) {
			id := "orphan-" + strings.TrimPrefix(taskType, "test:")
			if _, err := c.EnqueueTask(ctx, Target{Vendor: vendor}, asynq.NewTask(taskType, nil), asynq.TaskID(id)); err != nil {
				t.Fatal(err)
			}
			var info *asynq.TaskInfo
			waitFor(t, 20*time.Second, "a worker to take the task", func() bool {
				i, err := insp.GetTaskInfo(QueueName(vendor), id)
				if err == nil && i.LastErr != "" {
					info = i
				}
				return info != nil
			})
			t.Logf("%s: %s, retried %d: %s", id, info.State, info.Retried, info.LastErr)
			if info.State != asynq.TaskStateArchived || info.Retried != 0 {
				t.Errorf("the task is %s, retried %d; want archived at once, retried 0", info.State, info.Retried)
			}
			for _, want := range []string{fmt.Sprintf("%q", taskType), vendor, "Worker.Handle"} {
				if !strings.Contains(info.LastErr, want) {
					t.Errorf("its error %q does not name %s", info.LastErr, want)
				}
			}
		})
	}
}

// TestHandlersForgetStoppedWorkers, on simulated Redis time: the pairs a
// worker advertises stay in the handlers' set while it beats, and leave
// it aliveForget after its last beat, trimmed by another worker's beat;
// a worker without handlers adds nothing; the set expires within
// aliveForget of the last beat that wrote it.
func TestHandlersForgetStoppedWorkers(t *testing.T) {
	rdb := redistest.Client(t)
	prefix := redistest.Prefix(t)
	ctx := context.Background()
	now := time.Now().UnixMicro()
	clock := func() int64 { return now }
	advance := func(d time.Duration) { now += d.Microseconds() }
	worker := func(id string, members ...string) *liveness {
		l := newLiveness(rdb, prefix, id)
		l.now = clock
		l.handled = func() []string { return members }
		return l
	}
	a := worker("a", handlerMember("acme", "a:type"), handlerMember("globex", "a:type"))
	b := worker("b", handlerMember("acme", "b:type"))
	stock := worker("stock")
	beat := func(ls ...*liveness) {
		t.Helper()
		for _, l := range ls {
			if _, err := l.alive(ctx); err != nil {
				t.Fatal(err)
			}
		}
	}
	handled := func(vendor, taskType string) bool {
		t.Helper()
		ok, err := stock.handledElsewhere(ctx, vendor, taskType)
		if err != nil {
			t.Fatal(err)
		}
		return ok
	}
	members := func() []string {
		t.Helper()
		ms, err := rdb.ZRange(ctx, handlersKey(prefix), 0, -1).Result()
		if err != nil {
			t.Fatal(err)
		}
		return ms
	}

	beat(stock)
	if ms := members(); len(ms) != 0 {
		t.Fatalf("after a stock worker's beat the set holds %q, want nothing", ms)
	}
	beat(a, b, stock)
	if ms := members(); len(ms) != 3 {
		t.Fatalf("the set holds %q, want a's two pairs and b's", ms)
	}
	for _, p := range [][2]string{{"acme", "a:type"}, {"globex", "a:type"}, {"acme", "b:type"}} {
		if !handled(p[0], p[1]) {
			t.Errorf("%s on %s is not handled, want it advertised", p[1], p[0])
		}
	}
	if handled("globex", "b:type") || handled("acme", "nobody") {
		t.Error("a pair nobody advertised is handled")
	}
	if ttl, err := rdb.PTTL(ctx, handlersKey(prefix)).Result(); err != nil || ttl <= 0 || ttl > aliveForget {
		t.Errorf("the set's TTL = %v, %v; want at most aliveForget", ttl, err)
	}

	// a stops; b and the stock worker beat on.
	if err := a.leave(ctx); err != nil {
		t.Fatal(err)
	}
	advance(aliveForget - time.Second)
	beat(b, stock)
	if !handled("acme", "a:type") {
		t.Error("a's pair is forgotten before aliveForget: a restarting worker's tasks would be archived")
	}
	advance(2 * time.Second)
	if handled("acme", "a:type") {
		t.Error("a's pair is still handled aliveForget after its last beat")
	}
	beat(b, stock)
	if ms := members(); len(ms) != 1 || ms[0] != handlerMember("acme", "b:type") {
		t.Errorf("aliveForget after a's last beat, the set holds %q; want b's pair alone", ms)
	}
}

// TestHandlersKeySharesTheAliveSlot: the heartbeat writes the alive set
// and the handlers' set in one script, so on Redis Cluster both must be
// in one hash slot: the handlers' key's hash tag is the alive key whole
// (which has none), or the prefix's own tag, first in both.
func TestHandlersKeySharesTheAliveSlot(t *testing.T) {
	for _, prefix := range []string{"shaper", "app:shaper", "app{tenant}"} {
		if got, want := hashTag(handlersKey(prefix)), hashTag(aliveKey(prefix)); got != want {
			t.Errorf("prefix %q: %s hashes %q, %s hashes %q", prefix, handlersKey(prefix), got, aliveKey(prefix), want)
		}
	}
}

// hashTag is what Redis Cluster hashes of key: its first {tag}, if not
// empty, else the key whole.
func hashTag(key string) string {
	if i := strings.IndexByte(key, '{'); i >= 0 {
		if j := strings.IndexByte(key[i+1:], '}'); j > 0 {
			return key[i+1 : i+1+j]
		}
	}
	return key
}
