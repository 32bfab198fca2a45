package queue

import (
	"context"
	"errors"
	"fmt"
	"net/http"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/hibiken/asynq"
	"github.com/redis/go-redis/v9"

	"github.com/shaper-dev/shaper/shaper"
	"github.com/shaper-dev/shaper/vendorclients"
)

// lanesHolding says which lanes of vendor hold task id.
func lanesHolding(t *testing.T, rdb redis.UniversalClient, vendor, id string) []string {
	t.Helper()
	var out []string
	for _, l := range []shaper.Lane{shaper.Normal, shaper.High} {
		n, err := rdb.Exists(context.Background(), asynqTaskKey(laneQueue(vendor, l), id)).Result()
		if err != nil {
			t.Fatal(err)
		}
		if n > 0 {
			out = append(out, l.String())
		}
	}
	return out
}

// TestIDNamesOneCallAcrossLanes: a call posted again with the other
// priority answers with the call already queued (ErrDuplicate, its lane)
// and queues nothing; two enqueues of the same id into the two lanes at
// the same moment queue it once, for each of 40 ids.
func TestIDNamesOneCallAcrossLanes(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	v := e.vendor("lanes", policy(10), 0, http.NotFoundHandler())
	c := e.newClient()
	rdb := e.rdb()
	ctx := context.Background()
	if _, err := c.Enqueue(ctx, Call{Vendor: v, ID: "x", Path: "/x"}); err != nil {
		t.Fatal(err)
	}
	id, err := c.Enqueue(ctx, Call{Vendor: v, ID: "x", Path: "/x", Priority: "high"})
	if !errors.Is(err, ErrDuplicate) || id != "x" || !strings.Contains(err.Error(), "normal lane") {
		t.Errorf("x again, high: %q, %v; want x and ErrDuplicate naming the normal lane", id, err)
	}
	res, err := c.EnqueueBatch(ctx, v, []Call{{ID: "x", Path: "/x", Priority: "high"}, {ID: "y", Path: "/y", Priority: "high"}})
	if err != nil || res.Enqueued != 1 || res.AlreadyQueued != 1 || res.Calls[0].State != StateAlreadyQueued || res.Calls[0].Lane != "normal" {
		t.Errorf("batch x, y (high): %+v, %v; want x already queued in the normal lane, y queued", res, err)
	}
	if got := lanesHolding(t, rdb, v, "x"); len(got) != 1 || got[0] != "normal" {
		t.Errorf("x is in lanes %v, want [normal]", got)
	}

	const n = 40
	var wg sync.WaitGroup
	start := make(chan struct{})
	errs := make(chan error, 2*n)
	for i := range n {
		for _, prio := range []string{"normal", "high"} {
			wg.Add(1)
			go func() {
				defer wg.Done()
				<-start
				_, err := c.Enqueue(ctx, Call{Vendor: v, ID: fmt.Sprintf("race-%d", i), Path: "/r", Priority: prio})
				if err != nil && !errors.Is(err, ErrDuplicate) {
					errs <- err
				}
			}()
		}
	}
	close(start)
	wg.Wait()
	close(errs)
	for err := range errs {
		t.Errorf("enqueue: %v", err)
	}
	for i := range n {
		if got := lanesHolding(t, rdb, v, fmt.Sprintf("race-%d", i)); len(got) != 1 {
			t.Errorf("race-%d is in lanes %v, want exactly one", i, got)
		}
	}
}

