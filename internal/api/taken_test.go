package api

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/hibiken/asynq"
	"github.com/redis/go-redis/v9"

	"github.com/shaper-dev/shaper/internal/redistest"
	"github.com/shaper-dev/shaper/queue"
	"github.com/shaper-dev/shaper/shaper"
	"github.com/shaper-dev/shaper/vendorclients"
)

// twoVendors is an API on a real Redis for two vendors (queue_limit
// limits[i]), no worker; before, when set, runs before every command of
// the API's Redis client and may fail it.
type twoVendors struct {
	url     string
	names   [2]string
	client  *queue.Client // the API's
	plain   *queue.Client // another client, on a Redis client of its own
	reqCtxs chan context.Context
}

func newTwoVendors(t *testing.T, limits [2]int, before func(cmd redis.Cmder) error) twoVendors {
	t.Helper()
	rdb := redistest.Client(t)
	if before != nil {
		rdb = redis.NewClient(&redis.Options{Addr: redistest.Addr(t)})
		t.Cleanup(func() { _ = rdb.Close() })
		rdb.AddHook(beforeHook(before))
	}
	prefix := redistest.Prefix(t)
	var s twoVendors
	var vends []queue.Vendor
	for i := range s.names {
		s.names[i] = fmt.Sprintf("api%d-%s", i, strings.ReplaceAll(prefix, ":", "-"))
		vends = append(vends, queue.Vendor{Endpoint: vendorclients.Endpoint{Name: s.names[i], BaseURL: "http://127.0.0.1:9", Timeout: time.Second},
			Policy: shaper.Policy{Limits: []shaper.Limit{{Rate: 10, Window: time.Second}}}, QueueLimit: limits[i]})
	}
	s.client = queue.NewClient(rdb, queue.ClientConfig{Vendors: vends, KeyPrefix: prefix})
	t.Cleanup(func() { _ = s.client.Close() })
	s.plain = queue.NewClient(redistest.Client(t), queue.ClientConfig{Vendors: vends, KeyPrefix: prefix})
	t.Cleanup(func() { _ = s.plain.Close() })
	s.reqCtxs = make(chan context.Context, 16)
	api := checkedByOpenAPI(t, New(Options{Client: s.client}))
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		s.reqCtxs <- r.Context()
		api.ServeHTTP(w, r)
	}))
	t.Cleanup(srv.Close)
	s.url = srv.URL
	return s
}

// beforeHook runs f before each command (alone or in a pipeline); an
// error from f fails the command.
type beforeHook func(cmd redis.Cmder) error

func (beforeHook) DialHook(next redis.DialHook) redis.DialHook { return next }
func (f beforeHook) ProcessHook(next redis.ProcessHook) redis.ProcessHook {
	return func(ctx context.Context, cmd redis.Cmder) error {
		if err := f(cmd); err != nil {
			cmd.SetErr(err)
			return err
		}
		return next(ctx, cmd)
	}
}
func (f beforeHook) ProcessPipelineHook(next redis.ProcessPipelineHook) redis.ProcessPipelineHook {
	return func(ctx context.Context, cmds []redis.Cmder) error {
		for _, cmd := range cmds {
			if err := f(cmd); err != nil {
				cmd.SetErr(err)
				return err
			}
		}
		return next(ctx, cmds)
	}
}

// enqueueOn says whether cmd is asynq's enqueue of a task into queue q.
func enqueueOn(cmd redis.Cmder, q string) bool {
	args := cmd.Args()
	if len(args) < 4 || (cmd.Name() != "evalsha" && cmd.Name() != "eval") {
		return false
	}
	key, _ := args[3].(string)
	return strings.HasPrefix(key, "asynq:{"+q+"}:t:")
}

// body is an NDJSON body: for each vendor index in at, a call to it with
// an id made of its line.
func (s twoVendors) body(at ...int) []byte {
	var b strings.Builder
	for line, v := range at {
		fmt.Fprintf(&b, `{"vendor":%q,"id":"L%d","path":"/x"}`+"\n", s.names[v], line+1)
	}
	return []byte(b.String())
}

// checkTaken checks that the answer's calls say exactly what is in the
// vendors' queues: a call said taken is there, under its id; a call
// said not queued is not.
func (s twoVendors) checkTaken(t *testing.T, a answer, at []int) Accepted {
	t.Helper()
	var acc Accepted
	if err := json.Unmarshal(a.body, &acc); err != nil || len(acc.Calls) != len(at) {
		t.Fatalf("%d %s: want an answer naming each of the %d calls (%v)", a.status, a.body, len(at), err)
	}
	insp := asynq.NewInspectorFromRedisClient(redistest.Client(t))
	for i, cs := range acc.Calls {
		_, err := insp.GetTaskInfo(queue.QueueName(s.names[at[i]]), fmt.Sprintf("L%d", i+1))
		there := err == nil
		if there != (cs.State != queue.StateNotQueued) || cs.Line != i+1 {
			t.Errorf("line %d: the answer says %+v, and the queue holds it: %v", i+1, cs, there)
		}
	}
	return acc
}

