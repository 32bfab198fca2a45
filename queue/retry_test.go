package queue

import (
	"context"
	"encoding/json"
	"fmt"
	"net/http"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/hibiken/asynq"

	"github.com/shaper-dev/shaper/shaper"
	"github.com/shaper-dev/shaper/vendorclients"
)

// answer is one scripted answer of a scriptedVendor.
type answer struct {
	status     int
	retryAfter string
}

// scriptedVendor answers its requests with its script, in order, then
// 200; it records each answer's status and Idempotency-Key.
type scriptedVendor struct {
	mu     sync.Mutex
	script []answer
	got    []answer // status, and the key in retryAfter's place
}

func (v *scriptedVendor) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	v.mu.Lock()
	a := answer{status: http.StatusOK}
	if n := len(v.got); n < len(v.script) {
		a = v.script[n]
	}
	v.got = append(v.got, answer{status: a.status, retryAfter: r.Header.Get("Idempotency-Key")})
	v.mu.Unlock()
	if a.retryAfter != "" {
		w.Header().Set("Retry-After", a.retryAfter)
	}
	w.WriteHeader(a.status)
}

// succeeded reports whether the vendor answered 2xx to a request with key.
func (v *scriptedVendor) succeeded(key string) bool {
	v.mu.Lock()
	defer v.mu.Unlock()
	for _, a := range v.got {
		if a.status == http.StatusOK && a.retryAfter == key {
			return true
		}
	}
	return false
}

// TestWaitOnTheLastRetryIsNotArchived: a call (or a task of the user's
// own type) that meets a 429 or a long wait on its last attempt, after its
// real failures, goes on waiting and reaches the vendor (G6: a wait never
// archives a call, on any attempt); a failure past the budget is still
// archived with its error. asynq archives any error once Retried reaches
// MaxRetry, so without the retry headroom (or the wait in place for tasks
// without it) each of these was archived unsent.
func TestWaitOnTheLastRetryIsNotArchived(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	p := shaper.Policy{Limits: []shaper.Limit{{Rate: 20, Window: time.Second}}}
	fail := answer{status: http.StatusInternalServerError}
	long := answer{status: http.StatusTooManyRequests, retryAfter: "5"} // beyond MaxWait (3 s): sent back to the queue
	short := answer{status: http.StatusTooManyRequests, retryAfter: "1"}
	cases := []struct {
		name    string
		script  []answer
		enqueue func(c *Client, ac *asynq.Client, vendor, id string) error
		spent   bool // archived after its one retry
	}{
		{"call: 500, then a long wait on its last retry", []answer{fail, long}, enqueueCall, false},
		{"call: 500, then 429s (Retry-After: 1) past its tries in place on its last retry", append([]answer{fail}, slices.Repeat([]answer{short}, 10)...), enqueueCall, false},
		{"call with MaxRetry(0): a long wait", []answer{long}, func(c *Client, _ *asynq.Client, vendor, id string) error {
			_, err := c.EnqueueTask(context.Background(), Target{Vendor: vendor}, callTask(vendor, id), asynq.TaskID(id), asynq.MaxRetry(0))
			return err
		}, false},
		{"call queued without headroom (MaxRetry(0), no budget header): a long wait", []answer{long}, func(c *Client, ac *asynq.Client, vendor, id string) error {
			_, err := ac.Enqueue(callTask(vendor, id), asynq.Queue(QueueName(vendor)), asynq.TaskID(id), asynq.MaxRetry(0), asynq.Retention(time.Hour))
			c.signal(context.Background(), vendor) // as Client's enqueue does
			return err
		}, false},
		{"user task with shaper's headers: 500, then a 429 on its last retry", []answer{fail, short}, func(c *Client, _ *asynq.Client, vendor, id string) error {
			_, err := c.EnqueueTask(context.Background(), Target{Vendor: vendor}, asynq.NewTask("test:get", []byte(id)), asynq.TaskID(id), Priority(shaper.High))
			return err
		}, false},
		{"bare user task: 500, then a 429 on its last retry", []answer{fail, short}, func(c *Client, _ *asynq.Client, vendor, id string) error {
			_, err := c.EnqueueTask(context.Background(), Target{Vendor: vendor}, asynq.NewTask("test:get", []byte(id)), asynq.TaskID(id))
			return err
		}, false},
		{"call: 500 twice spends its one retry", []answer{fail, fail}, enqueueCall, true},
	}
	vendors := make([]*scriptedVendor, len(cases))
	names := make([]string, len(cases))
	for i, tc := range cases {
		vendors[i] = &scriptedVendor{script: tc.script}
		names[i] = e.vendor(fmt.Sprintf("last%d", i), p, 0, vendors[i])
	}
	c := NewClient(e.rdb(), ClientConfig{Vendors: e.vendors, KeyPrefix: e.prefix, MaxRetry: 1})
	t.Cleanup(func() { _ = c.Close() })
	ac := asynq.NewClientFromRedisClient(e.rdb())
	e.startWorker(func(w *Worker) {
		if err := w.Handle("test:get", func(ctx context.Context, task *asynq.Task, vendor *vendorclients.Client) error {
			req, err := vendor.NewRequest(ctx, http.MethodGet, "/things", nil)
			if err != nil {
				return err
			}
			req.Header.Set("Idempotency-Key", string(task.Payload()))
			resp, err := vendor.Do(req)
			if err != nil {
				return err
			}
			resp.Body.Close()
			if resp.StatusCode >= 500 {
				return fmt.Errorf("HTTP %d", resp.StatusCode)
			}
			return nil
		}); err != nil {
			t.Fatal(err)
		}
	})
	insp := asynq.NewInspectorFromRedisClient(e.rdb())
	for i, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			id := fmt.Sprintf("last-%d", i)
			if err := tc.enqueue(c, ac, names[i], id); err != nil {
				t.Fatal(err)
			}
			want := asynq.TaskStateCompleted
			if tc.spent {
				want = asynq.TaskStateArchived
			}
			var info *asynq.TaskInfo
			waitFor(t, time.Minute, "the task to end", func() bool {
				var err error
				info, err = taskInfo(insp, names[i], id)
				return err == nil && (info.State == asynq.TaskStateCompleted || info.State == asynq.TaskStateArchived)
			})
			if info.State != want {
				t.Fatalf("state %s after %d retries (last error %q), want %s", info.State, info.Retried, info.LastErr, want)
			}
			if tc.spent {
				if info.Retried != 1 || !strings.Contains(info.LastErr, "HTTP 500") {
					t.Errorf("archived after %d retries with %q, want 1 retry and the vendor's HTTP 500", info.Retried, info.LastErr)
				}
				return
			}
			if !vendors[i].succeeded(id) {
				t.Errorf("the vendor never answered 2xx to %s: %+v", id, vendors[i].got)
			}
		})
	}
}

