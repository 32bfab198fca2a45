package demo

import (
	"bytes"
	"context"
	"strings"
	"testing"
	"time"
)

func TestDemo(t *testing.T) {
	var out bytes.Buffer
	v, err := Run(context.Background(), &out, Options{Calls: 150, Rate: 50, Window: time.Second, Workers: 3, Timeout: 12 * time.Second})
	if err != nil {
		t.Fatal(err)
	}
	t.Log("\n" + out.String())
	shaped, naive := v[0], v[1]
	if shaped.Done != 150 || shaped.Throttled != 0 || shaped.MaxPerWindow > 50 {
		t.Errorf("shaper: %+v; want every call done, no 429, at most 50 per window", shaped)
	}
	if naive.Throttled == 0 || naive.MaxPerWindow <= 50 {
		t.Errorf("the token bucket per worker got no 429s (%+v): the comparison shows nothing", naive)
	}
	if !strings.Contains(out.String(), "APPROACH") || !strings.Contains(out.String(), "token bucket per worker") {
		t.Errorf("no verdict table:\n%s", out.String())
	}
}
