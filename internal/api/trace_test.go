package api

import (
	"context"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"testing"
	"time"

	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	"go.opentelemetry.io/otel/sdk/trace/tracetest"
	"go.opentelemetry.io/otel/trace"

	"github.com/shaper-dev/shaper/internal/redistest"
	"github.com/shaper-dev/shaper/queue"
	"github.com/shaper-dev/shaper/shaper"
	"github.com/shaper-dev/shaper/vendorclients"
)

// TestTracedPost: a POST that sends a traceparent gets a server span,
// child of the caller's span; the worker's span of the call it queued
// (shaper.call) is a child of that server span, its queue wait, tick
// wait and vendor call are children of it, and the vendor's request
// carries the trace.
func TestTracedPost(t *testing.T) {
	rec := tracetest.NewSpanRecorder()
	tp := sdktrace.NewTracerProvider(sdktrace.WithSpanProcessor(rec))
	t.Cleanup(func() { _ = tp.Shutdown(context.Background()) })

	var mu sync.Mutex
	var seen []string
	vsrv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		mu.Lock()
		seen = append(seen, r.Header.Get("traceparent"))
		mu.Unlock()
		w.Header().Set("Content-Type", "application/json")
		_, _ = w.Write([]byte(`{"ok":true}`))
	}))
	t.Cleanup(vsrv.Close)
	rdb := redistest.Client(t)
	prefix := redistest.Prefix(t)
	name := "api-" + strings.ReplaceAll(prefix, ":", "-")
	vend := queue.Vendor{Endpoint: vendorclients.Endpoint{Name: name, BaseURL: vsrv.URL, Timeout: 5 * time.Second},
		Policy: shaper.Policy{Limits: []shaper.Limit{{Rate: 200, Window: time.Second}}}}
	c := queue.NewClient(rdb, queue.ClientConfig{Vendors: []queue.Vendor{vend}, KeyPrefix: prefix})
	t.Cleanup(func() { _ = c.Close() })
	w, err := queue.NewWorker(rdb, queue.WorkerConfig{Vendors: []queue.Vendor{vend}, KeyPrefix: prefix, TracerProvider: tp})
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- w.Run(ctx) }()
	t.Cleanup(func() {
		cancel()
		if err := <-done; err != nil {
			t.Errorf("worker: %v", err)
		}
	})
	srv := httptest.NewServer(Traced(New(Options{Client: c}), tp))
	t.Cleanup(srv.Close)

	const traceID, callerSpan = "4bf92f3577b34da6a3ce929d0e0e4736", "00f067aa0ba902b7"
	req, err := http.NewRequest("POST", srv.URL+"/v1/calls", strings.NewReader(`{"vendor":"`+name+`","id":"traced-1","path":"/orders/1"}`))
	if err != nil {
		t.Fatal(err)
	}
	req.Header.Set("Content-Type", "application/json")
	req.Header.Set("traceparent", "00-"+traceID+"-"+callerSpan+"-01")
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	if resp.StatusCode != http.StatusAccepted {
		t.Fatalf("POST: HTTP %d", resp.StatusCode)
	}

	inTrace := func() map[string][]sdktrace.ReadOnlySpan {
		out := map[string][]sdktrace.ReadOnlySpan{}
		for _, s := range rec.Ended() {
			if s.SpanContext().TraceID().String() == traceID {
				out[s.Name()] = append(out[s.Name()], s)
			}
		}
		return out
	}
	deadline := time.Now().Add(20 * time.Second)
	for len(inTrace()["shaper.call "+name]) == 0 {
		if time.Now().After(deadline) {
			t.Fatalf("no shaper.call span in the caller's trace after 20 s; spans: %v", inTrace())
		}
		time.Sleep(50 * time.Millisecond)
	}
	spans := inTrace()
	var server sdktrace.ReadOnlySpan
	for _, ss := range spans {
		for _, s := range ss {
			if s.SpanKind() == trace.SpanKindServer {
				server = s
			}
		}
	}
	if server == nil {
		t.Fatalf("no server span in the caller's trace: %v", spans)
	}
	if got := server.Parent().SpanID().String(); got != callerSpan || !server.Parent().IsRemote() {
		t.Errorf("server span's parent %s (remote %v), want the caller's %s", got, server.Parent().IsRemote(), callerSpan)
	}
	call := spans["shaper.call "+name][0]
	if call.Parent().SpanID() != server.SpanContext().SpanID() {
		t.Errorf("shaper.call's parent %s, want the POST's server span %s", call.Parent().SpanID(), server.SpanContext().SpanID())
	}
	for _, n := range []string{"shaper.queue_wait", "shaper.tick_wait", "GET"} {
		if len(spans[n]) != 1 || spans[n][0].Parent().SpanID() != call.SpanContext().SpanID() {
			t.Errorf("%s: %d spans in the trace, want one, child of shaper.call", n, len(spans[n]))
		}
	}
	mu.Lock()
	defer mu.Unlock()
	if len(seen) != 1 || !strings.Contains(seen[0], traceID) {
		t.Errorf("the vendor saw traceparents %q, want one in trace %s", seen, traceID)
	}
}
