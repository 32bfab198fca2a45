package main

import (
	"context"
	"fmt"
	"log/slog"
	"net/url"
	"os"
	"strings"
	"time"

	"go.opentelemetry.io/otel"
	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/exporters/otlp/otlptrace/otlptracehttp"
	"go.opentelemetry.io/otel/propagation"
	"go.opentelemetry.io/otel/sdk/resource"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"

	"github.com/shaper-dev/shaper/config"
)

// tracingPlan is what startTracing sets up: nothing (off), or an OTLP/HTTP
// exporter to endpoint ("" when the OTEL_* variables name it).
type tracingPlan struct {
	on       bool
	endpoint string // the [tracing] table's, with /v1/traces
	from     string // what turned tracing on, for the log
}

// planTracing reads the [tracing] table and the standard OTEL_*
// variables: tracing is on when either names an OTLP endpoint or
// OTEL_TRACES_EXPORTER=otlp, and off with OTEL_SDK_DISABLED=true or
// OTEL_TRACES_EXPORTER=none. Spans go over OTLP/HTTP (http/protobuf)
// only.
func planTracing(t config.Tracing, getenv func(string) string) (tracingPlan, error) {
	if strings.EqualFold(strings.TrimSpace(getenv("OTEL_SDK_DISABLED")), "true") {
		return tracingPlan{}, nil
	}
	exporter := strings.TrimSpace(getenv("OTEL_TRACES_EXPORTER"))
	switch exporter {
	case "none":
		return tracingPlan{}, nil
	case "", "otlp":
	default:
		return tracingPlan{}, fmt.Errorf("OTEL_TRACES_EXPORTER=%q: shaper exports spans with \"otlp\" (OTLP/HTTP), or none with \"none\"", exporter)
	}
	p := tracingPlan{}
	switch {
	case t.OTLPEndpoint != "":
		p.on, p.from, p.endpoint = true, "[tracing] otlp_endpoint", tracesURL(t.OTLPEndpoint)
	case getenv("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT") != "":
		p.on, p.from = true, "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"
	case getenv("OTEL_EXPORTER_OTLP_ENDPOINT") != "":
		p.on, p.from = true, "OTEL_EXPORTER_OTLP_ENDPOINT"
	case exporter == "otlp":
		p.on, p.from = true, "OTEL_TRACES_EXPORTER=otlp"
	}
	if !p.on {
		return p, nil
	}
	for _, k := range []string{"OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "OTEL_EXPORTER_OTLP_PROTOCOL"} {
		if v := strings.TrimSpace(getenv(k)); v != "" {
			if v != "http/protobuf" {
				return tracingPlan{}, fmt.Errorf("%s=%q: shaper sends spans over OTLP/HTTP (http/protobuf, usually port 4318); unset it or set http/protobuf", k, v)
			}
			break // the traces' own variable wins
		}
	}
	return p, nil
}

// tracesURL is the OTLP/HTTP traces URL of a receiver's base URL: its
// /v1/traces, unless the URL has a path of its own.
func tracesURL(base string) string {
	u, err := url.Parse(base)
	if err != nil || strings.Trim(u.Path, "/") != "" {
		return base
	}
	u.Path = "/v1/traces"
	return u.String()
}

// startTracing installs the process's OpenTelemetry tracer provider and
// W3C propagator when tracing is configured (see planTracing); stop
// flushes the spans not yet sent (for at most 5 s) and shuts it down.
// Off, it installs nothing: the libraries' spans stay no-ops.
func startTracing(ctx context.Context, t config.Tracing, log *slog.Logger) (stop func(), err error) {
	p, err := planTracing(t, os.Getenv)
	if err != nil || !p.on {
		return func() {}, err
	}
	var opts []otlptracehttp.Option
	if p.endpoint != "" {
		opts = append(opts, otlptracehttp.WithEndpointURL(p.endpoint))
	}
	exp, err := otlptracehttp.New(ctx, opts...)
	if err != nil {
		return nil, fmt.Errorf("tracing: %w", err)
	}
	// service.name: the table's, else OTEL_SERVICE_NAME, else "shaper".
	detectors := []resource.Option{resource.WithAttributes(attribute.String("service.name", "shaper")),
		resource.WithTelemetrySDK(), resource.WithFromEnv()}
	if t.ServiceName != "" {
		detectors = append(detectors, resource.WithAttributes(attribute.String("service.name", t.ServiceName)))
	}
	res, err := resource.New(ctx, detectors...)
	if err != nil {
		return nil, fmt.Errorf("tracing: OTEL_RESOURCE_ATTRIBUTES or OTEL_SERVICE_NAME: %w", err)
	}
	tpOpts := []sdktrace.TracerProviderOption{sdktrace.WithBatcher(exp), sdktrace.WithResource(res)}
	if t.SampleRatio > 0 {
		tpOpts = append(tpOpts, sdktrace.WithSampler(sdktrace.ParentBased(sdktrace.TraceIDRatioBased(t.SampleRatio))))
	}
	tp := sdktrace.NewTracerProvider(tpOpts...)
	otel.SetTracerProvider(tp)
	otel.SetTextMapPropagator(propagation.NewCompositeTextMapPropagator(propagation.TraceContext{}, propagation.Baggage{}))
	otel.SetErrorHandler(otel.ErrorHandlerFunc(func(err error) {
		log.Warn("tracing: could not export spans", "err", err)
	}))
	endpoint := p.endpoint
	if endpoint == "" {
		endpoint = "from the OTEL_* variables"
	}
	log.Info("tracing: spans go to an OTLP/HTTP receiver", "endpoint", endpoint, "set_by", p.from)
	return func() {
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		defer cancel()
		if err := tp.Shutdown(ctx); err != nil {
			log.Warn("tracing: spans not sent at exit", "err", err)
		}
	}, nil
}
