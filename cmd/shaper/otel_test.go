package main

import (
	"context"
	"io"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"testing"

	"go.opentelemetry.io/otel"
	"go.opentelemetry.io/otel/propagation"
	"go.opentelemetry.io/otel/trace/noop"

	"github.com/shaper-dev/shaper/config"
)

func TestPlanTracing(t *testing.T) {
	for _, c := range []struct {
		name     string
		table    config.Tracing
		env      map[string]string
		on       bool
		endpoint string
		err      string
	}{
		{name: "nothing set: off"},
		{name: "the table", table: config.Tracing{OTLPEndpoint: "http://127.0.0.1:4318"}, on: true, endpoint: "http://127.0.0.1:4318/v1/traces"},
		{name: "the table with a path", table: config.Tracing{OTLPEndpoint: "https://otlp.example/otel/traces"}, on: true, endpoint: "https://otlp.example/otel/traces"},
		{name: "OTEL_EXPORTER_OTLP_ENDPOINT", env: map[string]string{"OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4318"}, on: true},
		{name: "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", env: map[string]string{"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://c:4318/v1/traces"}, on: true},
		{name: "OTEL_TRACES_EXPORTER=otlp", env: map[string]string{"OTEL_TRACES_EXPORTER": "otlp"}, on: true},
		{name: "OTEL_SDK_DISABLED", table: config.Tracing{OTLPEndpoint: "http://c:4318"}, env: map[string]string{"OTEL_SDK_DISABLED": "TRUE"}},
		{name: "OTEL_TRACES_EXPORTER=none", table: config.Tracing{OTLPEndpoint: "http://c:4318"}, env: map[string]string{"OTEL_TRACES_EXPORTER": "none"}},
		{name: "another exporter", env: map[string]string{"OTEL_TRACES_EXPORTER": "zipkin"}, err: `OTEL_TRACES_EXPORTER="zipkin": shaper exports spans with "otlp"`},
		{name: "grpc", env: map[string]string{"OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4317", "OTEL_EXPORTER_OTLP_PROTOCOL": "grpc"},
			err: `OTEL_EXPORTER_OTLP_PROTOCOL="grpc": shaper sends spans over OTLP/HTTP`},
		{name: "the traces' protocol wins", env: map[string]string{"OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4318", "OTEL_EXPORTER_OTLP_PROTOCOL": "grpc",
			"OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": "http/protobuf"}, on: true},
	} {
		p, err := planTracing(c.table, func(k string) string { return c.env[k] })
		switch {
		case c.err != "":
			if err == nil || !strings.Contains(err.Error(), c.err) {
				t.Errorf("%s: %v, want %q", c.name, err, c.err)
			}
		case err != nil:
			t.Errorf("%s: %v", c.name, err)
		case p.on != c.on || p.endpoint != c.endpoint:
			t.Errorf("%s: on %v, endpoint %q; want %v, %q", c.name, p.on, p.endpoint, c.on, c.endpoint)
		}
	}
}

// TestTracingExports: with [tracing] otlp_endpoint set, a span made
// through the global provider reaches the OTLP/HTTP receiver at its
// /v1/traces when tracing stops, and the global propagator speaks W3C.
// (Not parallel: it installs the process's provider, and restores a
// no-op one.)
func TestTracingExports(t *testing.T) {
	var mu sync.Mutex
	var got []string
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		b, _ := io.ReadAll(r.Body)
		mu.Lock()
		got = append(got, r.Method+" "+r.URL.Path+" "+r.Header.Get("Content-Type")+" "+string(b))
		mu.Unlock()
		w.Header().Set("Content-Type", "application/x-protobuf")
	}))
	defer srv.Close()
	t.Cleanup(func() {
		otel.SetTracerProvider(noop.NewTracerProvider())
		otel.SetTextMapPropagator(propagation.NewCompositeTextMapPropagator())
	})
	stop, err := startTracing(context.Background(), config.Tracing{OTLPEndpoint: srv.URL, ServiceName: "shaper-test"}, slog.New(slog.DiscardHandler))
	if err != nil {
		t.Fatal(err)
	}
	_, span := otel.Tracer("test").Start(context.Background(), "a-span-to-export")
	span.End()
	if f := otel.GetTextMapPropagator().Fields(); !strings.Contains(strings.Join(f, ","), "traceparent") {
		t.Errorf("the global propagator's fields are %v, want traceparent among them", f)
	}
	stop()
	mu.Lock()
	defer mu.Unlock()
	if len(got) != 1 || !strings.HasPrefix(got[0], "POST /v1/traces application/x-protobuf") ||
		!strings.Contains(got[0], "a-span-to-export") || !strings.Contains(got[0], "shaper-test") {
		t.Errorf("the receiver got %q, want one POST /v1/traces holding the span and the service name", got)
	}
}
