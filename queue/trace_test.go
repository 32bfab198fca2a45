package queue

import (
	"context"
	"fmt"
	"net/http"
	"sync"
	"testing"
	"time"

	"github.com/hibiken/asynq"
	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/codes"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	"go.opentelemetry.io/otel/sdk/trace/tracetest"
	"go.opentelemetry.io/otel/trace"

	"github.com/shaper-dev/shaper/shaper"
	"github.com/shaper-dev/shaper/vendorclients"
)

// collector is the collector stand-in of a test: a tracer provider whose
// ended spans are kept in memory.
type collector struct {
	tp  *sdktrace.TracerProvider
	rec *tracetest.SpanRecorder
}

func newCollector(t *testing.T) *collector {
	rec := tracetest.NewSpanRecorder()
	tp := sdktrace.NewTracerProvider(sdktrace.WithSpanProcessor(rec))
	t.Cleanup(func() { _ = tp.Shutdown(context.Background()) })
	return &collector{tp: tp, rec: rec}
}

// inTrace returns the ended spans of trace id, in the order they started.
func (c *collector) inTrace(id trace.TraceID) []sdktrace.ReadOnlySpan {
	var out []sdktrace.ReadOnlySpan
	for _, s := range c.rec.Ended() {
		if s.SpanContext().TraceID() == id {
			out = append(out, s)
		}
	}
	for i := 1; i < len(out); i++ { // few spans: insertion sort by start
		for j := i; j > 0 && out[j].StartTime().Before(out[j-1].StartTime()); j-- {
			out[j], out[j-1] = out[j-1], out[j]
		}
	}
	return out
}

// named returns the spans of spans with that name.
func named(spans []sdktrace.ReadOnlySpan, name string) []sdktrace.ReadOnlySpan {
	var out []sdktrace.ReadOnlySpan
	for _, s := range spans {
		if s.Name() == name {
			out = append(out, s)
		}
	}
	return out
}

// attr returns a span's attribute k (an empty value when absent).
func attr(s sdktrace.ReadOnlySpan, k string) attribute.Value {
	for _, kv := range s.Attributes() {
		if string(kv.Key) == k {
			return kv.Value
		}
	}
	return attribute.Value{}
}

// checkChild fails unless child's parent is parent's span.
func checkChild(t *testing.T, child, parent sdktrace.ReadOnlySpan) {
	t.Helper()
	if child.Parent().SpanID() != parent.SpanContext().SpanID() || child.SpanContext().TraceID() != parent.SpanContext().TraceID() {
		t.Errorf("span %s: parent %s, want %s (%s)", child.Name(), child.Parent().SpanID(), parent.SpanContext().SpanID(), parent.Name())
	}
}

// startTracedWorker runs a worker whose spans go to tp until the test ends.
func (e *env) startTracedWorker(tp trace.TracerProvider, setup func(*Worker)) {
	e.t.Helper()
	e.tp = tp
	e.startWorker(setup)
}

// traceparents records the traceparent of each request a vendor gets,
// and answers the n-th with status(n).
type traceparents struct {
	mu     sync.Mutex
	seen   []string
	status func(n int) (int, http.Header)
}

func (v *traceparents) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	v.mu.Lock()
	v.seen = append(v.seen, r.Header.Get("traceparent"))
	n := len(v.seen)
	v.mu.Unlock()
	code, h := v.status(n)
	for k := range h {
		w.Header().Set(k, h.Get(k))
	}
	w.WriteHeader(code)
	fmt.Fprint(w, `{}`)
}

func (v *traceparents) got() []string {
	v.mu.Lock()
	defer v.mu.Unlock()
	return append([]string(nil), v.seen...)
}

// traceparentOf is the W3C traceparent of a span.
func traceparentOf(s sdktrace.ReadOnlySpan) string {
	sc := s.SpanContext()
	return fmt.Sprintf("00-%s-%s-%s", sc.TraceID(), sc.SpanID(), sc.TraceFlags())
}

