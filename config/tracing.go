package config

import (
	"net/url"
	"strings"
)

var tracingKeys = []string{"otlp_endpoint", "service_name", "sample_ratio"}

// Tracing is the [tracing] table: where workers and the API send their
// OpenTelemetry spans (docs/tracing.md). Without it tracing is off unless
// the standard OTEL_* variables turn it on.
type Tracing struct {
	// OTLPEndpoint is the base URL of an OTLP/HTTP receiver
	// (http://127.0.0.1:4318); spans go to its /v1/traces unless the URL
	// has a path of its own. Empty: OTEL_EXPORTER_OTLP_ENDPOINT, if set.
	OTLPEndpoint string
	// ServiceName is the spans' service.name; empty: OTEL_SERVICE_NAME,
	// else "shaper".
	ServiceName string
	// SampleRatio is the share of new traces recorded (a trace begun by
	// the caller follows its caller's choice); 0: OTEL_TRACES_SAMPLER,
	// else all.
	SampleRatio float64
}

// tracing reads the [tracing] table.
func (p *parser) tracing(raw map[string]any) Tracing {
	const t = "tracing"
	tbl, ok := raw[t].(map[string]any)
	if !ok {
		if _, present := raw[t]; present {
			p.errorf(t, "", "[tracing] must be a table")
		}
		return Tracing{}
	}
	p.unknownKeys(t, tbl, tracingKeys)
	tr := Tracing{OTLPEndpoint: strings.TrimSpace(p.str(t, "otlp_endpoint")), ServiceName: p.str(t, "service_name")}
	if tr.OTLPEndpoint != "" {
		u, err := url.Parse(tr.OTLPEndpoint)
		if err != nil || (u.Scheme != "http" && u.Scheme != "https") || u.Host == "" {
			p.errorf(t, "otlp_endpoint", "%q: want the http(s) URL of an OTLP/HTTP receiver, e.g. \"http://127.0.0.1:4318\" (a collector, Jaeger, Tempo)", tr.OTLPEndpoint)
		}
	}
	if p.isSet(t, "sample_ratio") {
		before := len(p.errs)
		r := p.number(t, "sample_ratio")
		switch {
		case len(p.errs) > before:
		case r <= 0 || r > 1:
			p.errorf(t, "sample_ratio", "%v: want a share above 0 and at most 1 (1 records every trace)", r)
		default:
			tr.SampleRatio = r
		}
	}
	return tr
}
