package shaper

import (
	"context"
	"errors"
	"testing"
	"time"

	"github.com/shaper-dev/shaper/internal/redistest"
)

// TestBackloggedKeepsItsPlace, in simulated time: a call whose place in a
// backlog is beyond MaxWait keeps it when the caller says so
// (Request.Backlogged: told once, then the call waits and is granted the
// first tick after the calls ahead), and is returned without a permit when
// it does not; a pause or a spent quota beyond MaxWait is returned either
// way, since waiting through it is what MaxWait bounds.
func TestBackloggedKeepsItsPlace(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	bucket := func(t *testing.T, p Policy) (*Bucket, *redisClock) {
		clk := &redisClock{}
		clk.set(testEpoch)
		r := newReplica(t, redistest.Addr(t), redistest.Prefix(t), virtualClock{clk})
		r.gate.testNow = clk.now
		b, err := r.gate.Bucket("acme", p)
		if err != nil {
			t.Fatal(err)
		}
		return b, clk
	}
	setup := func(t *testing.T, p Policy) (*Bucket, *redisClock) {
		b, clk := bucket(t, p)
		// The state made anew waits out the horizon; then the ticks up to
		// the horizon go to ten calls and thirty more are told to come
		// back one tick apart: a backlog of four seconds.
		grantTicks(t, b, clk, 1)
		for range 39 {
			reserveOnce(t, b)
		}
		return b, clk
	}
	p := Policy{Limits: []Limit{{Rate: 10, Window: time.Second}}}
	const maxWait = time.Second
	// acquire asks for a call of b under req and returns the wait of the
	// deferral Acquire returned (a *Wait), if any.
	acquire := func(b *Bucket, req Request) (*Permit, time.Duration, error) {
		permit, err := b.Acquire(ctx, req)
		var w *Wait
		if errors.As(err, &w) {
			return permit, w.For, nil
		}
		return permit, 0, err
	}

	t.Run("sent back without Backlogged", func(t *testing.T) {
		b, _ := setup(t, p)
		permit, wait, err := acquire(b, Request{MaxWait: maxWait})
		if err != nil || permit != nil || wait <= maxWait {
			t.Fatalf("Acquire = %v, %v, %v; want no permit and a wait beyond %v", permit, wait, err, maxWait)
		}
	})
	t.Run("keeps its place with Backlogged", func(t *testing.T) {
		b, clk := setup(t, p)
		var told []time.Duration
		asked := clk.now()
		permit, wait, err := acquire(b, Request{MaxWait: maxWait, Backlogged: func(d time.Duration) { told = append(told, d) }})
		if err != nil || permit == nil || wait != 0 {
			t.Fatalf("Acquire = %v, %v, %v; want a permit", permit, wait, err)
		}
		if len(told) != 1 || told[0] <= maxWait {
			t.Errorf("Backlogged told %v; want once, a wait beyond %v", told, maxWait)
		}
		// Behind the 10 granted and the 30 told to come back before it:
		// its tick is the 41st, 4 s after the first.
		if got := time.Duration(permit.at-asked) * time.Microsecond; got < 3900*time.Millisecond || got > 4200*time.Millisecond {
			t.Errorf("the call's tick came %v after it asked; want about 4s (its place behind 40 calls at 10/s)", got)
		}
	})
	t.Run("a pause is returned", func(t *testing.T) {
		b, _ := setup(t, p)
		if _, err := b.Control().Pause(ctx, 30*time.Second, "429 Retry-After: 30"); err != nil {
			t.Fatal(err)
		}
		called := false
		permit, wait, err := acquire(b, Request{MaxWait: maxWait, Backlogged: func(time.Duration) { called = true }})
		if err != nil || permit != nil || wait < 25*time.Second || called {
			t.Fatalf("Acquire = %v, %v, %v (Backlogged told: %v); want no permit, the pause's wait, Backlogged not told", permit, wait, err, called)
		}
	})
	t.Run("a spent quota is returned", func(t *testing.T) {
		q := Policy{Limits: []Limit{{Rate: 10, Window: time.Second}, {Rate: 5, Window: time.Hour}}}
		b, clk := bucket(t, q)
		grantTicks(t, b, clk, 5)
		called := false
		permit, wait, err := acquire(b, Request{MaxWait: maxWait, Backlogged: func(time.Duration) { called = true }})
		if err != nil || permit != nil || wait < 50*time.Minute || called {
			t.Fatalf("Acquire = %v, %v, %v (Backlogged told: %v); want no permit, the quota's wait, Backlogged not told", permit, wait, err, called)
		}
	})
}