// TestTraceAcrossTheWait: a call enqueued under a span is traced in that
// span's trace. Its vendor answers 429 (Retry-After: 3), then 500, then
// 200: the first run of the task (shaper.call, a child of the enqueuing
// span) holds the queue wait, a tick wait and the 429, a tick wait held
// by the pause and the 500; asynq's retry is a second shaper.call, child
// of the same span, with its tick wait and the 200. Every vendor request
// carried the traceparent of its own HTTP span.
func TestTraceAcrossTheWait(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	col := newCollector(t)
	v := &traceparents{status: func(n int) (int, http.Header) {
		switch n {
		case 1:
			return http.StatusTooManyRequests, http.Header{"Retry-After": {"3"}}
		case 2:
			return http.StatusInternalServerError, nil
		}
		return http.StatusOK, nil
	}}
	name := e.vendor("traced", shaper.Policy{Limits: []shaper.Limit{{Rate: 10, Window: time.Second}}}, 0, v)
	c := e.newClient()
	ctx, parent := col.tp.Tracer("test").Start(context.Background(), "enqueue")
	id, err := c.Enqueue(ctx, Call{Vendor: name, Method: "POST", Path: "/orders", Body: []byte(`{"n":1}`)})
	parent.End()
	if err != nil {
		t.Fatal(err)
	}
	e.startTracedWorker(col.tp, nil)
	traceID := parent.SpanContext().TraceID()
	calls := func() []sdktrace.ReadOnlySpan { return named(col.inTrace(traceID), callSpan+name) }
	waitFor(t, 30*time.Second, "two runs of the call to end", func() bool { return len(calls()) == 2 })

	spans := col.inTrace(traceID)
	root := named(spans, "enqueue")[0]
	runs := calls()
	for i, r := range runs {
		checkChild(t, r, root)
		if got := attr(r, "shaper.retry").AsInt64(); got != int64(i) {
			t.Errorf("run %d: shaper.retry %d", i+1, got)
		}
		if got := attr(r, "messaging.message.id").AsString(); got != id {
			t.Errorf("run %d: messaging.message.id %q, want %q", i+1, got, id)
		}
		if got := attr(r, "shaper.vendor").AsString(); got != name {
			t.Errorf("run %d: shaper.vendor %q", i+1, got)
		}
	}
	if got := attr(runs[0], "shaper.outcome").AsString(); got != outcomeRetry || runs[0].Status().Code != codes.Error {
		t.Errorf("first run: outcome %q, status %v; want %q, an error", got, runs[0].Status(), outcomeRetry)
	}
	if got := attr(runs[1], "shaper.outcome").AsString(); got != outcomeDone {
		t.Errorf("second run: outcome %q, want %q", got, outcomeDone)
	}

	// The children of each run, in the order they started.
	children := func(run sdktrace.ReadOnlySpan) []sdktrace.ReadOnlySpan {
		var out []sdktrace.ReadOnlySpan
		for _, s := range spans {
			if s.Parent().SpanID() == run.SpanContext().SpanID() {
				out = append(out, s)
			}
		}
		return out
	}
	names := func(ss []sdktrace.ReadOnlySpan) []string {
		var out []string
		for _, s := range ss {
			out = append(out, s.Name())
		}
		return out
	}
	first, second := children(runs[0]), children(runs[1])
	want1 := []string{queueWaitSpan, "shaper.tick_wait", "POST", "shaper.tick_wait", "POST"}
	want2 := []string{"shaper.tick_wait", "POST"}
	if fmt.Sprint(names(first)) != fmt.Sprint(want1) || fmt.Sprint(names(second)) != fmt.Sprint(want2) {
		t.Fatalf("runs' spans: %v and %v; want %v and %v", names(first), names(second), want1, want2)
	}
	qw := first[0]
	if !qw.StartTime().Equal(runs[0].StartTime()) || qw.EndTime().After(first[1].StartTime()) {
		t.Errorf("queue wait %s-%s: want it from the run's start (%s) to the tick wait (%s)",
			qw.StartTime(), qw.EndTime(), runs[0].StartTime(), first[1].StartTime())
	}
	for i, call := range []sdktrace.ReadOnlySpan{first[2], first[4], second[1]} {
		want := []int64{429, 500, 200}[i]
		if got := attr(call, "http.response.status_code").AsInt64(); got != want {
			t.Errorf("vendor call %d: status %d, want %d", i+1, got, want)
		}
		if want != 200 && call.Status().Code != codes.Error {
			t.Errorf("vendor call %d (HTTP %d): span status %v, want an error", i+1, want, call.Status())
		}
	}
	if p := attr(first[2], "shaper.pause").AsFloat64(); p < 1 {
		t.Errorf("the 429's span: shaper.pause %g, want the 3 s of its Retry-After", p)
	}
	held := first[3] // the tick wait after the 429
	if got := attr(held, "shaper.binding").AsString(); got != shaper.BoundPause {
		t.Errorf("tick wait after the 429: shaper.binding %q, want %q (lasted %s, events %v, the 429's pause %gs)", got, shaper.BoundPause,
			held.EndTime().Sub(held.StartTime()), held.Events(), attr(first[2], "shaper.pause").AsFloat64())
	}
	if d := held.EndTime().Sub(held.StartTime()); d < 2*time.Second {
		t.Errorf("tick wait after the 429 lasted %s, want the pause (3 s)", d)
	}
	deferred := 0
	for _, ev := range held.Events() {
		if ev.Name == "shaper.deferred" {
			deferred++
		}
	}
	if deferred == 0 {
		t.Errorf("tick wait after the 429 has no shaper.deferred event: %v", held.Events())
	}

	// The vendor saw each request's own span as its parent.
	seen := v.got()
	wantSeen := []string{traceparentOf(first[2]), traceparentOf(first[4]), traceparentOf(second[1])}
	if fmt.Sprint(seen) != fmt.Sprint(wantSeen) {
		t.Errorf("the vendor saw traceparents %v, want %v", seen, wantSeen)
	}
}