// TestRepostWithAnotherPriorityCallsOnce: calls posted with an id, then
// posted again with the other priority (some one after the other, some
// at the same moment), reach the vendor once each through a real worker.
func TestRepostWithAnotherPriorityCallsOnce(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	var mu sync.Mutex
	seen := map[string]int{}
	v := e.vendor("once", policy(50), 0, http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		mu.Lock()
		seen[r.Header.Get("Idempotency-Key")]++
		mu.Unlock()
	}))
	c := e.newClient()
	ctx := context.Background()
	const n = 20
	calls := func(prio string) []Call {
		out := make([]Call, n)
		for i := range out {
			out[i] = Call{ID: fmt.Sprintf("o-%02d", i), Path: "/o", Priority: prio}
		}
		return out
	}
	if res, err := c.EnqueueBatch(ctx, v, calls("normal")); err != nil || res.Enqueued != n {
		t.Fatalf("first post: %+v, %v", res, err)
	}
	if res, err := c.EnqueueBatch(ctx, v, calls("high")); err != nil || res.AlreadyQueued != n {
		t.Errorf("posted again, high: %d queued, %d already (%v); want %d already", res.Enqueued, res.AlreadyQueued, err, n)
	}
	var wg sync.WaitGroup
	start := make(chan struct{})
	for _, prio := range []string{"normal", "high"} {
		wg.Add(1)
		go func() {
			defer wg.Done()
			<-start
			out := make([]Call, n)
			for i := range out {
				out[i] = Call{ID: fmt.Sprintf("p-%02d", i), Path: "/p", Priority: prio}
			}
			if _, err := c.EnqueueBatch(ctx, v, out); err != nil {
				t.Errorf("%s: %v", prio, err)
			}
		}()
	}
	close(start)
	wg.Wait()
	e.startWorker(nil)
	waitFor(t, time.Minute, "every call at the vendor", func() bool {
		mu.Lock()
		defer mu.Unlock()
		return len(seen) >= 2*n
	})
	time.Sleep(time.Second) // a second copy would follow at 50/s
	mu.Lock()
	defer mu.Unlock()
	for key, times := range seen {
		if times != 1 {
			t.Errorf("the vendor was called %d times with Idempotency-Key %s, want once", times, key)
		}
	}
	if len(seen) != 2*n {
		t.Errorf("the vendor saw %d keys, want %d", len(seen), 2*n)
	}
}

// TestRepostDoesNotMoveThePlan: re-posting a per-account batch of 1,000
// calls that are all queued already leaves the account's plan where it
// was (the gate's planned time in Redis, read before and after): the
// account's real calls are not pushed back by calls never queued (G2).
func TestRepostDoesNotMoveThePlan(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	name := "plan-" + e.prefix[5:]
	e.vendors = append(e.vendors, Vendor{Endpoint: vendorclients.Endpoint{Name: name, BaseURL: "https://v.example/stores/{account}", Timeout: 5 * time.Second},
		Policy: shaper.Policy{Limits: []shaper.Limit{{Rate: 10, Window: time.Second}}}, PerAccount: true})
	c := e.newClient()
	rdb := e.rdb()
	ctx := context.Background()
	calls := func() []Call {
		out := make([]Call, 1000)
		for i := range out {
			out[i] = Call{Account: "store-1", ID: fmt.Sprintf("exp-%04d", i), Path: "/orders"}
		}
		return out
	}
	if res, err := c.EnqueueBatch(ctx, name, calls()); err != nil || res.Enqueued != 1000 {
		t.Fatalf("first post: %d queued (%v)", res.Enqueued, err)
	}
	gate := e.prefix + ":{" + name + "}:acct:store-1:gate"
	before, err := rdb.HGet(ctx, gate, "plan").Result()
	if err != nil {
		t.Fatalf("the account's plan after the first post: %v", err)
	}
	for post := range 2 {
		res, err := c.EnqueueBatch(ctx, name, calls())
		if err != nil || res.Enqueued != 0 || res.AlreadyQueued != 1000 {
			t.Fatalf("post %d again: %d queued, %d already (%v); want 0 and 1000", post+2, res.Enqueued, res.AlreadyQueued, err)
		}
		if after, err := rdb.HGet(ctx, gate, "plan").Result(); err != nil || after != before {
			t.Fatalf("post %d again moved the account's plan from %s to %s (%v)", post+2, before, after, err)
		}
	}
}

