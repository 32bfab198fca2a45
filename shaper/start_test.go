package shaper

import (
	"context"
	"testing"
	"time"

	"github.com/shaper-dev/shaper/internal/redistest"
)

// TestStartStamp: the start script lets a call start at once when the
// start before it is at least the gap behind, tells it how long to wait
// when that start came late (so a late start moves the next one), and
// says give up when the wait is longer than the call may wait, stamping
// nothing then; the stamp expires a window after the start. Redis time
// is the test's own.
func TestStartStamp(t *testing.T) {
	ctx := context.Background()
	r := newReplica(t, redistest.Addr(t), redistest.Prefix(t), systemClock{})
	clk := fakeRedisTime(r.gate, 1_800_000_000_000_000)
	b, err := r.gate.Bucket("stamped", Policy{Limits: []Limit{{Rate: 100, Window: time.Second}}, StrictSpacing: true})
	if err != nil {
		t.Fatal(err)
	}
	const gap, tol = 10750 * time.Microsecond, 3 * time.Millisecond
	// strict_spacing without a guard: the margin's cap (a tenth of the
	// window) and the tolerance a margin lesson sets; every call stamped.
	if iv, _, guard, tolerance := b.spacing(); guard != 100*time.Millisecond || tolerance != tol || iv != 11*time.Millisecond {
		t.Errorf("strict_spacing: interval %s, guard %s, tolerance %s; want 11ms, 100ms, 3ms", iv, guard, tolerance)
	}
	if g := b.startGap(reservation{}); g != gap {
		t.Errorf("strict_spacing's start gap %s, want %s", g, gap)
	}
	stamp := func(wait time.Duration) (time.Duration, bool) {
		t.Helper()
		d, ok, err := b.stampStart(ctx, gap, wait)
		if err != nil {
			t.Fatal(err)
		}
		return d, ok
	}
	if d, ok := stamp(tol); !ok || d != 0 {
		t.Fatalf("the first start: wait %s (%v), want 0", d, ok)
	}
	clk.advance(11 * time.Millisecond) // on time
	if d, ok := stamp(tol); !ok || d != 0 {
		t.Fatalf("a start 11 ms after the last: wait %s (%v), want 0", d, ok)
	}
	clk.advance(9 * time.Millisecond) // the one before started 2 ms late
	if d, ok := stamp(tol); !ok || d != gap-9*time.Millisecond {
		t.Fatalf("a start 9 ms after the last: wait %s (%v), want %s", d, ok, gap-9*time.Millisecond)
	}
	// The last start is now 1.75 ms ahead of the clock: a call 5 ms
	// after the clock must wait 7.5 ms, more than its tolerance.
	clk.advance(5 * time.Millisecond)
	if d, ok := stamp(tol); ok {
		t.Fatalf("a wait of 7.5 ms allowed with a tolerance of 3 ms (told %s)", d)
	}
	// Nothing was stamped by the call that gave up: the next one waits
	// for the same start.
	if d, ok := stamp(10 * time.Millisecond); !ok || d != 7500*time.Microsecond {
		t.Fatalf("after a give-up: wait %s (%v), want 7.5ms", d, ok)
	}
	ttl, err := r.rdb.PTTL(ctx, b.keys.start).Result()
	if err != nil {
		t.Fatal(err)
	}
	if ttl <= 0 || ttl > time.Second+10*time.Millisecond {
		t.Errorf("the stamp lives %s, want about a window past the start", ttl)
	}
	// The start gap: the spacing and three quarters of the guard's share.
	if g := startGap(11*time.Millisecond, 10*time.Millisecond); g != gap {
		t.Errorf("startGap(11ms, 10ms) = %s, want %s", g, gap)
	}
	if g := startGap(10*time.Millisecond, 10*time.Millisecond); g != 10*time.Millisecond {
		t.Errorf("startGap with no guard = %s, want the spacing", g)
	}
}