func enqueueCall(c *Client, _ *asynq.Client, vendor, id string) error {
	_, err := c.Enqueue(context.Background(), Call{Vendor: vendor, ID: id, Path: "/things"})
	return err
}

// callTask is the task of a GET /things call to vendor with id.
func callTask(vendor, id string) *asynq.Task {
	payload, _ := json.Marshal(Call{Vendor: vendor, ID: id, Method: http.MethodGet, Path: "/things"})
	return asynq.NewTask(TypeCall, payload)
}

// taskInfo reads a task of the vendor's normal or high lane.
func taskInfo(insp *asynq.Inspector, vendor, id string) (*asynq.TaskInfo, error) {
	info, err := insp.GetTaskInfo(QueueName(vendor), id)
	if err != nil {
		info, err = insp.GetTaskInfo(HighQueueName(vendor), id)
	}
	return info, err
}

// TestExplainSaysTheRetryBudget: explain counts a failed call's retries
// against the budget it was queued with, not asynq's MaxRetry (the
// budget plus the headroom).
func TestExplainSaysTheRetryBudget(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	name := e.vendor("budget", shaper.Policy{Limits: []shaper.Limit{{Rate: 20, Window: time.Second}}}, 0,
		&scriptedVendor{script: []answer{{status: http.StatusInternalServerError}}})
	c := NewClient(e.rdb(), ClientConfig{Vendors: e.vendors, KeyPrefix: e.prefix, MaxRetry: 2})
	t.Cleanup(func() { _ = c.Close() })
	id, err := c.Enqueue(context.Background(), Call{Vendor: name, ID: "budget-1", Path: "/things"})
	if err != nil {
		t.Fatal(err)
	}
	e.startWorker(func(w *Worker) { w.cfg.RetryBackoff = func(int) time.Duration { return time.Hour } })
	var ex Explanation
	waitFor(t, 30*time.Second, "the call's first failure", func() bool {
		ex, err = c.Explain(context.Background(), id)
		return err == nil && ex.Binding == BindRetry
	})
	if !strings.Contains(ex.Reason, "retry 1 of 2 at") {
		t.Errorf("explain: %q, want retry 1 of 2", ex.Reason)
	}
}
