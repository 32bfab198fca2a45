package vendorclients

import (
	"context"
	"net/http"
	"testing"
	"time"

	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	"go.opentelemetry.io/otel/sdk/trace/tracetest"
	"go.opentelemetry.io/otel/trace"

	"github.com/shaper-dev/shaper/shaper"
)

// TestTickWaitBinding: what held a call longest names its tick wait; the
// wait for a granted tick counts for the deferral before it, if any.
func TestTickWaitBinding(t *testing.T) {
	def := func(b string, s float64) shaper.Wait {
		return shaper.Wait{Binding: b, For: time.Duration(s * float64(time.Second))}
	}
	grant := func(s float64) shaper.Wait {
		return shaper.Wait{Binding: shaper.BoundBacklog, For: time.Duration(s * float64(time.Second)), Granted: true}
	}
	rec := tracetest.NewSpanRecorder()
	tp := sdktrace.NewTracerProvider(sdktrace.WithSpanProcessor(rec))
	ctx, parent := tp.Tracer("test").Start(context.Background(), "run")
	defer parent.End()
	tr := &transport{vendor: Endpoint{Name: "acme"}}
	for _, c := range []struct {
		name  string
		waits []shaper.Wait
		want  string
	}{
		{"none", nil, shaper.BoundBacklog},
		{"a granted tick", []shaper.Wait{grant(0.4)}, shaper.BoundBacklog},
		{"the end of a pause", []shaper.Wait{def(shaper.BoundPause, 1), grant(1)}, shaper.BoundPause},
		{"a backlog, then the in-flight cap", []shaper.Wait{def(shaper.BoundBacklog, 2), def(shaper.BoundInFlight, 0.5), grant(0.2)}, shaper.BoundBacklog},
		{"a quota, then a long pause", []shaper.Wait{def(shaper.BoundQuota, 0.5), def(shaper.BoundPause, 3), grant(1)}, shaper.BoundPause},
		{"the in-flight cap at length", []shaper.Wait{grant(0.1), def(shaper.BoundInFlight, 0.3), def(shaper.BoundInFlight, 0.3)}, shaper.BoundInFlight},
	} {
		var ask shaper.Request
		tw := tr.startTickWait(ctx, &ask)
		for _, w := range c.waits {
			ask.Waited(w)
		}
		if got := tw.binding(); got != c.want {
			t.Errorf("%s: binding %q, want %q", c.name, got, c.want)
		}
		deferrals := 0
		for _, w := range c.waits {
			if !w.Granted {
				deferrals++
			}
		}
		tw.end(nil, nil)
		ended := rec.Ended()
		span := ended[len(ended)-1]
		if len(span.Events()) != deferrals || span.Parent().SpanID() != parent.SpanContext().SpanID() {
			t.Errorf("%s: %d events, parent %s; want %d, the run's span", c.name, len(span.Events()), span.Parent().SpanID(), deferrals)
		}
	}
}

// TestTraceparent: a request sent under a span context carries its
// traceparent, recording or not; without one it carries none, and no
// span is made outside a recording span.
func TestTraceparent(t *testing.T) {
	tr := &transport{vendor: Endpoint{Name: "acme"}}
	req, _ := http.NewRequest("GET", "https://api.acme.example/orders?key=secret", nil)

	h := http.Header{}
	s := tr.startSend(context.Background(), req)
	s.inject(h)
	if s.span != nil || h.Get("traceparent") != "" {
		t.Errorf("no span context: span %v, traceparent %q; want none", s.span, h.Get("traceparent"))
	}

	sc := trace.NewSpanContext(trace.SpanContextConfig{TraceID: trace.TraceID{1}, SpanID: trace.SpanID{2}, TraceFlags: trace.FlagsSampled, Remote: true})
	h = http.Header{}
	s = tr.startSend(trace.ContextWithRemoteSpanContext(context.Background(), sc), req)
	s.inject(h)
	if want := "00-01000000000000000000000000000000-0200000000000000-01"; s.span != nil || h.Get("traceparent") != want {
		t.Errorf("a caller's span context, not recording: span %v, traceparent %q; want none, %q", s.span, h.Get("traceparent"), want)
	}

	rec := tracetest.NewSpanRecorder()
	tp := sdktrace.NewTracerProvider(sdktrace.WithSpanProcessor(rec))
	ctx, parent := tp.Tracer("test").Start(context.Background(), "run")
	h = http.Header{}
	s = tr.startSend(ctx, req)
	s.inject(h)
	s.end(time.Now(), &http.Response{StatusCode: http.StatusTooManyRequests, Header: http.Header{}}, 2*time.Second, nil)
	parent.End()
	span := rec.Ended()[0]
	want := "00-" + span.SpanContext().TraceID().String() + "-" + span.SpanContext().SpanID().String() + "-01"
	if h.Get("traceparent") != want || span.Parent().SpanID() != parent.SpanContext().SpanID() {
		t.Errorf("traceparent %q, want the vendor call's own span %q, child of the run", h.Get("traceparent"), want)
	}
	attrs := map[string]string{}
	for _, kv := range span.Attributes() {
		attrs[string(kv.Key)] = kv.Value.String()
	}
	for k, v := range map[string]string{"http.response.status_code": "429", "shaper.pause": "2", "url.full": "https://api.acme.example/orders",
		"shaper.vendor": "acme", "http.request.method": "GET"} {
		if attrs[k] != v {
			t.Errorf("%s = %q, want %q", k, attrs[k], v)
		}
	}
	if span.Status().Description != "rate limited" || span.SpanKind() != trace.SpanKindClient {
		t.Errorf("status %v, kind %v; want rate limited, client", span.Status(), span.SpanKind())
	}
}
