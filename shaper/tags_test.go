package shaper

import (
	"context"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

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
	// tagKeep after the last tick, the record holds only the new one.
	clk.set(ticks["w|vendor:tags|t5"] + tagKeep.Microseconds() + 1)
	late := grant(ba, "w|vendor:tags|late")
	want := fmt.Sprint([]string{fmt.Sprintf("w|vendor:tags|late@%d", late)})
	if got := tagged(0); got != want {
		t.Errorf("tagKeep after the last tick the record holds %s, want %s (the new one)", got, want)
	}
	// A call without a tag is not recorded.
	grant(ba, "")
	if got := tagged(0); got != want {
		t.Errorf("after a call without a tag the record holds %s, want %s", got, want)
	}
	// A group of one keeps its record in its ticks list (layout 4): a
	// layout-3 worker reading it as the set it knew gets an error, and
	// its recover falls back on asynq's lease.
	if err := a.rdb.ZRangeArgs(ctx, redis.ZRangeArgs{Key: ba.keys.tags, Start: "-inf", Stop: "+inf", ByScore: true}).Err(); err == nil || !strings.Contains(err.Error(), "WRONGTYPE") {
		t.Errorf("the tags key read as a sorted set: %v, want WRONGTYPE", err)
	}
}

// countedTicks is the judge's view of a ticks list: the ticks of its
// items that count as sent (tick_of), newest first.
var countedTicks = redis.NewScript(formLua + heldLua + itemLua + `
local out = {}
for _, item in ipairs(redis.call('LRANGE', KEYS[1], 0, -1)) do
  local t = tick_of(item)
  if t then out[#out + 1] = string.format('%d', t) end
end
return out
`)

// TestTagRecordKeepsItsHalfMinute: a group of one keeps its holders'
// tags in its ticks list (layout 4), which must still hold every tag of
// the last tagKeep whatever the rate (recover reads 30 s back), and no
// more than that and the judge's ticks: 45 s of tagged grants at 100/s,
// each call at its tick, in simulated time.
func TestTagRecordKeepsItsHalfMinute(t *testing.T) {
	rdb, g, clk, _ := layoutGate(t)
	ctx := context.Background()
	b, err := g.Bucket("busy", Policy{Limits: []Limit{{Rate: 100, Window: time.Second}}, Horizon: 100 * time.Millisecond})
	if err != nil {
		t.Fatal(err)
	}
	type grant struct {
		tag  string
		tick int64
	}
	var granted []grant
	end := clk.now() + (45 * time.Second).Microseconds()
	for i := 0; clk.now() < end; {
		tag := fmt.Sprintf("w|vendor:busy|t%d", i)
		r, err := b.reserve(ctx, Request{Tag: tag})
		if err != nil {
			t.Fatal(err)
		}
		clk.advance(r.wait)
		if r.ok {
			granted = append(granted, grant{tag, r.tick})
			i++
		}
	}
	now := clk.now()
	var inKeep int64
	for _, gr := range granted {
		if gr.tick > now-tagKeep.Microseconds() {
			inKeep++
		}
	}
	n, err := rdb.LLen(ctx, b.keys.ticks).Result()
	if err != nil {
		t.Fatal(err)
	}
	t.Logf("%d grants, %d in the last %v; the list holds %d", len(granted), inKeep, tagKeep, n)
	if most := int64(b.tickLog()) + inKeep + 2*tickTrim; n > most {
		t.Errorf("the ticks list holds %d items, more than the judge's %d and the %d grants of the last %v (+%d)", n, b.tickLog(), inKeep, tagKeep, 2*tickTrim)
	}
	after := now - (tagKeep - time.Second).Microseconds()
	got, err := b.tagged(ctx, time.UnixMicro(after))
	if err != nil {
		t.Fatal(err)
	}
	var want []string
	for _, gr := range granted {
		if gr.tick > after {
			want = append(want, fmt.Sprintf("%s@%d", gr.tag, gr.tick))
		}
	}
	var have []string
	for _, tg := range got {
		have = append(have, fmt.Sprintf("%s@%d", tg.Tag, tg.Tick.UnixMicro()))
	}
	if fmt.Sprint(have) != fmt.Sprint(want) {
		t.Errorf("Tagged(%v ago) holds %d tags, want the %d granted since", tagKeep-time.Second, len(have), len(want))
	}
	judged, err := countedTicks.Run(ctx, rdb, []string{b.keys.ticks}).StringSlice()
	if err != nil {
		t.Fatal(err)
	}
	if len(judged) < b.tickLog() {
		t.Errorf("the judge sees %d ticks, want at least %d", len(judged), b.tickLog())
	}
}

// TestGiveUpKeepsTheHoldersRecord: a tick given up (or refused) leaves
// the judge's view of the ticks list, while the record of its holder's
// tag stays, as the sorted set of tags kept it: recover takes the call
// for granted (the safe side) until the record expires.
func TestGiveUpKeepsTheHoldersRecord(t *testing.T) {
	rdb, g, clk, _ := layoutGate(t)
	ctx := context.Background()
	b, err := g.Bucket("gives", Policy{Limits: []Limit{{Rate: 10, Window: time.Second}}, Horizon: time.Second})
	if err != nil {
		t.Fatal(err)
	}
	rs := grantTagged(t, b, clk, 3, "w|vendor:gives|t")
	if err := b.giveUp(ctx, rs[1].lease, gaveUpLate, rs[1].tick, 1, rs[1].tag); err != nil {
		t.Fatal(err)
	}
	judged, err := countedTicks.Run(ctx, rdb, []string{b.keys.ticks}).StringSlice()
	if err != nil {
		t.Fatal(err)
	}
	want := fmt.Sprint([]string{fmt.Sprint(rs[2].tick), fmt.Sprint(rs[0].tick)})
	if fmt.Sprint(judged) != want {
		t.Errorf("the judge sees ticks %v after the second was given up, want %s", judged, want)
	}
	got, err := b.tagged(ctx, time.Time{})
	if err != nil {
		t.Fatal(err)
	}
	var have []string
	for _, tg := range got {
		have = append(have, fmt.Sprintf("%s@%d", tg.Tag, tg.Tick.UnixMicro()))
	}
	var wantTags []string
	for i, r := range rs {
		wantTags = append(wantTags, fmt.Sprintf("w|vendor:gives|t%d@%d", i, r.tick))
	}
	if fmt.Sprint(have) != fmt.Sprint(wantTags) {
		t.Errorf("the record after a give-up holds %v, want %v", have, wantTags)
	}
}

// grantTagged grants n calls of b tagged prefix0, prefix1, ..., waiting
// out each deferral in simulated time, and returns their reservations.
func grantTagged(t *testing.T, b *Bucket, clk *redisClock, n int, prefix string) []reservation {
	t.Helper()
	var rs []reservation
	for len(rs) < n {
		r, err := b.reserve(context.Background(), Request{Tag: fmt.Sprintf("%s%d", prefix, len(rs))})
		if err != nil {
			t.Fatal(err)
		}
		if !r.ok {
			clk.advance(r.wait)
			continue
		}
		rs = append(rs, r)
	}
	return rs
}
