package queue

// Tracing (OpenTelemetry; docs/tracing.md). The W3C trace context of the
// enqueuing request rides in the task's headers, with the enqueue time,
// in the write asynq makes anyway; the worker's spans join that trace:
//
//	<the enqueuing request's span>
//	└── shaper.call <vendor>      one run of the task (shaper.task <vendor>
//	    │                         for a task of the user's own type)
//	    ├── shaper.queue_wait     from the enqueue to the run (first run)
//	    ├── shaper.tick_wait      the wait at the gate (vendorclients)
//	    └── <METHOD>              the vendor call (vendorclients)
//
// A task enqueued with no span context carries nothing and adds no
// work; the worker then starts a trace of its own for it, if its
// TracerProvider records.

import (
	"context"
	"errors"
	"maps"
	"strconv"
	"sync/atomic"
	"time"

	"github.com/hibiken/asynq"
	"go.opentelemetry.io/otel"
	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/codes"
	"go.opentelemetry.io/otel/propagation"
	"go.opentelemetry.io/otel/trace"
)

// tracerName is the instrumentation scope of the package's spans.
const tracerName = "github.com/shaper-dev/shaper/queue"

// Headers of a task: enqueuedHeader, its enqueue time in Unix µs (every
// call, and a traced task of the user's type: the queue_wait span and a
// callback's enqueued_at), and, when traced, the W3C trace context
// (traceparent, tracestate).
const (
	traceparentHeader = "traceparent"
	enqueuedHeader    = "shaper-enqueued"
)

// Span names.
const (
	callSpan      = "shaper.call "
	taskSpan      = "shaper.task "
	queueWaitSpan = "shaper.queue_wait"
)

var (
	attrVendor  = attribute.Key("shaper.vendor")
	attrRetry   = attribute.Key("shaper.retry") // asynq's retry count: 0 on the first run
	attrOutcome = attribute.Key("shaper.outcome")
	attrType    = attribute.Key("shaper.task.type")
	attrSystem  = attribute.String("messaging.system", "asynq")
	attrQueue   = attribute.Key("messaging.destination.name")
	attrTaskID  = attribute.Key("messaging.message.id")
	traceW3C    propagation.TraceContext
)

// Outcomes of a run (the shaper.outcome attribute).
const (
	outcomeDone     = "done"     // the vendor answered 2xx (or the handler returned nil)
	outcomeDeferred = "deferred" // back to the queue without using a retry
	outcomeRetry    = "retry"    // failed; asynq retries it
	outcomeFailed   = "failed"   // failed for good
)

// traced returns t carrying its enqueue stamp (from stamps) and ctx's
// trace context, if it
// holds one, in its headers. A task of the user's own type without a
// span context is t itself: a task rebuilt with headers loses the options
// given to asynq.NewTask (asynq cannot read them back), so it is rebuilt
// only when there is a trace to carry.
func traced(ctx context.Context, t *asynq.Task, stamps *stamper) *asynq.Task {
	if t.Type() != TypeCall && t.Type() != TypeCallback && !trace.SpanContextFromContext(ctx).IsValid() {
		return t
	}
	h := maps.Clone(t.Headers())
	if h == nil {
		h = make(map[string]string, 3)
	}
	if trace.SpanContextFromContext(ctx).IsValid() {
		traceW3C.Inject(ctx, propagation.MapCarrier(h))
	}
	h[enqueuedHeader] = strconv.FormatInt(stamps.next(), 10)
	return asynq.NewTaskWithHeaders(t.Type(), t.Payload(), h)
}

// stamper gives enqueue stamps (Unix µs), each later than the one
// before: the calls of one batch, queued within a microsecond of each
// other, keep their order in the bucket's line (shaper.Request.Order).
type stamper struct{ last atomic.Int64 }

func (s *stamper) next() int64 {
	now := time.Now().UnixMicro()
	for {
		last := s.last.Load()
		next := max(now, last+1)
		if s.last.CompareAndSwap(last, next) {
			return next
		}
	}
}

