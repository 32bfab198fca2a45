package queue

import (
	"bytes"
	"context"
	"errors"
	"log/slog"
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/hibiken/asynq"

	"github.com/shaper-dev/shaper/internal/logtest"
	"github.com/shaper-dev/shaper/internal/vendorsim"
	"github.com/shaper-dev/shaper/shaper"
	"github.com/shaper-dev/shaper/vendorclients"
)

func policy(rate int) shaper.Policy {
	return shaper.Policy{Limits: []shaper.Limit{{Rate: rate, Window: time.Second}}}
}

// TestHandleServesVendorsAddedByApply registers a user task type while
// the worker runs, then adds a vendor by Apply (a reload): the new vendor's
// tasks of that type must reach the handler, through the new vendor's
// client. (Before, Handle took a vendor, touched the maps without the
// lock, and a vendor added by a reload got an empty handler map.)
func TestHandleServesVendorsAddedByApply(t *testing.T) {
	e := newEnv(t)
	e.vendor("first", policy(50), 0, &vendorsim.Mock{Rate: 50, Window: time.Second})
	var w *Worker
	e.startWorker(func(x *Worker) { w = x })
	got := make(chan string, 1)
	err := w.Handle("test:ping", func(ctx context.Context, _ *asynq.Task, vendor *vendorclients.Client) error {
		req, err := vendor.NewRequest(ctx, http.MethodGet, "/ping", nil)
		if err != nil {
			return err
		}
		resp, err := vendor.Do(req)
		if err != nil {
			return err
		}
		resp.Body.Close()
		got <- vendor.Vendor().Name
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	added := e.vendor("added", policy(50), 0, &vendorsim.Mock{Rate: 50, Window: time.Second})
	notes, err := w.Apply(e.vendors)
	if err != nil {
		t.Fatal(err)
	}
	t.Logf("apply: %v", notes)
	if _, err := e.newClient().EnqueueTask(context.Background(), Target{Vendor: added}, asynq.NewTask("test:ping", nil)); err != nil {
		t.Fatal(err)
	}
	select {
	case name := <-got:
		if name != added {
			t.Errorf("handled through vendor %s, want %s", name, added)
		}
	case <-time.After(30 * time.Second):
		t.Fatal("the task on the vendor added by Apply was never handled")
	}
}

// TestApplyChecksEverythingFirst gives Apply a changed rate and an added
// vendor that cannot be built: it must fail and change nothing, before
// and while the worker runs.
func TestApplyChecksEverythingFirst(t *testing.T) {
	e := newEnv(t)
	name := e.vendor("kept", policy(50), 0, &vendorsim.Mock{Rate: 50, Window: time.Second})
	changed := e.vendors[0]
	changed.Policy = policy(10)
	bad := Vendor{Endpoint: vendorclients.Endpoint{Name: "bad-" + e.prefix[5:], BaseURL: "ftp://nowhere"}, Policy: policy(5)}
	check := func(w *Worker, when string) {
		t.Helper()
		if _, err := w.Apply([]Vendor{changed, bad}); err == nil {
			t.Fatalf("%s: Apply accepted a vendor with base_url ftp://nowhere", when)
		}
		bs := w.Buckets()
		if len(bs) != 1 || bs[name].Policy().Limits[0].Rate != 50 {
			t.Errorf("%s: a failed Apply changed the worker: buckets %v, rate %d", when, len(bs), bs[name].Policy().Limits[0].Rate)
		}
	}
	var w *Worker
	e.startWorker(func(x *Worker) { w = x; check(x, "before Run") })
	check(w, "while running")
}

// TestApplyAfterRun: once Run has returned, Apply says so (before, it
// started goroutines on a WaitGroup that had already been waited on), and
// a second Run is refused.
func TestApplyAfterRun(t *testing.T) {
	e := newEnv(t)
	e.vendor("gone", policy(50), 0, &vendorsim.Mock{Rate: 50, Window: time.Second})
	w, err := NewWorker(e.rdb(), WorkerConfig{Vendors: e.vendors, KeyPrefix: e.prefix, Logger: slog.New(slog.NewTextHandler(testWriter{t}, nil))})
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- w.Run(ctx) }()
	waitFor(t, 10*time.Second, "the worker to serve", func() bool {
		_, err := w.Apply(e.vendors)
		return err == nil
	})
	cancel()
	if err := <-done; err != nil {
		t.Fatal(err)
	}
	added := append(e.vendors, Vendor{Endpoint: vendorclients.Endpoint{Name: "late-" + e.prefix[5:], BaseURL: "http://127.0.0.1:1"}, Policy: policy(5)})
	if _, err := w.Apply(added); !errors.Is(err, ErrStopped) {
		t.Errorf("Apply after Run returned: err = %v, want ErrStopped", err)
	}
	if err := w.Run(context.Background()); !errors.Is(err, ErrStopped) {
		t.Errorf("second Run: err = %v, want ErrStopped", err)
	}
}

// TestLogSaysBacklogNotPause queues more calls than max_wait covers on a
// vendor that never answers 429: the worker pauses the vendor's asynq
// queue and must say it is backlogged, never that the vendor paused.
func TestLogSaysBacklogNotPause(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	vendor := &vendorsim.Mock{Rate: 5, Window: time.Second}
	name := e.vendor("backlog", policy(5), 0, vendor)
	logs := &logtest.Buffer{}
	w, err := NewWorker(e.rdb(), WorkerConfig{Vendors: e.vendors, KeyPrefix: e.prefix, MaxWait: time.Second,
		Logger: slog.New(slog.NewTextHandler(logs, nil))})
	if err != nil {
		t.Fatal(err)
	}
	enqueueN(t, e.newClient(), name, 30)
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- w.Run(ctx) }()
	waitFor(t, 20*time.Second, "the queue to be paused for the backlog", func() bool {
		return strings.Contains(logs.String(), "vendor backlogged")
	})
	// The queue is paused and unpaused many times while the backlog
	// drains: each of those is a debug line, not an info one.
	waitFor(t, 60*time.Second, "the backlog to drain", func() bool { return vendor.Summarize().DistinctKeys >= 30 })
	cancel()
	if err := <-done; err != nil {
		t.Fatal(err)
	}
	if s := vendor.Summarize(); s.RateLimited > 0 {
		t.Fatalf("the vendor answered %d 429s; this test needs none", s.RateLimited)
	}
	if strings.Contains(logs.String(), "vendor paused") {
		t.Errorf("the log says the vendor paused, and it never did:\n%s", logs.String())
	}
	if strings.Contains(logs.String(), "queue is unpaused") || strings.Contains(logs.String(), "queue is paused\"") {
		t.Errorf("each pause and unpause of the queue is logged at info level:\n%s", logs.String())
	}
	t.Logf("the backlog's lines:\n%s", logs.String())
}

