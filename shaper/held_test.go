package shaper

import (
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/shaper-dev/shaper/internal/redistest"
)

// TestHeldRecord drives the record of held calls on simulated Redis
// time: each grant of a call with a holder records it under the grant's
// replica and tick in the same round trip; HeldBy returns a replica's
// calls whose tick is after a moment, and no other replica's; entries
// leave heldKeep after their tick, whatever the traffic, and on Release.
func TestHeldRecord(t *testing.T) {
	addr, prefix := redistest.Addr(t), redistest.Prefix(t)
	a, b := newReplica(t, addr, prefix, nil), newReplica(t, addr, prefix, nil)
	clk := fakeRedisTime(a.gate, testEpoch)
	b.gate.testNow = clk.now
	p := Policy{Limits: []Limit{{Rate: 10, Window: time.Second}}}
	ba, err := a.gate.Bucket("held", p)
	if err != nil {
		t.Fatal(err)
	}
	bb, err := b.gate.Bucket("held", p)
	if err != nil {
		t.Fatal(err)
	}
	ctx := context.Background()
	grant := func(bk *Bucket, h string) int64 {
		t.Helper()
		for range 3 { // the first use waits out the horizon (the state is new)
			r, err := bk.reserve(ctx, Request{Holder: h})
			if err != nil {
				t.Fatal(err)
			}
			if r.ok {
				return r.tick
			}
			clk.advance(r.wait)
		}
		t.Fatalf("%s: no tick granted", h)
		return 0
	}
	ticks := map[string]int64{}
	for i := range 6 {
		bk, name := ba, "a"
		if i%2 == 1 {
			bk, name = bb, "b"
		}
		h := fmt.Sprintf("vendor:held|%s%d", name, i)
		ticks[h] = grant(bk, h)
	}
	// a's calls are ticks 0, 2 and 4 (100 ms apart): after tick 1, 2 and 4.
	got, err := ba.Holds().HeldBy(ctx, a.gate.replica, time.UnixMicro(ticks["vendor:held|b1"]))
	if err != nil {
		t.Fatal(err)
	}
	if fmt.Sprint(got) != "[vendor:held|a2 vendor:held|a4]" {
		t.Errorf("HeldBy(a, after tick 1) = %v, want a2 and a4", got)
	}
	if got, _ := ba.Holds().HeldBy(ctx, b.gate.replica, time.UnixMicro(0)); fmt.Sprint(got) != "[vendor:held|b1 vendor:held|b3 vendor:held|b5]" {
		t.Errorf("HeldBy(b) = %v, want b's calls only", got)
	}
	if err := ba.Holds().Release(ctx, a.gate.replica, "vendor:held|a2"); err != nil {
		t.Fatal(err)
	}
	if got, _ := ba.Holds().HeldBy(ctx, a.gate.replica, time.UnixMicro(0)); fmt.Sprint(got) != "[vendor:held|a0 vendor:held|a4]" {
		t.Errorf("after Release(a2): %v", got)
	}
	// heldKeep after the last tick, one more grant trims everything older.
	clk.set(ticks["vendor:held|b5"] + heldKeep.Microseconds() + 1)
	grant(ba, "vendor:held|late")
	n, err := a.rdb.ZCard(ctx, ba.keys.held).Result()
	if err != nil || n != 1 {
		t.Errorf("the record holds %d entries (%v) heldKeep after the last tick, want 1 (the new one)", n, err)
	}
	// A call without a holder is not recorded.
	grant(ba, "")
	if n, _ := a.rdb.ZCard(ctx, ba.keys.held).Result(); n != 1 {
		t.Errorf("a call without a holder was recorded: %d entries", n)
	}
}

// TestAliveAndSilent: a replica that says it is alive is not silent; one
// silent for d is, with when it was last heard; one that left is not
// listed; a replica never lists itself.
func TestAliveAndSilent(t *testing.T) {
	addr, prefix := redistest.Addr(t), redistest.Prefix(t)
	a, b, c := newReplica(t, addr, prefix, nil), newReplica(t, addr, prefix, nil), newReplica(t, addr, prefix, nil)
	clk := fakeRedisTime(a.gate, testEpoch)
	b.gate.testNow, c.gate.testNow = clk.now, clk.now
	ctx := context.Background()
	for _, r := range []*replica{a, b, c} {
		if _, err := r.gate.Alive(ctx); err != nil {
			t.Fatal(err)
		}
	}
	clk.advance(2 * time.Second)
	now, err := a.gate.Alive(ctx)
	if err != nil || now.UnixMicro() != clk.now() {
		t.Fatalf("Alive = %v, %v; want the Redis time", now, err)
	}
	if s, err := a.gate.Silent(ctx, now, 3*time.Second); err != nil || len(s) != 0 {
		t.Fatalf("Silent after 2 s = %v, %v; want none", s, err)
	}
	if err := c.gate.Leave(ctx); err != nil {
		t.Fatal(err)
	}
	clk.advance(2 * time.Second)
	now, _ = a.gate.Alive(ctx)
	s, err := a.gate.Silent(ctx, now, 3*time.Second)
	if err != nil || len(s) != 1 || s[0].Replica != b.gate.replica || s[0].LastSeen.UnixMicro() != testEpoch {
		t.Fatalf("Silent after 4 s = %+v, %v; want b, last seen at the start (c left, a is itself)", s, err)
	}
	clk.advance(aliveForget)
	now, _ = a.gate.Alive(ctx)
	if s, _ := a.gate.Silent(ctx, now, 3*time.Second); len(s) != 0 {
		t.Errorf("Silent after aliveForget = %+v, want b forgotten", s)
	}
}
