package api

import (
	"net/http"

	"go.opentelemetry.io/contrib/instrumentation/net/http/otelhttp"
	"go.opentelemetry.io/otel/propagation"
	"go.opentelemetry.io/otel/trace"
)

// Traced returns h with each request a server span of tp (nil: the
// global provider, a no-op unless the program installed one), child of
// the W3C trace context (traceparent) the caller sent. The calls a POST
// queues carry that span's context (queue.Client), so the worker's spans
// of each call join the caller's trace. With tracing off, a caller's
// traceparent still reaches the calls, unchanged.
func Traced(h http.Handler, tp trace.TracerProvider) http.Handler {
	opts := []otelhttp.Option{otelhttp.WithPropagators(propagation.TraceContext{})}
	if tp != nil {
		opts = append(opts, otelhttp.WithTracerProvider(tp))
	}
	return otelhttp.NewHandler(h, "shaper.api", opts...)
}