// TestTraceBehindABacklog is the bar: a call enqueued under a span
// behind 300 calls to a vendor of 100/s shows, in that span's trace, its
// queue wait and its tick wait, with the vendor call after them, all
// children of its shaper.call; together they cover the 3 s the 300 calls
// ahead of it take at most at 100/s (G1: 301 starts cannot fit in less
// than three windows).
func TestTraceBehindABacklog(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	col := newCollector(t)
	v := &traceparents{status: func(int) (int, http.Header) { return http.StatusOK, nil }}
	name := e.vendor("backlog", shaper.Policy{Limits: []shaper.Limit{{Rate: 100, Window: time.Second}}}, 0, v)
	c := e.newClient()
	const ahead = 300
	enqueueN(t, c, name, ahead)
	ctx, parent := col.tp.Tracer("test").Start(context.Background(), "enqueue")
	if _, err := c.Enqueue(ctx, Call{Vendor: name, ID: "traced", Path: "/orders/traced"}); err != nil {
		t.Fatal(err)
	}
	parent.End()
	e.startTracedWorker(col.tp, nil)
	traceID := parent.SpanContext().TraceID()
	waitFor(t, time.Minute, "the traced call to end", func() bool { return len(named(col.inTrace(traceID), callSpan+name)) == 1 })

	spans := col.inTrace(traceID)
	run := named(spans, callSpan+name)[0]
	checkChild(t, run, named(spans, "enqueue")[0])
	qws, tws, gets := named(spans, queueWaitSpan), named(spans, "shaper.tick_wait"), named(spans, "GET")
	if len(qws) != 1 || len(tws) != 1 || len(gets) != 1 {
		t.Fatalf("the traced call's spans: %d queue waits, %d tick waits, %d vendor calls; want one each", len(qws), len(tws), len(gets))
	}
	qw, tw, get := qws[0], tws[0], gets[0]
	for _, s := range []sdktrace.ReadOnlySpan{qw, tw, get} {
		checkChild(t, s, run)
	}
	if qw.EndTime().After(tw.StartTime()) || tw.EndTime().After(get.StartTime()) {
		t.Errorf("queue wait %s-%s, tick wait %s-%s, vendor call from %s: want them one after the other",
			qw.StartTime(), qw.EndTime(), tw.StartTime(), tw.EndTime(), get.StartTime())
	}
	if got := attr(tw, "shaper.binding").AsString(); got != shaper.BoundBacklog {
		t.Errorf("tick wait: shaper.binding %q, want %q", got, shaper.BoundBacklog)
	}
	if got := attr(get, "http.response.status_code").AsInt64(); got != 200 {
		t.Errorf("vendor call: status %d", got)
	}
	if waited := get.StartTime().Sub(qw.StartTime()); waited < 3*time.Second {
		t.Errorf("from the enqueue to the vendor call: %s; 300 calls ahead at 100/s take at least 3 s", waited)
	}
	t.Logf("queue wait %s, tick wait %s (%s)", qw.EndTime().Sub(qw.StartTime()).Round(time.Millisecond),
		tw.EndTime().Sub(tw.StartTime()).Round(time.Millisecond), attr(tw, "shaper.binding").AsString())
	tp := ""
	for _, s := range v.got() {
		if len(s) == 55 && s[3:35] == traceID.String() {
			tp = s
		}
	}
	if tp != traceparentOf(get) {
		t.Errorf("the vendor saw the traced call with traceparent %q, want %q", tp, traceparentOf(get))
	}
}

