package queue

import (
	"context"
	"testing"
	"time"

	"github.com/shaper-dev/shaper/internal/redistest"
)

// TestAliveAndSilent, on simulated Redis time: a worker that says it is
// alive is not silent; one silent for d is, with when it was last heard;
// one that left is not listed; a worker never lists itself; one silent
// for aliveForget is forgotten.
func TestAliveAndSilent(t *testing.T) {
	rdb := redistest.Client(t)
	prefix := redistest.Prefix(t)
	now := time.Now().UnixMicro()
	clock := func() int64 { return now }
	advance := func(d time.Duration) { now += d.Microseconds() }
	var ls []*liveness
	for _, id := range []string{"a", "b", "c"} {
		l := newLiveness(rdb, prefix, id)
		l.now = clock
		ls = append(ls, l)
	}
	a, b, c := ls[0], ls[1], ls[2]
	ctx := context.Background()
	start := now
	for _, l := range ls {
		if _, err := l.alive(ctx); err != nil {
			t.Fatal(err)
		}
	}
	advance(2 * time.Second)
	at, err := a.alive(ctx)
	if err != nil || at.UnixMicro() != now {
		t.Fatalf("alive = %v, %v; want the Redis time", at, err)
	}
	if s, err := a.silent(ctx, at, 3*time.Second); err != nil || len(s) != 0 {
		t.Fatalf("silent after 2 s = %v, %v; want none", s, err)
	}
	if err := c.leave(ctx); err != nil {
		t.Fatal(err)
	}
	advance(2 * time.Second)
	at, _ = a.alive(ctx)
	s, err := a.silent(ctx, at, 3*time.Second)
	if err != nil || len(s) != 1 || s[0].worker != b.worker || s[0].lastSeen.UnixMicro() != start {
		t.Fatalf("silent after 4 s = %+v, %v; want b, last heard at the start (c left, a is itself)", s, err)
	}
	advance(aliveForget)
	at, _ = a.alive(ctx)
	if s, _ := a.silent(ctx, at, 3*time.Second); len(s) != 0 {
		t.Errorf("silent after aliveForget = %+v, want b forgotten", s)
	}
}
