package shaper

import (
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/shaper-dev/shaper/internal/redistest"
)

// TestTagRecord drives the record of tags on simulated Redis time: each
// grant of a call with a tag records it with the grant's tick in the same
// round trip, whichever replica grants it; Tagged returns the tags whose
// tick is after a moment, oldest first; entries leave tagKeep after their
// tick, whatever the traffic, and on Untag; a call without a tag is not
// recorded.
func TestTagRecord(t *testing.T) {
	addr, prefix := redistest.Addr(t), redistest.Prefix(t)
	a, b := newReplica(t, addr, prefix, nil), newReplica(t, addr, prefix, nil)
	clk := fakeRedisTime(a.gate, testEpoch)
	b.gate.testNow = clk.now
	p := Policy{Limits: []Limit{{Rate: 10, Window: time.Second}}}
	ba, err := a.gate.Bucket("tags", p)
	if err != nil {
		t.Fatal(err)
	}
	bb, err := b.gate.Bucket("tags", p)
	if err != nil {
		t.Fatal(err)
	}
	ctx := context.Background()
	grant := func(bk *Bucket, tag string) int64 {
		t.Helper()
		for range 3 { // the first use waits out the horizon (the state is new)
			r, err := bk.reserve(ctx, Request{Tag: tag})
			if err != nil {
				t.Fatal(err)
			}
			if r.ok {
				return r.tick
			}
			clk.advance(r.wait)
		}
		t.Fatalf("%s: no tick granted", tag)
		return 0
	}
	tagged := func(after int64) string {
		t.Helper()
		got, err := ba.tagged(ctx, time.UnixMicro(after))
		if err != nil {
			t.Fatal(err)
		}
		var s []string
		for _, g := range got {
			s = append(s, fmt.Sprintf("%s@%d", g.Tag, g.Tick.UnixMicro()))
		}
		return fmt.Sprint(s)
	}
	ticks := map[string]int64{}
	for i := range 6 {
		bk := ba
		if i%2 == 1 {
			bk = bb
		}
		tag := fmt.Sprintf("w|vendor:tags|t%d", i)
		ticks[tag] = grant(bk, tag)
	}
	at := func(i int) string {
		tag := fmt.Sprintf("w|vendor:tags|t%d", i)
		return fmt.Sprintf("%s@%d", tag, ticks[tag])
	}
	if got, want := tagged(ticks["w|vendor:tags|t3"]), fmt.Sprint([]string{at(4), at(5)}); got != want {
		t.Errorf("Tagged(after tick 3) = %s, want %s", got, want)
	}
	if err := bb.untag(ctx, "w|vendor:tags|t4", "w|vendor:tags|t1"); err != nil {
		t.Fatal(err)
	}
	if got, want := tagged(0), fmt.Sprint([]string{at(0), at(2), at(3), at(5)}); got != want {
		t.Errorf("after Untag(t4, t1): %s, want %s", got, want)
	}
	// tagKeep after the last tick, one more grant trims everything older.
	clk.set(ticks["w|vendor:tags|t5"] + tagKeep.Microseconds() + 1)
	grant(ba, "w|vendor:tags|late")
	n, err := a.rdb.ZCard(ctx, ba.keys.tags).Result()
	if err != nil || n != 1 {
		t.Errorf("the record holds %d entries (%v) tagKeep after the last tick, want 1 (the new one)", n, err)
	}
	// A call without a tag is not recorded.
	grant(ba, "")
	if n, _ := a.rdb.ZCard(ctx, ba.keys.tags).Result(); n != 1 {
		t.Errorf("a call without a tag was recorded: %d entries", n)
	}
}