// TestTraceUserTask: a task of the user's own type enqueued under a span
// runs as shaper.task <vendor>, child of that span, and each request its
// handler sends through the vendor's client is a tick wait and a vendor
// call beneath it, the vendor seeing the call's traceparent.
func TestTraceUserTask(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	col := newCollector(t)
	v := &traceparents{status: func(int) (int, http.Header) { return http.StatusOK, nil }}
	name := e.vendor("usertask", shaper.Policy{Limits: []shaper.Limit{{Rate: 10, Window: time.Second}}}, 0, v)
	c := e.newClient()
	ctx, parent := col.tp.Tracer("test").Start(context.Background(), "enqueue")
	if _, err := c.EnqueueTask(ctx, Target{Vendor: name}, asynq.NewTask("page:fetch", nil)); err != nil {
		t.Fatal(err)
	}
	parent.End()
	e.startTracedWorker(col.tp, func(w *Worker) {
		if err := w.Handle("page:fetch", func(ctx context.Context, _ *asynq.Task, vc *vendorclients.Client) error {
			for i := range 2 {
				req, err := vc.NewRequest(ctx, "GET", fmt.Sprintf("/pages/%d", i), nil)
				if err != nil {
					return err
				}
				resp, err := vc.Do(req)
				if err != nil {
					return err
				}
				resp.Body.Close()
			}
			return nil
		}); err != nil {
			t.Fatal(err)
		}
	})
	traceID := parent.SpanContext().TraceID()
	waitFor(t, 20*time.Second, "the task's run to end", func() bool { return len(named(col.inTrace(traceID), taskSpan+name)) == 1 })
	spans := col.inTrace(traceID)
	run := named(spans, taskSpan+name)[0]
	checkChild(t, run, named(spans, "enqueue")[0])
	if got := attr(run, "shaper.task.type").AsString(); got != "page:fetch" {
		t.Errorf("shaper.task.type %q", got)
	}
	tws, gets := named(spans, "shaper.tick_wait"), named(spans, "GET")
	if len(tws) != 2 || len(gets) != 2 || len(named(spans, queueWaitSpan)) != 1 {
		t.Fatalf("%d tick waits, %d vendor calls, %d queue waits; want 2, 2, 1", len(tws), len(gets), len(named(spans, queueWaitSpan)))
	}
	for _, s := range append(tws, gets...) {
		checkChild(t, s, run)
	}
	if seen, want := v.got(), []string{traceparentOf(gets[0]), traceparentOf(gets[1])}; fmt.Sprint(seen) != fmt.Sprint(want) {
		t.Errorf("the vendor saw traceparents %v, want %v", seen, want)
	}
}

// TestUntracedTaskKeepsItsOptions: a task of the user's own type,
// enqueued with no trace and none of shaper's headers, is queued as
// given, with the options it was made with.
func TestUntracedTaskKeepsItsOptions(t *testing.T) {
	e := newEnv(t)
	v := e.vendor("opts", policy(10), 0, http.NotFoundHandler())
	c := e.newClient()
	info, err := c.EnqueueTask(context.Background(), Target{Vendor: v}, asynq.NewTask("test:opts", nil, asynq.Timeout(7*time.Second), asynq.TaskID("with-opts")))
	if err != nil {
		t.Fatal(err)
	}
	if info.ID != "with-opts" || info.Timeout != 7*time.Second {
		t.Errorf("queued as %s with timeout %s, want with-opts and 7s: the task's own options were lost", info.ID, info.Timeout)
	}
}