// TestQueueLimitHoldsUnderConcurrentEnqueues: 25 batches of 8 calls
// posted at the same moment to a vendor with queue_limit 40 (no worker;
// three rounds, a vendor each)
// leave at most 40 waiting; every batch is queued whole or refused with
// ErrQueueFull, and the refused ones are not in the queue.
func TestQueueLimitHoldsUnderConcurrentEnqueues(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	const limit, batches, size = 40, 25, 8
	var rooms []string
	for round := range 3 {
		rooms = append(rooms, e.vendor(fmt.Sprintf("room%d", round), policy(10), limit, http.NotFoundHandler()))
	}
	c := e.newClient()
	ctx := context.Background()
	for round, v := range rooms {
		var wg sync.WaitGroup
		var mu sync.Mutex
		queued, refused := 0, 0
		start := make(chan struct{})
		for b := range batches {
			wg.Add(1)
			go func() {
				defer wg.Done()
				calls := make([]Call, size)
				for i := range calls {
					calls[i] = Call{ID: fmt.Sprintf("r%d-b%d-%d", round, b, i), Path: "/r"}
				}
				<-start
				res, err := c.EnqueueBatch(ctx, v, calls)
				mu.Lock()
				defer mu.Unlock()
				switch {
				case err == nil && res.Enqueued == size:
					queued += size
				case errors.Is(err, ErrQueueFull) && res.Enqueued == 0:
					refused += size
				default:
					t.Errorf("batch %d: %d queued, %v; want all queued or ErrQueueFull", b, res.Enqueued, err)
				}
			}()
		}
		close(start)
		wg.Wait()
		waiting, err := c.Waiting(ctx, v)
		if err != nil {
			t.Fatal(err)
		}
		t.Logf("round %d: %d queued, %d refused, %d waiting", round, queued, refused, waiting)
		if waiting > limit || waiting != int64(queued) {
			t.Fatalf("round %d: %d waiting, %d answered queued; queue_limit %d", round, waiting, queued, limit)
		}
		if queued == 0 {
			t.Fatalf("round %d: nothing was queued", round)
		}
	}
}

// TestExplainAndCancelNameTheVendor: the same id on two vendors is two
// calls; Explain and Cancel by the id alone answer ErrAmbiguous naming
// both vendors (every time, not whichever a map reaches first), and act on
// the one named with ExplainVendor and CancelVendor.
func TestExplainAndCancelNameTheVendor(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	a := e.vendor("ambig-a", policy(10), 0, http.NotFoundHandler())
	b := e.vendor("ambig-b", policy(10), 0, http.NotFoundHandler())
	c := e.newClient()
	ctx := context.Background()
	for _, v := range []string{a, b} {
		if _, err := c.Enqueue(ctx, Call{Vendor: v, ID: "same", Path: "/s"}); err != nil {
			t.Fatalf("%s: %v", v, err)
		}
	}
	for range 5 {
		if _, err := c.Explain(ctx, "same"); !errors.Is(err, ErrAmbiguous) || !strings.Contains(err.Error(), a) || !strings.Contains(err.Error(), b) {
			t.Fatalf("Explain(same) = %v; want ErrAmbiguous naming %s and %s", err, a, b)
		}
		if _, err := c.Cancel(ctx, "same"); !errors.Is(err, ErrAmbiguous) {
			t.Fatalf("Cancel(same) = %v; want ErrAmbiguous", err)
		}
	}
	if ex, err := c.ExplainVendor(ctx, b, "same"); err != nil || ex.Vendor != b {
		t.Fatalf("ExplainVendor(%s, same) = %+v, %v", b, ex, err)
	}
	if got, err := c.CancelVendor(ctx, a, "same"); err != nil || got.Vendor != a {
		t.Fatalf("CancelVendor(%s, same) = %+v, %v", a, got, err)
	}
	if ex, err := c.Explain(ctx, "same"); err != nil || ex.Vendor != b {
		t.Errorf("Explain(same) once %s's is cancelled = %+v, %v; want %s's", a, ex, err, b)
	}
	if _, err := c.ExplainVendor(ctx, a, "same"); !errors.Is(err, ErrNoTask) {
		t.Errorf("ExplainVendor(%s, same) after its cancel = %v, want ErrNoTask", a, err)
	}
	// The cancelled id is free at once, in either lane.
	if _, err := c.Enqueue(ctx, Call{Vendor: a, ID: "same", Path: "/s", Priority: "high"}); err != nil {
		t.Errorf("same again on %s, high, after its cancel: %v", a, err)
	}
}

