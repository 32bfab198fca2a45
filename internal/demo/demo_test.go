package demo

import (
	"bytes"
	"context"
	"strings"
	"testing"
	"time"

	"github.com/shaper-dev/shaper/internal/vendorsim"
)

// TestDemo runs the demo small: 150 calls at 50/s take shaper about 4 s.
// The token bucket per worker (3 x 50 tokens, more than the 150 calls) sends
// every call in its first second, so it overfills a vendor window and gets
// 429s wherever the window's phase falls; its rescheduled calls then wait
// on asynq's whole-second schedule (about 11 s), so the run stops at the
// 7 s timeout and the verdict may show it "not done": the test asserts on
// its 429s, not on its end.
func TestDemo(t *testing.T) {
	const calls, rate = 150, 50
	var out bytes.Buffer
	v, err := Run(context.Background(), &out, Options{Calls: calls, Rate: rate, Window: time.Second, Workers: 3, Timeout: 7 * time.Second})
	if err != nil {
		t.Fatal(err)
	}
	t.Log("\n" + out.String())
	shaped, naive := v[0], v[1]
	if shaped.Done != calls || shaped.RateLimited != 0 || shaped.MaxPerWindow > rate {
		t.Errorf("shaper: %+v; want every call done, no 429, at most 50 per window", shaped)
	}
	if naive.RateLimited == 0 || naive.MaxPerWindow <= rate {
		t.Errorf("the token bucket per worker got no 429s (%+v): the comparison shows nothing", naive)
	}
	if !strings.Contains(out.String(), "APPROACH") || !strings.Contains(out.String(), "token bucket per worker") {
		t.Errorf("no verdict table:\n%s", out.String())
	}
}

// TestStopWhy: the demo stops once both are done, or once shaper is and
// the alternative has broken the limit and had Settle more; not before.
func TestStopWhy(t *testing.T) {
	o := Options{Calls: 1000, Rate: 50, Settle: 3 * time.Second}
	broke := vendorsim.Summary{DistinctKeys: 260, RateLimited: 166, MaxPerWindow: 160}
	clean := vendorsim.Summary{DistinctKeys: 900, MaxPerWindow: 50}
	s := time.Second
	for _, c := range []struct {
		el, shaped, naive time.Duration
		sum               vendorsim.Summary
		stop              bool
	}{
		{10 * s, 0, 0, broke, false},          // shaper not done
		{22 * s, 21 * s, 0, broke, false},     // shaper just done: Settle first
		{24 * s, 21 * s, 0, broke, true},      // the verdict is clear
		{24 * s, 21 * s, 0, clean, false},     // the alternative keeps the limit: let it finish
		{25 * s, 21 * s, 25 * s, clean, true}, // both done
	} {
		why := stopWhy(o, c.el, c.shaped, c.naive, c.sum)
		if (why != "") != c.stop {
			t.Errorf("at %v (shaper done %v, token bucket done %v, %+v): stop %q, want stop %v", c.el, c.shaped, c.naive, c.sum, why, c.stop)
		}
	}
}
