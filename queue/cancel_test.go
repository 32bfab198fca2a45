package queue

import (
	"context"
	"errors"
	"fmt"
	"net/http"
	"slices"
	"sync"
	"testing"
	"time"

	"github.com/hibiken/asynq"

	"github.com/shaper-dev/shaper/shaper"
)

// TestCancel: a call that has not started (pending in either lane,
// scheduled, waiting for a retry) is cancelled and gone; a call a worker
// holds is ErrStarted; a completed or archived one is ErrFinished; an
// unknown id is ErrNoTask. The worker is a bare asynq server on the
// vendor's queue whose handler does what each task's id says.
func TestCancel(t *testing.T) {
	e := newEnv(t)
	v := e.vendor("cancel", shaper.Policy{Limits: []shaper.Limit{{Rate: 10, Window: time.Second}}}, 0, http.NotFoundHandler())
	c := e.newClient()
	ctx := context.Background()
	for _, call := range []Call{{ID: "pending"}, {ID: "high", Priority: "high"}, {ID: "hold"}, {ID: "fail"}, {ID: "skip"}, {ID: "done"}} {
		call.Vendor, call.Path = v, "/x"
		if _, err := c.Enqueue(ctx, call); err != nil {
			t.Fatal(err)
		}
	}
	if _, err := c.EnqueueTask(ctx, Target{Vendor: v}, asynq.NewTask("later", nil), asynq.TaskID("scheduled"), asynq.ProcessIn(time.Hour)); err != nil {
		t.Fatal(err)
	}
	// Cancel the two that stay pending before the server starts.
	for _, want := range []Cancellation{{TaskID: "pending", Vendor: v, Lane: "normal", State: "pending"}, {TaskID: "high", Vendor: v, Lane: "high", State: "pending"}} {
		got, err := c.Cancel(ctx, want.TaskID)
		if err != nil || got != want {
			t.Fatalf("Cancel(%s) = %+v, %v; want %+v", want.TaskID, got, err, want)
		}
	}
	release := make(chan struct{})
	srv := asynq.NewServerFromRedisClient(e.rdb(), asynq.Config{Concurrency: 4, Queues: map[string]int{QueueName(v): 1}, LogLevel: asynq.FatalLevel,
		RetryDelayFunc: func(int, error, *asynq.Task) time.Duration { return time.Hour }})
	err := srv.Start(asynq.HandlerFunc(func(ctx context.Context, task *asynq.Task) error {
		switch id := task.ResultWriter().TaskID(); id {
		case "hold":
			<-release
		case "fail":
			return errors.New("HTTP 503")
		case "skip":
			return fmt.Errorf("HTTP 400: %w", asynq.SkipRetry)
		}
		return nil
	}))
	if err != nil {
		t.Fatal(err)
	}
	defer srv.Shutdown()
	insp := asynq.NewInspectorFromRedisClient(e.rdb())
	stateOf := func(id string) asynq.TaskState {
		info, err := insp.GetTaskInfo(QueueName(v), id)
		if err != nil {
			return 0
		}
		return info.State
	}
	waitFor(t, 30*time.Second, "the server to take every call", func() bool {
		return stateOf("hold") == asynq.TaskStateActive && stateOf("fail") == asynq.TaskStateRetry &&
			stateOf("skip") == asynq.TaskStateArchived && stateOf("done") == asynq.TaskStateCompleted
	})
	for _, tc := range []struct {
		id   string
		want error
	}{
		{"hold", ErrStarted}, {"done", ErrFinished}, {"skip", ErrFinished}, {"pending", ErrNoTask}, {"never-queued", ErrNoTask},
	} {
		if _, err := c.Cancel(ctx, tc.id); !errors.Is(err, tc.want) {
			t.Errorf("Cancel(%s) = %v, want %v", tc.id, err, tc.want)
		}
	}
	for _, want := range []Cancellation{
		{TaskID: "fail", Vendor: v, Lane: "normal", State: "retry", Retried: 1},
		{TaskID: "scheduled", Vendor: v, Lane: "normal", State: "scheduled"},
	} {
		got, err := c.Cancel(ctx, want.TaskID)
		if err != nil || got != want {
			t.Errorf("Cancel(%s) = %+v, %v; want %+v", want.TaskID, got, err, want)
		}
		if _, err := c.Explain(ctx, want.TaskID); !errors.Is(err, ErrNoTask) {
			t.Errorf("Explain(%s) after Cancel: %v, want ErrNoTask", want.TaskID, err)
		}
	}
	close(release)
	waitFor(t, 30*time.Second, "the held call to complete", func() bool { return stateOf("hold") == asynq.TaskStateCompleted })
	if _, err := c.Cancel(ctx, "hold"); !errors.Is(err, ErrFinished) {
		t.Errorf("Cancel(hold) once completed = %v, want ErrFinished", err)
	}
	if n, err := c.Waiting(ctx, v); err != nil || n != 0 {
		t.Errorf("%d calls waiting (%v), want 0", n, err)
	}
}