// failOn is a go-redis hook that fails the commands whose arguments name
// a key starting with prefix, once armed.
type failOn struct {
	prefix string
	armed  func() bool
}

func (failOn) DialHook(next redis.DialHook) redis.DialHook { return next }
func (f failOn) ProcessHook(next redis.ProcessHook) redis.ProcessHook {
	return func(ctx context.Context, cmd redis.Cmder) error {
		if f.hit(cmd) {
			err := errors.New("injected: connection reset")
			cmd.SetErr(err)
			return err
		}
		return next(ctx, cmd)
	}
}
func (f failOn) ProcessPipelineHook(next redis.ProcessPipelineHook) redis.ProcessPipelineHook {
	return func(ctx context.Context, cmds []redis.Cmder) error {
		for _, cmd := range cmds {
			if f.hit(cmd) {
				err := errors.New("injected: connection reset")
				cmd.SetErr(err)
				return err
			}
		}
		return next(ctx, cmds)
	}
}
func (f failOn) hit(cmd redis.Cmder) bool {
	if !f.armed() {
		return false
	}
	for _, a := range cmd.Args() {
		if s, ok := a.(string); ok && strings.HasPrefix(s, f.prefix) {
			return true
		}
	}
	return false
}

// TestEnqueueCallsSaysWhatItQueued: a request for two vendors whose
// second vendor's Redis writes fail (after the first vendor's calls and
// two of the second's are queued) answers with the error and, call by
// call, exactly what was queued: what it says queued is in the queue, and
// nothing else is.
func TestEnqueueCallsSaysWhatItQueued(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	a := e.vendor("part-a", policy(10), 100, http.NotFoundHandler())
	b := e.vendor("part-b", policy(10), 100, http.NotFoundHandler())
	rdb := e.rdb()
	var mu sync.Mutex
	queuedOnB := 0
	prefix := "asynq:{" + QueueName(b) + "}:"
	rdb.AddHook(failOn{prefix: prefix, armed: func() bool { mu.Lock(); defer mu.Unlock(); return queuedOnB >= 2 }})
	rdb.AddHook(countEnqueues{prefix: prefix, n: func() { mu.Lock(); queuedOnB++; mu.Unlock() }})
	c := NewClient(rdb, ClientConfig{Vendors: e.vendors, KeyPrefix: e.prefix})
	defer c.Close()
	calls := []Call{
		{Vendor: a, ID: "a1", Path: "/a"}, {Vendor: b, ID: "b1", Path: "/b"}, {Vendor: a, Path: "/a"},
		{Vendor: b, ID: "b2", Path: "/b"}, {Vendor: b, ID: "b3", Path: "/b"}, {Vendor: b, Path: "/b"},
	}
	res, err := c.EnqueueCalls(context.Background(), calls)
	if err == nil {
		t.Fatal("no error, with the second vendor's writes failing")
	}
	want := []string{StateQueued, StateQueued, StateQueued, StateQueued, StateNotQueued, StateNotQueued}
	for i, call := range res.Calls {
		if call.State != want[i] {
			t.Errorf("call %d: %s, want %s (%v)", i+1, call.State, want[i], call.Err)
		}
		if call.State == StateNotQueued && call.Err == nil {
			t.Errorf("call %d not queued, and no error says why", i+1)
		}
	}
	if res.Enqueued != 4 {
		t.Errorf("%d enqueued, want 4", res.Enqueued)
	}
	insp := asynq.NewInspectorFromRedisClient(e.rdb())
	for i, call := range res.Calls {
		if call.State != StateQueued {
			continue
		}
		if _, err := insp.GetTaskInfo(QueueName(calls[i].Vendor), call.ID); err != nil {
			t.Errorf("call %d answered queued as %s, but %s's queue does not hold it: %v", i+1, call.ID, calls[i].Vendor, err)
		}
	}
	plain := e.newClient()
	for _, v := range []string{a, b} {
		n, _ := plain.Waiting(context.Background(), v)
		if want := map[string]int64{a: 2, b: 2}[v]; n != want {
			t.Errorf("%s: %d waiting, want %d", v, n, want)
		}
	}
}

