package vendorclients

// Tracing (OpenTelemetry): under a recording span in a request's context
// (the worker's span of the task), each request adds two spans beside
// each other, children of that span:
//
//	shaper.tick_wait   the wait at the gate: shaper.binding says what held
//	                   the call longest (backlog, pause, quota,
//	                   in_flight, ...), a shaper.deferred event marks each
//	                   time the gate deferred it
//	<METHOD>           the vendor call (client span): its status code, and
//	                   shaper.pause when the answer paused the vendor
//
// The vendor request carries the W3C trace context (traceparent) of the
// request's span context whenever there is one, recording or not. With
// no span context there is no work: no span, no header. Spans use the
// parent span's TracerProvider; the package installs none.

import (
	"context"
	"errors"
	"net/http"
	"strconv"
	"time"

	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/codes"
	"go.opentelemetry.io/otel/propagation"
	"go.opentelemetry.io/otel/trace"

	"github.com/shaper-dev/shaper/shaper"
)

// tracerName is the instrumentation scope of the package's spans.
const tracerName = "github.com/shaper-dev/shaper/vendorclients"

// Span and attribute names (docs/tracing.md).
const tickWaitSpan = "shaper.tick_wait"

var (
	attrBinding     = attribute.Key("shaper.binding") // a shaper.Bound* word
	attrVendor      = attribute.Key("shaper.vendor")
	attrPause       = attribute.Key("shaper.pause") // seconds
	attrWait        = attribute.Key("shaper.wait")  // seconds
	attrAsks        = attribute.Key("shaper.gate.answers")
	attrLane        = attribute.Key("shaper.lane")
	attrCost        = attribute.Key("shaper.cost")
	attrSentBack    = attribute.Key("shaper.sent_back") // seconds: the wait was beyond MaxWait
	attrMethod      = attribute.Key("http.request.method")
	attrStatus      = attribute.Key("http.response.status_code")
	attrURL         = attribute.Key("url.full")
	attrHost        = attribute.Key("server.address")
	attrPort        = attribute.Key("server.port")
	attrErrorType   = attribute.Key("error.type")
	traceContextW3C propagation.TraceContext
)

// tracer is the tracer of the recording span in ctx, if any.
func tracer(ctx context.Context) (trace.Tracer, bool) {
	parent := trace.SpanFromContext(ctx)
	if !parent.IsRecording() {
		return nil, false
	}
	return parent.TracerProvider().Tracer(tracerName), true
}

// tickWait is the span of one request's wait at the gate; nil when the
// request is not traced.
type tickWait struct {
	span  trace.Span
	asks  int
	waits map[string]time.Duration // by binding
	order []string                 // bindings in the order first heard of
	last  string                   // the last deferral's binding
}

// startTickWait starts the span of the wait of ask and has ask.Waited
// tell it of each wait. It returns nil when ctx holds no recording span.
func (t *transport) startTickWait(ctx context.Context, ask *shaper.Request) *tickWait {
	tr, ok := tracer(ctx)
	if !ok {
		return nil
	}
	attrs := []attribute.KeyValue{attrVendor.String(t.vendor.Name)}
	if ask.Lane == shaper.High {
		attrs = append(attrs, attrLane.String(ask.Lane.String()))
	}
	if ask.Cost > 1 {
		attrs = append(attrs, attrCost.Int(ask.Cost))
	}
	_, span := tr.Start(ctx, tickWaitSpan, trace.WithAttributes(attrs...))
	tw := &tickWait{span: span, waits: map[string]time.Duration{}}
	prev := ask.Waited
	ask.Waited = func(w shaper.Wait) {
		if prev != nil {
			prev(w)
		}
		tw.waited(w)
	}
	return tw
}

