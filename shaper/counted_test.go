package shaper

import (
	"context"
	"encoding/binary"
	"fmt"
	"math"
	"math/rand/v2"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/shaper-dev/shaper/internal/redistest"
)

// TestCountedMatchesFull drives buckets the counted script serves —
// accounts of a group with a total (a ring of slots or a line of ticks),
// with quotas, a bucket of its own with a quota, one with a spread limit
// beside its quota, and a group of one with a total — and the same
// buckets held to the full script, through the same simulated Redis
// time: steady grants, idle gaps, crowds deferred beyond the horizon,
// quotas spent, and what the counted script hands over (pauses, a rate
// set, a high call, a costly call). Both must answer every call alike,
// record the same tags and leave the same state, and the counted script
// must have served most calls.
func TestCountedMatchesFull(t *testing.T) { countedMatchesFull(t, redistest.Client(t), 2000) }

// TestCountedMatchesFullOnEmbeddedRedis is the same on the embedded Redis.
func TestCountedMatchesFullOnEmbeddedRedis(t *testing.T) {
	countedMatchesFull(t, embeddedClient(t), 400)
}

func countedMatchesFull(t *testing.T, rdb *redis.Client, steps int) {
	ctx := context.Background()
	prefix := redistest.Prefix(t)
	now, err := rdb.Time(ctx).Result()
	if err != nil {
		t.Fatal(err)
	}
	// Redis time and the gates' clocks move together, simulated: a
	// bucket handed to the full script stays with it for fullFor of
	// this time.
	clk := &redisClock{}
	clk.set(now.UnixMicro())
	lean := NewGate(rdb, Config{KeyPrefix: prefix + "c", Replica: "r1", Clock: virtualClock{clk}})
	full := NewGate(rdb, Config{KeyPrefix: prefix + "f", Replica: "r1", Clock: virtualClock{clk}})
	lean.testNow, full.testNow = clk.now, clk.now
	runs := map[string]int{}
	lean.testScript = func(kind string) { runs[kind]++ }

	// Each shape on both gates: [0] served by the counted script, [1]
	// held to the full one.
	account := Policy{Limits: []Limit{{Rate: 5, Window: time.Second}, {Rate: 12, Window: 10 * time.Second}}, Horizon: 300 * time.Millisecond}
	plain := Policy{Limits: []Limit{{Rate: 20, Window: time.Second}, {Rate: 30, Window: 10 * time.Second}}, Horizon: 200 * time.Millisecond}
	ring := &Policy{Limits: []Limit{{Rate: 12, Window: time.Second}}}                                                 // burst 1: a ring of slots
	line := &Policy{Limits: []Limit{{Rate: 12, Window: time.Second}, {Rate: 25, Window: 10 * time.Second}}, Burst: 3} // a line, and a quota on the total
	spread := Policy{Limits: []Limit{{Rate: 10, Window: 100 * time.Millisecond}, {Rate: 50, Window: time.Second, Spread: true},
		{Rate: 30, Window: 10 * time.Second}}, Horizon: 200 * time.Millisecond}
	var buckets [][2]*Bucket
	for gi, g := range []*Gate{lean, full} {
		k := 0
		add := func(b *Bucket, err error) {
			t.Helper()
			if err != nil {
				t.Fatal(err)
			}
			if gi == 0 {
				if !b.counted || b.core {
					t.Fatalf("bucket %s: counted %v, core %v; want the counted script's shape", b.name, b.counted, b.core)
				}
				buckets = append(buckets, [2]*Bucket{b})
			} else {
				b.counted = false
				buckets[k][1] = b
			}
			k++
		}
		for _, total := range []*Policy{ring, line} {
			grp, err := g.Group(fmt.Sprintf("vendor-%d", len(total.Limits)), total)
			if err != nil {
				t.Fatal(err)
			}
			for a := range 3 {
				add(grp.Bucket(fmt.Sprintf("store-%d", a), account))
			}
		}
		add(g.Bucket("own", plain))
		// A spread limit (spaced, not counted) beside a quota, and a group
		// of one with a total (no member: no fair share).
		add(g.Bucket("spread", spread))
		solo, err := g.Group("solo", ring)
		if err != nil {
			t.Fatal(err)
		}
		add(solo.bucket("", plain))
	}

	rng := rand.New(rand.NewPCG(29, 1))
	step := 0
	call := func(pair [2]*Bucket, req Request) reservation {
		t.Helper()
		var rs [2]reservation
		for i, b := range pair {
			r, err := b.reserve(ctx, req)
			if err != nil {
				t.Fatal(err)
			}
			rs[i] = r
		}
		if a, b := rs[0], rs[1]; a.ok != b.ok || a.wait != b.wait || a.reason != b.reason || a.tick != b.tick || a.tolerance != b.tolerance {
			t.Fatalf("step %d, %s (%+v): the counted script answered %+v, the full one %+v", step, pair[0].name, req, a, b)
		}
		return rs[0]
	}
	for ; step < steps; step++ {
		pair := buckets[rng.IntN(len(buckets))]
		both := func(f func(b *Bucket) error) {
			t.Helper()
			for _, b := range pair {
				if err := f(b); err != nil {
					t.Fatal(err)
				}
			}
		}
		req := Request{Tag: fmt.Sprintf("w|q|task-%d", step)}
		switch rng.IntN(120) {
		case 0:
			d := time.Duration(rng.IntN(500)) * time.Millisecond
			both(func(b *Bucket) error { _, err := b.Control().Pause(ctx, d, "test"); return err })
		case 1:
			r := 2 + float64(rng.IntN(4))
			both(func(b *Bucket) error { return b.Control().overrideRate(ctx, r, "test") })
		case 2:
			both(func(b *Bucket) error { return b.Control().clearRate(ctx) })
		case 3:
			clk.advance(time.Duration(rng.IntN(4000)) * time.Millisecond) // idle
		case 4:
			req.Lane = High
		case 5:
			req.Cost = 2
		}
		r := call(pair, req)
		// Some callers come back at once (a crowd), others when told.
		if rng.IntN(3) > 0 {
			clk.advance(min(r.wait, time.Second)/time.Duration(1+rng.IntN(3)) + time.Duration(rng.IntN(20))*time.Millisecond)
		}
	}
	for _, pair := range buckets {
		sameTags(t, "counted", pair[0], pair[1])
	}
	// And leave the same state: each bucket's line, pace, log and
	// deferral, its counters, and its group's total.
	for _, pair := range buckets {
		var gates [2][]any
		var counts [2]map[string]string
		var totals [2][]any
		for i, b := range pair {
			if gates[i], err = rdb.HMGet(ctx, b.keys.gate, "line", "vt", "log", "defer_at", "run", "wide").Result(); err != nil {
				t.Fatal(err)
			}
			if counts[i], err = rdb.HGetAll(ctx, b.keys.counts).Result(); err != nil {
				t.Fatal(err)
			}
			totals[i] = totalNumbers(t, rdb, b.keys.total, "last", "n", "blocked", "cleared", "share")
		}
		if fmt.Sprint(gates[0]) != fmt.Sprint(gates[1]) {
			t.Errorf("%s: gate hash %q after the counted script, %q after the full one", pair[0].name, gates[0], gates[1])
		}
		if fmt.Sprint(counts[0]) != fmt.Sprint(counts[1]) {
			t.Errorf("%s: counters %v after the counted script, %v after the full one", pair[0].name, counts[0], counts[1])
		}
		if fmt.Sprint(totals[0]) != fmt.Sprint(totals[1]) {
			t.Errorf("%s: total %v after the counted script, %v after the full one", pair[0].name, totals[0], totals[1])
		}
	}
	if runs["counted"] < steps/2 {
		t.Errorf("the counted script served %d of %d calls (the full one %d)", runs["counted"], steps, runs["full"])
	}
	t.Logf("counted script %d runs, full script %d", runs["counted"], runs["full"])
}