// countEnqueues counts asynq's enqueue scripts run on keys starting with
// prefix (that succeed).
type countEnqueues struct {
	prefix string
	n      func()
}

func (countEnqueues) DialHook(next redis.DialHook) redis.DialHook { return next }
func (h countEnqueues) ProcessHook(next redis.ProcessHook) redis.ProcessHook {
	return func(ctx context.Context, cmd redis.Cmder) error {
		err := next(ctx, cmd)
		args := cmd.Args()
		if err == nil && len(args) > 3 && (cmd.Name() == "evalsha" || cmd.Name() == "eval") {
			if s, ok := args[3].(string); ok && strings.HasPrefix(s, h.prefix+"t:") {
				h.n()
			}
		}
		return err
	}
}
func (h countEnqueues) ProcessPipelineHook(next redis.ProcessPipelineHook) redis.ProcessPipelineHook {
	return next
}

// TestIDFreeAfterItsCallIsDeleted: a call deleted outside shaper (from
// asynqmon, say) leaves its claim behind; posting the id again at once,
// in either lane, queues it without waiting for the claim to lapse.
func TestIDFreeAfterItsCallIsDeleted(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	v := e.vendor("deleted", policy(10), 0, http.NotFoundHandler())
	c := e.newClient()
	ctx := context.Background()
	insp := asynq.NewInspectorFromRedisClient(e.rdb())
	for _, prio := range []string{"normal", "high", "high", "normal"} {
		start := time.Now()
		id, err := c.Enqueue(ctx, Call{Vendor: v, ID: "gone", Path: "/g", Priority: prio})
		if err != nil || time.Since(start) > claimWait/2 {
			t.Fatalf("gone (%s) after its call was deleted: %q, %v, in %s", prio, id, err, time.Since(start).Round(time.Millisecond))
		}
		l, _ := ParseLane(prio)
		if err := insp.DeleteTask(laneQueue(v, l), "gone"); err != nil {
			t.Fatal(err)
		}
	}
}

// TestTaskIDNamesOneTaskAcrossLanes: a task of the user's own type
// queued with an id, then again with the same id in the high lane, is
// ErrDuplicate, and only its first lane holds it.
func TestTaskIDNamesOneTaskAcrossLanes(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	v := e.vendor("tasks", policy(10), 0, http.NotFoundHandler())
	c := e.newClient()
	ctx := context.Background()
	if _, err := c.EnqueueTask(ctx, Target{Vendor: v}, asynq.NewTask("export:page", nil), asynq.TaskID("page-1")); err != nil {
		t.Fatal(err)
	}
	if _, err := c.EnqueueTask(ctx, Target{Vendor: v}, asynq.NewTask("export:page", nil), asynq.TaskID("page-1"), Priority(shaper.High)); !errors.Is(err, ErrDuplicate) {
		t.Errorf("page-1 again in the high lane: %v, want ErrDuplicate", err)
	}
	if got := lanesHolding(t, e.rdb(), v, "page-1"); len(got) != 1 || got[0] != "normal" {
		t.Errorf("page-1 is in lanes %v, want [normal]", got)
	}
}