// TestPostSaysWhatItQueuedWhenRedisFails: a body of calls to two vendors,
// whose queueing fails at the second vendor's second call (its Redis
// write fails), answers 503 with each line's state: the first vendor's
// calls and the second's first are queued, and named so (ids), the rest
// are not, each with the error; what is in the queues is exactly that.
func TestPostSaysWhatItQueuedWhenRedisFails(t *testing.T) {
	var b0 atomic.Int32
	var s twoVendors
	s = newTwoVendors(t, [2]int{100, 100}, func(cmd redis.Cmder) error {
		if enqueueOn(cmd, queue.QueueName(s.names[1])) && b0.Add(1) == 2 {
			return errors.New("injected: connection reset by peer")
		}
		return nil
	})
	at := []int{0, 1, 0, 1, 1}
	a := do(t, "POST", s.url+"/v1/calls", "application/x-ndjson", "", s.body(at...))
	if a.status != http.StatusServiceUnavailable || a.header.Get("Retry-After") == "" {
		t.Fatalf("%d %s, want 503 with Retry-After", a.status, a.body)
	}
	acc := s.checkTaken(t, a, at)
	want := []string{queue.StateQueued, queue.StateQueued, queue.StateQueued, queue.StateNotQueued, queue.StateNotQueued}
	for i, cs := range acc.Calls {
		if cs.State != want[i] || (cs.State == queue.StateNotQueued) != (cs.Error != "") {
			t.Errorf("line %d: %+v, want %s (with an error when not queued)", i+1, cs, want[i])
		}
	}
	if acc.Enqueued != 3 || strings.Join(acc.IDs, ",") != "L1,L2,L3" || !strings.Contains(acc.Error, "injected") {
		t.Errorf("answer %s: want 3 enqueued, ids L1,L2,L3, and the error", a.body)
	}
}

// TestPostTakesTheBodyWholeWhenTheQueueFillsMeanwhile: while a body for
// two vendors is being queued (at its first call), another request fills
// the second vendor's queue. The body was given its room before anything
// was queued, so it is taken whole (202) and the other request is refused
// (its queue is full): never an answer of "nothing queued" while the
// first vendor's calls are.
func TestPostTakesTheBodyWholeWhenTheQueueFillsMeanwhile(t *testing.T) {
	var once sync.Once
	var s twoVendors
	var other error
	s = newTwoVendors(t, [2]int{100, 3}, func(cmd redis.Cmder) error {
		if enqueueOn(cmd, queue.QueueName(s.names[0])) {
			once.Do(func() {
				_, other = s.plain.EnqueueBatch(context.Background(), s.names[1], []queue.Call{{ID: "o1", Path: "/o"}, {ID: "o2", Path: "/o"}})
			})
		}
		return nil
	})
	at := []int{0, 0, 1, 1}
	a := do(t, "POST", s.url+"/v1/calls", "application/x-ndjson", "", s.body(at...))
	acc := s.checkTaken(t, a, at)
	if a.status != http.StatusAccepted || acc.Enqueued != 4 {
		t.Errorf("%d %s, want 202 with the 4 calls queued", a.status, a.body)
	}
	if !errors.Is(other, queue.ErrQueueFull) {
		t.Errorf("the request that came meanwhile: %v, want ErrQueueFull (the body held the room)", other)
	}
	if n, _ := s.plain.Waiting(context.Background(), s.names[1]); n > 3 {
		t.Errorf("%d waiting on a vendor with queue_limit 3", n)
	}
}

// TestPostGoesOnWhenTheClientLeaves: a client that goes away while its
// body is being queued (the server's request context is done before the
// second call is queued) does not leave the body half queued: every call
// is queued.
func TestPostGoesOnWhenTheClientLeaves(t *testing.T) {
	var s twoVendors
	var n atomic.Int32
	leave := make(chan struct{})
	s = newTwoVendors(t, [2]int{100, 100}, func(cmd redis.Cmder) error {
		if enqueueOn(cmd, queue.QueueName(s.names[0])) && n.Add(1) == 2 {
			close(leave)
			reqCtx := <-s.reqCtxs
			select {
			case <-reqCtx.Done():
			case <-time.After(10 * time.Second):
				return errors.New("the server did not see the client leave in 10 s")
			}
		}
		return nil
	})
	at := []int{0, 0, 0, 1}
	ctx, cancel := context.WithCancel(context.Background())
	req, _ := http.NewRequestWithContext(ctx, "POST", s.url+"/v1/calls", strings.NewReader(string(s.body(at...))))
	req.Header.Set("Content-Type", "application/x-ndjson")
	go func() { <-leave; cancel() }()
	if resp, err := http.DefaultClient.Do(req); err == nil {
		resp.Body.Close()
		t.Fatalf("the client's request ended with %d; it should have been cancelled", resp.StatusCode)
	}
	insp := asynq.NewInspectorFromRedisClient(redistest.Client(t))
	deadline := time.Now().Add(10 * time.Second)
	for i, v := range at {
		id := fmt.Sprintf("L%d", i+1)
		for {
			if _, err := insp.GetTaskInfo(queue.QueueName(s.names[v]), id); err == nil {
				break
			}
			if time.Now().After(deadline) {
				t.Fatalf("call %s is not queued 10 s after its client left: the body was left half queued", id)
			}
			time.Sleep(20 * time.Millisecond)
		}
	}
}