// TestNewAccountStaysLean: an account's first grant finds no state and
// hands the call to the full grant (needState), which writes it; its
// next grant is the counted one again. Before, any handover held the
// bucket on the full grant for fullFor (a second): a per-account
// vendor's new or expired accounts ran their first calls on the full
// grant, 16.6 Redis commands a grant against about 10.
func TestNewAccountStaysLean(t *testing.T) {
	ctx := context.Background()
	rdb := redis.NewClient(&redis.Options{Addr: redistest.Addr(t)})
	t.Cleanup(func() { _ = rdb.Close() })
	now, err := rdb.Time(ctx).Result()
	if err != nil {
		t.Fatal(err)
	}
	clk := &redisClock{}
	clk.set(now.UnixMicro())
	g := NewGate(rdb, Config{KeyPrefix: redistest.Prefix(t), Clock: virtualClock{clk}})
	g.testNow = clk.now
	var runs []string
	g.testScript = func(kind string) { runs = append(runs, kind) }
	grp, err := g.Group("shop", &Policy{Limits: []Limit{{Rate: 1000, Window: time.Second}}})
	if err != nil {
		t.Fatal(err)
	}
	p := Policy{Limits: []Limit{{Rate: 5, Window: time.Second}}}
	grant := func(b *Bucket) {
		t.Helper()
		for range 20 { // the group's first use waits out its horizon
			r, err := b.reserve(ctx, Request{})
			if err != nil {
				t.Fatal(err)
			}
			if r.ok {
				return
			}
			clk.advance(max(r.wait, 10*time.Millisecond))
		}
		t.Fatalf("%s: no tick in 20 tries", b.Name())
	}
	first, err := grp.Bucket("store-1", p)
	if err != nil {
		t.Fatal(err)
	}
	grant(first)
	clk.advance(time.Second)
	grant(first) // the group and its total are made
	fresh, err := grp.Bucket("store-2", p)
	if err != nil {
		t.Fatal(err)
	}
	if !fresh.counted {
		t.Fatal("the account's shape is not the counted grant's")
	}
	runs = nil
	grant(fresh)
	if len(runs) != 2 || runs[0] != "counted" || runs[1] != "full" {
		t.Fatalf("a new account's first grant ran %v, want the counted grant handing over to the full one", runs)
	}
	runs = nil
	clk.advance(250 * time.Millisecond)
	grant(fresh)
	if len(runs) != 1 || runs[0] != "counted" {
		t.Errorf("its next grant, 250 ms later, ran %v: want the counted grant (the state is there now)", runs)
	}
}