// TestClaimsAreLetGo: an enqueue leaves no claim behind (the calls hold
// their ids); a claim whose holder died is waited for (ErrInProgress,
// after claimWait) while it is young, and dropped once it is older than
// claimStale, the id then queued.
func TestClaimsAreLetGo(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	v := e.vendor("letgo", policy(10), 0, http.NotFoundHandler())
	c := e.newClient()
	rdb := e.rdb()
	ctx := context.Background()
	key := claimsKey(e.prefix, v)
	calls := make([]Call, 1500)
	for i := range calls {
		calls[i] = Call{ID: fmt.Sprintf("l-%04d", i), Path: "/l"}
	}
	if res, err := c.EnqueueBatch(ctx, v, calls); err != nil || res.Enqueued != len(calls) {
		t.Fatalf("%d queued, %v", res.Enqueued, err)
	}
	if n, err := rdb.ZCard(ctx, key).Result(); err != nil || n != 0 {
		t.Fatalf("%d claims left after the batch (%v), want 0", n, err)
	}
	now, err := rdb.Time(ctx).Result()
	if err != nil {
		t.Fatal(err)
	}
	ms := now.UnixMilli()
	rdb.ZAdd(ctx, key, redis.Z{Score: float64(ms*2 + 1), Member: "young"}, redis.Z{Score: float64((ms-claimStale.Milliseconds()-time.Second.Milliseconds())*2 + 1), Member: "old"})
	start := time.Now()
	if _, err := c.Enqueue(ctx, Call{Vendor: v, ID: "young", Path: "/y"}); !errors.Is(err, ErrInProgress) || time.Since(start) < claimWait {
		t.Errorf("an id a live claim holds: %v after %s, want ErrInProgress after %s", err, time.Since(start).Round(time.Millisecond), claimWait)
	}
	if _, err := c.Enqueue(ctx, Call{Vendor: v, ID: "old", Path: "/o"}); err != nil {
		t.Errorf("an id whose claim is older than %s: %v, want it queued", claimStale, err)
	}
	if got := lanesHolding(t, rdb, v, "old"); len(got) != 1 || got[0] != "normal" {
		t.Errorf("old is in lanes %v, want [normal]", got)
	}
}

// TestRoomReservation: room reserved by one enqueue counts for the next
// until it is released; a renewal keeps a live reservation and says when
// one has lapsed.
func TestRoomReservation(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	v := e.vendor("reserve", policy(10), 5, http.NotFoundHandler())
	c := e.newClient()
	ctx := context.Background()
	vend, _ := c.vendor(v)
	r1, err := c.reserve(ctx, vend, 3)
	if err != nil || r1 == nil {
		t.Fatalf("reserve 3 of 5: %v, %v", r1, err)
	}
	if _, err := c.reserve(ctx, vend, 3); !errors.Is(err, ErrQueueFull) || !strings.Contains(err.Error(), "3 being queued by other requests") {
		t.Errorf("reserve 3 more while 3 are held: %v, want ErrQueueFull naming the 3 held", err)
	}
	if err := c.renew(ctx, r1); err != nil {
		t.Errorf("renew a held reservation: %v", err)
	}
	c.release(ctx, r1)
	if err := c.renew(ctx, r1); err == nil {
		t.Error("renew a released reservation: no error")
	}
	r2, err := c.reserve(ctx, vend, 5)
	if err != nil {
		t.Fatalf("reserve 5 of 5 once released: %v", err)
	}
	c.release(ctx, r2)
}

// slowEnqueues is countEnqueues sleeping delay(n) after the n-th enqueue
// that succeeds (from 1): a busy Redis.
func slowEnqueues(prefix string, delay func(n int) time.Duration) countEnqueues {
	var n atomic.Int64
	return countEnqueues{prefix: prefix, n: func() { time.Sleep(delay(int(n.Add(1)))) }}
}

// slowBatch is a client of e whose enqueues on vendor v's queue rdb
// answers after delay(n) (see slowEnqueues), whose claims are safe for
// claimSafe and renewed every 200 ms, and a batch of n calls to it with
// the ids prefix-000, prefix-001, ….
func (e *env) slowBatch(t *testing.T, rdb *redis.Client, v string, delay func(n int) time.Duration, claimSafe time.Duration,
	prefix string, n int) (*Client, []Call) {
	rdb.AddHook(slowEnqueues("asynq:{"+QueueName(v)+"}:", delay))
	c := NewClient(rdb, ClientConfig{Vendors: e.vendors, KeyPrefix: e.prefix})
	t.Cleanup(func() { _ = c.Close() })
	c.claimSafe, c.renewEvery = claimSafe, 200*time.Millisecond
	calls := make([]Call, n)
	for i := range calls {
		calls[i] = Call{ID: fmt.Sprintf("%s-%03d", prefix, i), Path: "/" + prefix}
	}
	return c, calls
}