func TestProblemLogSaysItOnce(t *testing.T) {
	var buf bytes.Buffer
	p := newProblemLog(slog.New(slog.NewTextHandler(&buf, nil)), nil)
	boom := errors.New("connection refused")
	for range 5 {
		p.check("gate heartbeat", boom)
	}
	p.check("gate heartbeat", nil)
	p.check("gate heartbeat", nil)
	out := buf.String()
	if n := strings.Count(out, "gate heartbeat failed"); n != 1 {
		t.Errorf("5 failures logged %d times, want once:\n%s", n, out)
	}
	if n := strings.Count(out, "gate heartbeat works again"); n != 1 {
		t.Errorf("recovery logged %d times, want once:\n%s", n, out)
	}
}

// TestEnqueueErrorsKeepTheirChain: a bad path is both ErrBadCall and
// vendorclients.ErrBadPath (a %v once lost the second).
func TestEnqueueErrorsKeepTheirChain(t *testing.T) {
	e := newEnv(t)
	name := e.vendor("chain", policy(5), 0, &vendorsim.Mock{Rate: 5, Window: time.Second})
	_, err := e.newClient().Enqueue(context.Background(), Call{Vendor: name, Path: "/a/../../admin"})
	if !errors.Is(err, ErrBadCall) || !errors.Is(err, vendorclients.ErrBadPath) {
		t.Errorf("err = %v: want both ErrBadCall and vendorclients.ErrBadPath", err)
	}
}

