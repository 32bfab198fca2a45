package config

import (
	"strings"
	"testing"
)

func TestTracingTable(t *testing.T) {
	cfg, err := Parse("c.toml", []byte("[tracing]\notlp_endpoint = \"http://127.0.0.1:4318\"\nservice_name = \"shaper-eu\"\nsample_ratio = 0.25\n"))
	if err != nil {
		t.Fatal(err)
	}
	if want := (Tracing{OTLPEndpoint: "http://127.0.0.1:4318", ServiceName: "shaper-eu", SampleRatio: 0.25}); cfg.Tracing != want {
		t.Errorf("tracing = %+v, want %+v", cfg.Tracing, want)
	}
	none, err := Parse("c.toml", []byte(""))
	if err != nil {
		t.Fatal(err)
	}
	if none.Tracing != (Tracing{}) {
		t.Errorf("no [tracing]: %+v, want off", none.Tracing)
	}

	for _, c := range []struct{ name, toml, want string }{
		{"relative endpoint", "[tracing]\notlp_endpoint = \"127.0.0.1:4318\"\n", "c.toml:2: invalid config: tracing.otlp_endpoint: \"127.0.0.1:4318\": want the http(s) URL of an OTLP/HTTP receiver"},
		{"grpc scheme", "[tracing]\notlp_endpoint = \"grpc://collector:4317\"\n", "tracing.otlp_endpoint: \"grpc://collector:4317\": want the http(s) URL"},
		{"ratio above 1", "[tracing]\nsample_ratio = 2\n", "c.toml:2: invalid config: tracing.sample_ratio: 2: want a share above 0 and at most 1"},
		{"ratio not a number", "[tracing]\nsample_ratio = \"all\"\n", "tracing.sample_ratio: all: want a number"},
		{"typo", "[tracing]\notlp_endpiont = \"http://h:4318\"\n", `c.toml:2: invalid config: tracing.otlp_endpiont: unknown key; did you mean "otlp_endpoint"?`},
		{"not a table", "tracing = true\n", "[tracing] must be a table"},
	} {
		_, err := Parse("c.toml", []byte(c.toml))
		if err == nil || !strings.Contains(err.Error(), c.want) {
			t.Errorf("%s: %v, want %q", c.name, err, c.want)
		}
	}
}