// TestSlowRedisSlowsABatchDown: a batch whose calls Redis queues slowly
// (30 ms each, 6 s for the chunk, over claimSafe) is queued whole: the
// enqueue renews the claims of the ids it has still to queue as it goes
// (the last id's is younger at the 180th call than at the first), and leaves none.
// CI once failed a 1,500-call enqueue on a loaded machine at claimSafe.
func TestSlowRedisSlowsABatchDown(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	v := e.vendor("slowredis", policy(10), 500, http.NotFoundHandler())
	rdb := e.rdb()
	key := claimsKey(e.prefix, v)
	reader := e.rdb()
	var renewed atomic.Bool
	var first float64
	delay := func(n int) time.Duration {
		ctx := context.Background()
		last, err := reader.ZScore(ctx, key, "s-199").Result() // the last id to be queued
		switch {
		case err != nil:
		case n == 1:
			first = last
		case n == 180 && last > first:
			renewed.Store(true)
		}
		return 30 * time.Millisecond
	}
	c, calls := e.slowBatch(t, rdb, v, delay, 5*time.Second, "s", 200)
	start := time.Now()
	res, err := c.EnqueueBatch(context.Background(), v, calls)
	if err != nil || res.Enqueued != len(calls) {
		t.Fatalf("%d of %d queued in %s: %v", res.Enqueued, len(calls), time.Since(start).Round(time.Millisecond), err)
	}
	if !renewed.Load() {
		t.Error("the last id's claim was as old at the 180th call as at the first: not renewed")
	}
	if n, err := rdb.ZCard(context.Background(), key).Result(); err != nil || n != 0 {
		t.Errorf("%d claims left after the batch (%v), want 0", n, err)
	}
}

// TestStalledRedisStopsABatch: a Redis that does not answer one enqueue
// for longer than claimSafe (the claims of the rest could lapse, and
// another request queue their ids in the other lane) stops the batch:
// the calls queued are said queued, the rest not queued with the reason,
// no claim is left, and posting the batch again queues the rest once.
func TestStalledRedisStopsABatch(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	v := e.vendor("stalled", policy(10), 0, http.NotFoundHandler())
	rdb := e.rdb()
	stall := func(n int) time.Duration {
		if n == 10 {
			return 4 * time.Second
		}
		return 0
	}
	c, calls := e.slowBatch(t, rdb, v, stall, 3*time.Second, "t", 30)
	ctx := context.Background()
	res, err := c.EnqueueBatch(ctx, v, calls)
	if err == nil || !strings.Contains(err.Error(), "could lapse") {
		t.Fatalf("a 4 s stall with claimSafe 3 s: %v, want the batch stopped", err)
	}
	if res.Enqueued != 10 {
		t.Errorf("%d queued, want the 10 up to the stall", res.Enqueued)
	}
	for i, call := range res.Calls {
		if want := i < 10; (call.State == StateQueued) != want || (call.State == StateNotQueued && call.Err == nil) {
			t.Errorf("call %d: %s (%v)", i, call.State, call.Err)
		}
	}
	if n, _ := rdb.ZCard(ctx, claimsKey(e.prefix, v)).Result(); n != 0 {
		t.Errorf("%d claims left after the stopped batch, want 0", n)
	}
	again, err := e.newClient().EnqueueBatch(ctx, v, calls)
	if err != nil || again.Enqueued != 20 || again.AlreadyQueued != 10 {
		t.Errorf("the batch again: %d queued, %d already (%v), want 20 and 10", again.Enqueued, again.AlreadyQueued, err)
	}
}