// TestGetAndDeleteNameTheVendor: an id that calls of two vendors carry
// is ambiguous for GET and DELETE (409 naming both vendors) until
// ?vendor= names one; an unknown ?vendor= is 400. A call posted again
// with the other priority answers with the call already queued.
func TestGetAndDeleteNameTheVendor(t *testing.T) {
	s := newTwoVendors(t, [2]int{100, 100}, nil)
	for _, v := range s.names {
		body := fmt.Sprintf(`{"vendor":%q,"id":"twice","path":"/x"}`, v)
		if a := do(t, "POST", s.url+"/v1/calls", "application/json", "", []byte(body)); a.status != http.StatusAccepted {
			t.Fatalf("POST on %s: %d %s", v, a.status, a.body)
		}
	}
	again := fmt.Sprintf(`{"vendor":%q,"id":"twice","path":"/x","priority":"high"}`, s.names[0])
	a := do(t, "POST", s.url+"/v1/calls", "application/json", "", []byte(again))
	var acc Accepted
	if err := json.Unmarshal(a.body, &acc); a.status != http.StatusAccepted || err != nil || acc.AlreadyQueued != 1 || len(acc.Calls) != 1 ||
		acc.Calls[0].State != queue.StateAlreadyQueued || acc.Calls[0].Lane != "normal" {
		t.Errorf("POST again with priority high: %d %s, want 202, already queued in the normal lane", a.status, a.body)
	}
	for _, method := range []string{"GET", "DELETE"} {
		a := do(t, method, s.url+"/v1/calls/twice", "", "", nil)
		if a.status != http.StatusConflict || !strings.Contains(string(a.body), s.names[0]) || !strings.Contains(string(a.body), s.names[1]) {
			t.Errorf("%s twice: %d %s, want 409 naming both vendors", method, a.status, a.body)
		}
		if a := do(t, method, s.url+"/v1/calls/twice?vendor=nope", "", "", nil); a.status != http.StatusBadRequest {
			t.Errorf("%s twice?vendor=nope: %d %s, want 400", method, a.status, a.body)
		}
	}
	a = do(t, "GET", s.url+"/v1/calls/twice?vendor="+s.names[1], "", "", nil)
	var e queue.Explanation
	if err := json.Unmarshal(a.body, &e); a.status != http.StatusOK || err != nil || e.Vendor != s.names[1] {
		t.Errorf("GET twice?vendor=%s: %d %s", s.names[1], a.status, a.body)
	}
	a = do(t, "DELETE", s.url+"/v1/calls/twice?vendor="+s.names[0], "", "", nil)
	var c Cancelled
	if err := json.Unmarshal(a.body, &c); a.status != http.StatusOK || err != nil || c.Vendor != s.names[0] {
		t.Errorf("DELETE twice?vendor=%s: %d %s", s.names[0], a.status, a.body)
	}
	if a := do(t, "GET", s.url+"/v1/calls/twice", "", "", nil); a.status != http.StatusOK || !strings.Contains(string(a.body), s.names[1]) {
		t.Errorf("GET twice once one is cancelled: %d %s, want the other vendor's call", a.status, a.body)
	}
}

// TestPostRefusedWholeWhenAVendorIsFull: a body for two vendors whose
// second vendor's queue has no room for its calls is refused whole (429,
// Retry-After, every line not queued, the error naming the vendor), and
// nothing of it is queued, the first vendor's calls included.
func TestPostRefusedWholeWhenAVendorIsFull(t *testing.T) {
	s := newTwoVendors(t, [2]int{100, 3}, nil)
	if _, err := s.plain.EnqueueBatch(context.Background(), s.names[1], []queue.Call{{ID: "f1", Path: "/f"}, {ID: "f2", Path: "/f"}}); err != nil {
		t.Fatal(err)
	}
	at := []int{0, 0, 1, 1}
	a := do(t, "POST", s.url+"/v1/calls", "application/x-ndjson", "", s.body(at...))
	acc := s.checkTaken(t, a, at)
	if a.status != http.StatusTooManyRequests || a.header.Get("Retry-After") == "" || !strings.Contains(acc.Error, s.names[1]) || acc.Enqueued != 0 {
		t.Errorf("%d %s, want 429 with Retry-After naming %s, nothing queued", a.status, a.body, s.names[1])
	}
	for _, cs := range acc.Calls {
		if cs.State != queue.StateNotQueued || cs.Error == "" {
			t.Errorf("line %d: %+v, want not queued, with the error", cs.Line, cs)
		}
	}
}