// waited counts a wait for its binding. The wait until a granted tick
// counts for the deferral just before it, if any: the grant is the end
// of what held the call (a pause's last horizon), which a grant does not
// name.
func (tw *tickWait) waited(w shaper.Wait) {
	tw.asks++
	b := w.Binding
	if w.Granted && tw.last != "" {
		b = tw.last
	}
	if !w.Granted {
		tw.last = b
		tw.span.AddEvent("shaper.deferred", trace.WithAttributes(attrBinding.String(b), attrWait.Float64(w.For.Seconds())))
	}
	if _, ok := tw.waits[b]; !ok {
		tw.order = append(tw.order, b)
	}
	tw.waits[b] += w.For
}

// binding is what held the call longest (the first heard of among
// equals); backlog when nothing did.
func (tw *tickWait) binding() string {
	b, longest := shaper.BoundBacklog, time.Duration(-1)
	for _, k := range tw.order {
		if tw.waits[k] > longest {
			b, longest = k, tw.waits[k]
		}
	}
	return b
}

// end ends the span with the gate's answer: a permit, a wait beyond
// MaxWait (no permit; a *shaper.Wait), or an error.
func (tw *tickWait) end(permit *shaper.Permit, err error) {
	if tw == nil {
		return
	}
	tw.span.SetAttributes(attrBinding.String(tw.binding()), attrAsks.Int(tw.asks))
	var wait *shaper.Wait
	switch {
	case errors.As(err, &wait):
		tw.span.SetAttributes(attrSentBack.Float64(wait.For.Seconds()))
	case err != nil:
		tw.span.RecordError(err)
		tw.span.SetStatus(codes.Error, err.Error())
	}
	tw.span.End()
}

// send is the traced side of one vendor request: its span (nil when not
// recording) and the context whose span context the request carries.
type send struct {
	ctx  context.Context
	span trace.Span
}

// startSend starts the span of a vendor request sent with ctx, when ctx
// holds a recording span.
func (t *transport) startSend(ctx context.Context, req *http.Request) send {
	tr, ok := tracer(ctx)
	if !ok {
		return send{ctx: ctx}
	}
	attrs := []attribute.KeyValue{attrVendor.String(t.vendor.Name), attrMethod.String(req.Method), attrHost.String(req.URL.Hostname())}
	if p, err := strconv.Atoi(req.URL.Port()); err == nil {
		attrs = append(attrs, attrPort.Int(p))
	}
	u := *req.URL
	u.User, u.RawQuery, u.ForceQuery = nil, "", false // a query may hold a key
	attrs = append(attrs, attrURL.String(u.String()))
	ctx, span := tr.Start(ctx, req.Method, trace.WithSpanKind(trace.SpanKindClient), trace.WithAttributes(attrs...))
	return send{ctx: ctx, span: span}
}

// inject puts the W3C trace context in h (traceparent, tracestate), when
// the request has a span context.
func (s send) inject(h http.Header) {
	traceContextW3C.Inject(s.ctx, propagation.HeaderCarrier(h))
}

// end ends the span at returned, with the vendor's answer and the pause
// it set.
func (s send) end(returned time.Time, resp *http.Response, pause time.Duration, err error) {
	if s.span == nil {
		return
	}
	switch {
	case err != nil:
		s.span.RecordError(err)
		s.span.SetAttributes(attrErrorType.String("transport"))
		s.span.SetStatus(codes.Error, err.Error())
	default:
		s.span.SetAttributes(attrStatus.Int(resp.StatusCode))
		if pause > 0 {
			s.span.SetAttributes(attrPause.Float64(pause.Seconds()))
		}
		if resp.StatusCode >= 400 {
			s.span.SetAttributes(attrErrorType.String(strconv.Itoa(resp.StatusCode)))
			if isRateLimited(resp) {
				s.span.SetStatus(codes.Error, "rate limited")
			} else {
				s.span.SetStatus(codes.Error, http.StatusText(resp.StatusCode))
			}
		}
	}
	s.span.End(trace.WithTimestamp(returned))
}