// orderOf is t's place in its bucket's queue (shaper.Request.Order): its
// enqueue stamp; 0 for a task that carries none.
func orderOf(t *asynq.Task) int64 {
	us, err := strconv.ParseInt(t.Headers()[enqueuedHeader], 10, 64)
	if err != nil || us <= 0 {
		return 0
	}
	return us
}

// enqueuedAt is when t was queued, by the enqueuer's clock; zero for a
// task queued by a version of shaper that did not say.
func enqueuedAt(t *asynq.Task) time.Time {
	if us := orderOf(t); us > 0 {
		return time.UnixMicro(us).UTC()
	}
	return time.Time{}
}

// run is the span of one run of a task; its zero value (not recording)
// does nothing.
type run struct {
	span trace.Span
}

// startRun starts the span of one run of t on rt's queue, child of the
// span context t carries, with the task's wait in its queue before it
// when this is its first run. The context it returns carries the span
// (or t's span context, when not recording) to the vendor's client.
func (w *Worker) startRun(ctx context.Context, rt *vendorRuntime, t *asynq.Task) (context.Context, run) {
	h := t.Headers()
	if h[traceparentHeader] != "" {
		ctx = traceW3C.Extract(ctx, propagation.MapCarrier(h))
	}
	tp := w.cfg.TracerProvider
	if tp == nil {
		tp = otel.GetTracerProvider()
	}
	now := time.Now()
	retry, _ := asynq.GetRetryCount(ctx)
	start, enqueued := now, time.Time{}
	if at := enqueuedAt(t); !at.IsZero() && retry == 0 {
		// The enqueuer's clock: a skew shows as a longer or shorter wait.
		if enqueued = at; enqueued.Before(now) {
			start = enqueued
		} else {
			enqueued = now
		}
	}
	name := callSpan + rt.vendor.Name
	if t.Type() != TypeCall {
		name = taskSpan + rt.vendor.Name
	}
	tr := tp.Tracer(tracerName)
	ctx, span := tr.Start(ctx, name, trace.WithSpanKind(trace.SpanKindConsumer), trace.WithTimestamp(start))
	if !span.IsRecording() {
		return ctx, run{}
	}
	queue, _ := asynq.GetQueueName(ctx)
	id, _ := asynq.GetTaskID(ctx)
	span.SetAttributes(attrVendor.String(rt.vendor.Name), attrRetry.Int(retry), attrSystem, attrQueue.String(queue), attrTaskID.String(id))
	if t.Type() != TypeCall {
		span.SetAttributes(attrType.String(t.Type()))
	}
	if !enqueued.IsZero() {
		_, qw := tr.Start(ctx, queueWaitSpan, trace.WithTimestamp(enqueued),
			trace.WithAttributes(attrVendor.String(rt.vendor.Name), attrQueue.String(queue)))
		qw.End(trace.WithTimestamp(now))
	}
	return ctx, run{span: span}
}

// end ends the run's span with the handler's answer.
func (r run) end(ctx context.Context, err error) {
	if r.span == nil {
		return
	}
	var d *deferError
	switch {
	case err == nil:
		r.span.SetAttributes(attrOutcome.String(outcomeDone))
	case errors.As(err, &d):
		r.span.SetAttributes(attrOutcome.String(outcomeDeferred))
		r.span.AddEvent("shaper.sent_back", trace.WithAttributes(attribute.Float64("shaper.wait", d.Wait.Seconds())))
	default:
		outcome := outcomeRetry
		n, _ := asynq.GetRetryCount(ctx)
		maxRetry, _ := asynq.GetMaxRetry(ctx)
		if errors.Is(err, asynq.SkipRetry) || n >= maxRetry {
			outcome = outcomeFailed
		}
		r.span.SetAttributes(attrOutcome.String(outcome))
		r.span.RecordError(err)
		r.span.SetStatus(codes.Error, err.Error())
	}
	r.span.End()
}
