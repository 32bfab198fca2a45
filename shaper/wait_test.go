package shaper

import (
	"context"
	"errors"
	"testing"
	"time"

	"github.com/shaper-dev/shaper/internal/redistest"
)

// TestWaited: Request.Waited hears of each wait at the gate with what
// held the call: a new bucket's state, a granted tick, a pause beyond the horizon (from the
// core script and from the full one), a spent quota, the in-flight cap.
func TestWaited(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	g := NewGate(redistest.Client(t), Config{KeyPrefix: redistest.Prefix(t)})
	ask := func(b *Bucket, maxWait time.Duration) ([]Wait, *Permit, error) {
		t.Helper()
		var ws []Wait
		// A guard against a hang, not a speed: a new bucket waits out
		// its horizon (about a second), longer on a busy machine.
		ctx, cancel := context.WithTimeout(ctx, 20*time.Second)
		defer cancel()
		p, err := b.Acquire(ctx, Request{MaxWait: maxWait, Waited: func(w Wait) { ws = append(ws, w) }})
		return ws, p, err
	}
	first := func(name string, ws []Wait, binding string, granted bool) {
		t.Helper()
		if len(ws) == 0 || ws[0].Binding != binding || ws[0].Granted != granted {
			t.Errorf("%s: waits %+v, want the first %s (granted %v)", name, ws, binding, granted)
		}
	}

	for _, full := range []bool{false, true} {
		b, err := g.Bucket("paused"+map[bool]string{false: "-core", true: "-full"}[full], Policy{Limits: []Limit{{Rate: 10, Window: time.Second}}})
		if err != nil {
			t.Fatal(err)
		}
		if full {
			b.core = false
		}
		ws, p, err := ask(b, 0)
		if err != nil || p == nil {
			t.Fatalf("first ask: %v", err)
		}
		// A state Redis never saw: its horizon is waited out, then a tick.
		first("a new bucket", ws, BoundReset, false)
		if last := ws[len(ws)-1]; !last.Granted {
			t.Errorf("a new bucket: waits %+v, want a granted tick last", ws)
		}
		ws, p, err = ask(b, 0)
		if err != nil || p == nil {
			t.Fatalf("second ask: %v", err)
		}
		first("the next tick", ws, BoundBacklog, true)
		if _, err := b.Control().Pause(ctx, 10*time.Second, "test"); err != nil {
			t.Fatal(err)
		}
		ws, p, err = ask(b, time.Second)
		var deferred *Wait
		if !errors.As(err, &deferred) || p != nil || deferred.Binding != BoundPause || deferred.For <= time.Second {
			t.Fatalf("ask in a pause: permit %v, %v; want none, and the pause's wait as a *Wait", p, err)
		}
		first("a pause", ws, BoundPause, false)
	}

	quota, err := g.Bucket("quota", Policy{Limits: []Limit{{Rate: 10, Window: time.Second}, {Rate: 2, Window: time.Hour}}})
	if err != nil {
		t.Fatal(err)
	}
	for range 2 {
		if _, p, err := ask(quota, 0); err != nil || p == nil {
			t.Fatalf("ask within the quota: %v", err)
		}
	}
	ws, p, err := ask(quota, time.Second)
	var deferred *Wait
	if !errors.As(err, &deferred) || p != nil || deferred.Binding != BoundQuota {
		t.Fatalf("ask past the quota: permit %v, %v; want none, and the quota's wait as a *Wait", p, err)
	}
	first("a spent quota", ws, BoundQuota, false)

	capped, err := g.Bucket("capped", Policy{Limits: []Limit{{Rate: 100, Window: time.Second}}, MaxInFlight: 1})
	if err != nil {
		t.Fatal(err)
	}
	if _, p, err := ask(capped, 0); err != nil || p == nil {
		t.Fatalf("first ask under the cap: %v", err)
	}
	ws, _, err = ask(capped, 0) // the first permit is never released: the cap holds it until ctx ends
	if !errors.Is(err, context.DeadlineExceeded) {
		t.Fatalf("ask at the cap: %v, want the deadline", err)
	}
	first("the in-flight cap", ws, BoundInFlight, false)
}