// TestCancelExportCall: a cancelled call of an export counts as failed
// in its progress, so that the export finishes.
func TestCancelExportCall(t *testing.T) {
	e := newEnv(t)
	v := e.vendor("cancelexp", shaper.Policy{Limits: []shaper.Limit{{Rate: 10, Window: time.Second}}}, 0, http.NotFoundHandler())
	c := e.newClient()
	ctx := context.Background()
	calls := []Call{{ID: v + "-a", Path: "/a"}, {ID: v + "-b", Path: "/b"}}
	exp, _, err := c.StartExport(ctx, "", v, calls)
	if err != nil {
		t.Fatal(err)
	}
	got, err := c.Cancel(ctx, v+"-a")
	if err != nil || got.Export != exp.ID {
		t.Fatalf("Cancel = %+v, %v; want it to name export %s", got, err, exp.ID)
	}
	st, err := c.ExportStatus(ctx, exp.ID)
	if err != nil || st.Total != 2 || st.Failed != 1 || st.Done != 0 {
		t.Fatalf("export after a cancel: %+v, %v; want 2 calls, 1 failed", st, err)
	}
}

// TestCancelRacesTheWorker: cancels that race a worker taking the same
// calls: every call either is cancelled and never reaches the vendor, or
// is refused (started, finished) and reaches it once.
func TestCancelRacesTheWorker(t *testing.T) {
	e := newEnv(t)
	var mu sync.Mutex
	seen := map[string]int{}
	v := e.vendor("cancelrace", shaper.Policy{Limits: []shaper.Limit{{Rate: 500, Window: time.Second}}}, 0,
		http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			mu.Lock()
			seen[r.Header.Get("Idempotency-Key")]++
			mu.Unlock()
		}))
	c := e.newClient()
	ids := enqueueN(t, c, v, 300)
	e.startWorker(nil)
	slices.Reverse(ids)
	var cancelled, refused []string
	var wg sync.WaitGroup
	var rmu sync.Mutex
	work := make(chan string)
	for range 8 {
		wg.Go(func() {
			for id := range work {
				_, err := c.Cancel(context.Background(), id)
				rmu.Lock()
				switch {
				case err == nil:
					cancelled = append(cancelled, id)
				case errors.Is(err, ErrStarted) || errors.Is(err, ErrFinished):
					refused = append(refused, id)
				default:
					t.Errorf("Cancel(%s): %v", id, err)
				}
				rmu.Unlock()
			}
		})
	}
	for _, id := range ids {
		work <- id
	}
	close(work)
	wg.Wait()
	t.Logf("%d cancelled, %d had started or finished", len(cancelled), len(refused))
	waitFor(t, 30*time.Second, "the calls that were not cancelled to reach the vendor", func() bool {
		mu.Lock()
		defer mu.Unlock()
		for _, id := range refused {
			if seen[id] == 0 {
				return false
			}
		}
		return true
	})
	waitFor(t, 30*time.Second, "the queue to empty", func() bool { n, err := c.Waiting(context.Background(), v); return err == nil && n == 0 })
	mu.Lock()
	defer mu.Unlock()
	for _, id := range cancelled {
		if seen[id] != 0 {
			t.Errorf("cancelled call %s reached the vendor %d times", id, seen[id])
		}
	}
	for _, id := range refused {
		if seen[id] != 1 {
			t.Errorf("call %s reached the vendor %d times, want once", id, seen[id])
		}
	}
	if len(seen) != len(refused) {
		t.Errorf("the vendor saw %d calls, want the %d not cancelled", len(seen), len(refused))
	}
}