// TestQueueStatsMatchesAsynq pins the queue-stats reader, which reads
// asynq's keys directly (one round trip, where Inspector.GetQueueInfo
// also samples memory), to what asynq's own Inspector says, for tasks in
// every state. It fails when asynq changes its key layout.
func TestQueueStatsMatchesAsynq(t *testing.T) {
	e := newEnv(t)
	name := e.vendor("pinned", policy(5), 0, &vendorsim.Mock{Rate: 5, Window: time.Second})
	c := e.newClient()
	ctx := context.Background()
	release := make(chan struct{})
	srv := asynq.NewServerFromRedisClient(e.rdb(), asynq.Config{
		Concurrency: 4, Queues: map[string]int{QueueName(name): 1}, TaskCheckInterval: 50 * time.Millisecond,
		RetryDelayFunc: func(int, error, *asynq.Task) time.Duration { return time.Hour },
		LogLevel:       asynq.FatalLevel,
	})
	if err := srv.Start(asynq.HandlerFunc(func(ctx context.Context, t *asynq.Task) error {
		if t.Type() == "test:block" {
			select {
			case <-release:
			case <-ctx.Done():
			}
			return nil
		}
		return errors.New("fails, to be retried in an hour")
	})); err != nil {
		t.Fatal(err)
	}
	defer srv.Shutdown()
	defer close(release)
	for _, typ := range []string{"test:fail", "test:fail", "test:fail", "test:block", "test:block"} {
		if _, err := c.EnqueueTask(ctx, Target{Vendor: name}, asynq.NewTask(typ, nil)); err != nil {
			t.Fatal(err)
		}
	}
	insp := asynq.NewInspectorFromRedisClient(e.rdb())
	waitFor(t, 20*time.Second, "3 tasks in retry and 2 active", func() bool {
		qi, err := insp.GetQueueInfo(QueueName(name))
		return err == nil && qi.Retry == 3 && qi.Active == 2
	})
	if err := insp.PauseQueue(QueueName(name)); err != nil {
		t.Fatal(err)
	}
	for range 4 {
		if _, err := c.EnqueueTask(ctx, Target{Vendor: name}, asynq.NewTask("test:block", nil)); err != nil {
			t.Fatal(err)
		}
	}
	if _, err := c.EnqueueTask(ctx, Target{Vendor: name}, asynq.NewTask("test:block", nil), asynq.ProcessIn(time.Hour)); err != nil {
		t.Fatal(err)
	}
	var qi *asynq.QueueInfo
	var err error
	for range 5 { // GetQueueInfo can fail transiently in v0.26
		if qi, err = insp.GetQueueInfo(QueueName(name)); err == nil {
			break
		}
	}
	if err != nil {
		t.Fatal(err)
	}
	st, err := c.QueueStats(ctx, name)
	if err != nil {
		t.Fatal(err)
	}
	if st.Pending != int64(qi.Pending) || st.Active != int64(qi.Active) || st.Scheduled != int64(qi.Scheduled) || st.Retry != int64(qi.Retry) {
		t.Errorf("QueueStats %+v, asynq's Inspector pending %d active %d scheduled %d retry %d", st, qi.Pending, qi.Active, qi.Scheduled, qi.Retry)
	}
	if st.Pending != 4 || st.Scheduled != 1 || st.Oldest <= 0 {
		t.Errorf("QueueStats %+v: want 4 pending (with an oldest age) and 1 scheduled", st)
	}
}