// totalNumberNames are the numbers of a total's tl, in order (see
// totalStateLua).
var totalNumberNames = []string{"last", "n", "kept", "blocked", "costly_until", "share", "share_at", "cleared"}

// totalNumbers reads the named numbers of the total hash at key from its
// tl, and its run.
func totalNumbers(t *testing.T, rdb *redis.Client, key string, names ...string) []any {
	t.Helper()
	v, err := rdb.HMGet(context.Background(), key, "tl", "run").Result()
	if err != nil {
		t.Fatal(err)
	}
	tl, ok := v[0].(string)
	if !ok {
		return v // no total
	}
	nums := make([]float64, len(totalNumberNames))
	if text := strings.Split(tl, "|"); len(text) == len(nums) && strings.Trim(tl, "0123456789.-+e|") == "" { // no struct
		for i, x := range text {
			if nums[i], err = strconv.ParseFloat(x, 64); err != nil {
				t.Fatalf("total %s: tl %q: %v", key, tl, err)
			}
		}
	} else if len(tl) == 8*len(nums) {
		for i := range nums {
			nums[i] = math.Float64frombits(binary.LittleEndian.Uint64([]byte(tl[8*i : 8*i+8])))
		}
	} else {
		t.Fatalf("total %s: tl %q is neither %d doubles nor their text", key, tl, len(nums))
	}
	out := []any{v[1]}
	for _, name := range names {
		out = append(out, nums[slices.Index(totalNumberNames, name)])
	}
	return out
}
