package shaper

import (
	"context"
	"fmt"
	"math/rand/v2"
	"slices"
	"strconv"
	"testing"
	"time"

	"github.com/alicebob/miniredis/v2"
	"github.com/redis/go-redis/v9"

	"github.com/shaper-dev/shaper/internal/gatehook"
	"github.com/shaper-dev/shaper/internal/redistest"
)

// TestCoreMatchesFull drives a bucket of the common shape, served by the
// core script, and the same bucket held to the full script through the
// same simulated Redis time: steady grants, idle gaps, crowds deferred
// beyond the horizon, pauses, a rate set and cleared, a learned guard.
// Some calls come in batches, one run of the core script for all of
// them, and one full run each for the other bucket. Both must answer every
// call alike (granted or not, the wait, the reason, the tick) and record
// the same holders, and the core script must have served most of them.
// adaptedScript marks a gate hash adapted, as every writer of a pause, a
// rate or a lesson does.
var adaptedScript = redis.NewScript(adaptedLua + "adapted(KEYS[1]) return 0")

func TestCoreMatchesFull(t *testing.T) { coreMatchesFull(t, redistest.Client(t), 3000) }

// TestCoreMatchesFullOnEmbeddedRedis is the same on the embedded Redis
// (miniredis, whose Lua is gopher-lua), the default of a new user.
func TestCoreMatchesFullOnEmbeddedRedis(t *testing.T) { coreMatchesFull(t, embeddedClient(t), 500) }

// embeddedClient is a client of an embedded Redis (miniredis) of the
// test's own.
func embeddedClient(t *testing.T) *redis.Client {
	m := miniredis.RunT(t)
	rdb := redis.NewClient(&redis.Options{Addr: m.Addr()})
	t.Cleanup(func() { _ = rdb.Close() })
	return rdb
}

func coreMatchesFull(t *testing.T, rdb *redis.Client, steps int) {
	ctx := context.Background()
	prefix := redistest.Prefix(t)
	core := NewGate(rdb, Config{KeyPrefix: prefix + "c", Replica: "r1"})
	full := NewGate(rdb, Config{KeyPrefix: prefix + "f", Replica: "r1"})
	now, err := rdb.Time(ctx).Result()
	if err != nil {
		t.Fatal(err)
	}
	clk := fakeRedisTime(core, now.UnixMicro())
	full.testNow = core.testNow
	var coreRuns, fullRuns int
	kinds := map[string]int{}
	core.testScript = func(kind string) {
		kinds[kind]++
		if kind == "core" || kind == "adapt" {
			coreRuns++
		} else {
			fullRuns++
		}
	}
	p := Policy{Limits: []Limit{{Rate: 20, Window: time.Second}}, Horizon: 200 * time.Millisecond}
	bc, err := core.Bucket("acme", p)
	if err != nil {
		t.Fatal(err)
	}
	bf, err := full.Bucket("acme", p)
	if err != nil {
		t.Fatal(err)
	}
	bf.core = false
	both := func(f func(b *Bucket) error) {
		t.Helper()
		for _, b := range []*Bucket{bc, bf} {
			if err := f(b); err != nil {
				t.Fatal(err)
			}
		}
	}
	rng := rand.New(rand.NewPCG(28, 1))
	for step := range steps {
		c := rng.IntN(60)
		switch c {
		case 0:
			d := time.Duration(rng.IntN(500)) * time.Millisecond
			both(func(b *Bucket) error { _, err := b.Control().Pause(ctx, d, "test"); return err })
		case 1:
			r := 5 + float64(rng.IntN(10))
			both(func(b *Bucket) error { return b.Control().overrideRate(ctx, r, "test") })
		case 2:
			both(func(b *Bucket) error { return b.Control().clearRate(ctx) })
		case 3:
			clk.advance(time.Duration(rng.IntN(3000)) * time.Millisecond) // idle
		case 4:
			// A learned guard, as a margin lesson writes it (applyLua,
			// which also marks the gate hash adapted).
			g := rng.IntN(30) * 1000
			both(func(b *Bucket) error {
				if err := rdb.HSet(ctx, b.keys.control, "guard", g).Err(); err != nil {
					return err
				}
				return adaptedScript.Run(ctx, rdb, []string{b.keys.gate}).Err()
			})
		}
		// A batch of k calls in one run of the core script, and the same
		// calls one after the other through the full one.
		k := 1
		if rng.IntN(4) == 0 {
			k = 2 + rng.IntN(15)
		}
		reqs := make([]Request, k)
		for i := range reqs {
			reqs[i].Tag = fmt.Sprintf("w|q|task-%d-%d", step, i)
		}
		rcs, err := bc.reserveMany(ctx, reqs)
		if err != nil {
			t.Fatal(err)
		}
		var rc reservation
		for i, req := range reqs {
			rf, err := bf.reserve(ctx, req)
			if err != nil {
				t.Fatal(err)
			}
			rc = rcs[i]
			if rc.ok != rf.ok || rc.wait != rf.wait || rc.reason != rf.reason || rc.tick != rf.tick || rc.tolerance != rf.tolerance {
				t.Fatalf("step %d, call %d of %d: the core script answered %+v, the full one %+v", step, i+1, k, rc, rf)
			}
		}
		// Some callers come back at once (a crowd), others when told.
		if rng.IntN(3) > 0 {
			clk.advance(rc.wait + time.Duration(rng.IntN(20))*time.Millisecond)
		}
	}
	// Both record each granted call's tag with its tick.
	sameTags(t, "core", bc, bf)
	if coreRuns < steps/2 {
		t.Errorf("the core script served %d of %d requests of a common bucket (the full one %d)", coreRuns, steps, fullRuns)
	}
	t.Logf("core and adapt grants %d runs, full grant %d (%v)", coreRuns, fullRuns, kinds)
}

// sameTags fails the test unless lean (a bucket served by the script
// named) and full (the same bucket held to the full script) recorded the
// same tags with the same ticks, and some.
func sameTags(t *testing.T, script string, lean, full *Bucket) {
	t.Helper()
	var tags [2][]gatehook.Tag
	for i, b := range []*Bucket{lean, full} {
		var err error
		if tags[i], err = b.tagged(context.Background(), time.Time{}); err != nil {
			t.Fatal(err)
		}
	}
	if len(tags[0]) == 0 || len(tags[0]) != len(tags[1]) {
		t.Errorf("%s: %d tags in the %s script's record, %d in the full one's", lean.name, len(tags[0]), script, len(tags[1]))
		return
	}
	for i := range tags[0] {
		if tags[0][i].Tag != tags[1][i].Tag || !tags[0][i].Tick.Equal(tags[1][i].Tick) {
			t.Errorf("%s, tag %d: %+v in the %s script's record, %+v in the full one's", lean.name, i, tags[0][i], script, tags[1][i])
			return
		}
	}
}

// TestCoreHandsOverAnUnreadableLine: a gate hash recorded on this server
// whose line does not read (the other form of it, or a shorter one) is
// handed to the full grant, as the counted grant does, not read as a
// number: the core grant used to fail with a Lua error there.
func TestCoreHandsOverAnUnreadableLine(t *testing.T) {
	ctx := context.Background()
	rdb := redistest.Client(t)
	g := NewGate(rdb, Config{KeyPrefix: redistest.Prefix(t)})
	var kinds []string
	g.testScript = func(kind string) { kinds = append(kinds, kind) }
	b, err := g.Bucket("acme", Policy{Limits: []Limit{{Rate: 1000, Window: time.Second}}, Horizon: time.Hour})
	if err != nil {
		t.Fatal(err)
	}
	for range 3 {
		if _, err := b.reserve(ctx, Request{}); err != nil {
			t.Fatal(err)
		}
	}
	if kinds[len(kinds)-1] != "core" {
		t.Fatalf("the common bucket's grants ran %v, want the core grant last", kinds)
	}
	if err := rdb.HSet(ctx, b.keys.gate, "line", "not a line").Err(); err != nil {
		t.Fatal(err)
	}
	kinds = nil
	if _, err := b.reserve(ctx, Request{}); err != nil {
		t.Fatalf("a grant over an unreadable line: %v", err)
	}
	if len(kinds) != 2 || kinds[0] != "core" || kinds[1] != "full" {
		t.Errorf("a grant over an unreadable line ran %v, want the core grant handing over to the full one", kinds)
	}
}

// TestCoreGrantKeepsToTheHotPath: the core grant refreshes its own
// widest tick itself (no handover), and hands a grant due upkeep (the
// keys' expiry, a new clock minute's count) to the full grant before it
// writes anything: the full grant takes the first call of a batch, and
// the rest stay one lean batch.
func TestCoreGrantKeepsToTheHotPath(t *testing.T) {
	ctx := context.Background()
	rdb := redistest.Client(t)
	g := NewGate(rdb, Config{KeyPrefix: redistest.Prefix(t), Replica: "r1"})
	const minute = int64(60_000_000)
	start := (time.Now().UnixMicro()/minute+1)*minute + 1_000_000 // 1 s into a clock minute
	clk := fakeRedisTime(g, start)
	var kinds []string
	g.testScript = func(kind string) { kinds = append(kinds, kind) }
	b, err := g.Bucket("acme", Policy{Limits: []Limit{{Rate: 20, Window: time.Second}}, Horizon: time.Second})
	if err != nil {
		t.Fatal(err)
	}
	grantTicks(t, b, clk, 3)
	if len(kinds) < 3 || kinds[0] != "full" || slices.ContainsFunc(kinds[1:], func(k string) bool { return k != "core" }) {
		t.Fatalf("a new bucket's first grants ran %v, want the full grant (no state) and then the core one", kinds)
	}

	// 1.3 s on, the widest tick (the caller's) is due its refresh
	// (replicaLive / 4): the core grant writes it.
	clk.advance(1300 * time.Millisecond)
	kinds = nil
	if r := reserveOnce(t, b); !r.ok || !slices.Equal(kinds, []string{"core"}) {
		t.Fatalf("a grant due the widest tick's refresh: %+v by %v, want granted by the core grant alone", r, kinds)
	}
	if at, err := rdb.HGet(ctx, b.keys.gate, "wide_at").Int64(); err != nil || at != clk.now() {
		t.Errorf("wide_at %d (%v) after the core grant's refresh, want now, %d", at, err, clk.now())
	}

	// The keys were extended to a reach (4 s for a keep of 1 s) past
	// the line's end: 5 s on, a batch of 3 is due their upkeep.
	clk.advance(5 * time.Second)
	kinds = nil
	rs, err := b.reserveMany(ctx, make([]Request, 3))
	if err != nil {
		t.Fatal(err)
	}
	for i, r := range rs {
		if !r.ok {
			t.Errorf("call %d of the batch due upkeep: %+v, want granted", i+1, r)
		}
	}
	if !slices.Equal(kinds, []string{"core", "full", "core"}) {
		t.Errorf("a batch due upkeep ran %v, want the core grant handing over, the full one for the first call, the core one for the rest", kinds)
	}
	if ms, err := rdb.PTTL(ctx, b.keys.gate).Result(); err != nil || ms < 4*time.Second {
		t.Errorf("the gate hash expires in %v (%v) after the upkeep, want at least a reach (4 s) past the line", ms, err)
	}

	// A new clock minute: the full grant folds the last minute's grants
	// (the core grant only counts them in the line) into the stats hash.
	clk.set(start + minute)
	kinds = nil
	if r := reserveOnce(t, b); !r.ok || !slices.Equal(kinds, []string{"core", "full"}) {
		t.Fatalf("the first grant of a new minute: %+v by %v, want the core grant handing it to the full one", r, kinds)
	}
	folded, err := rdb.HMGet(ctx, b.keys.stats, "granted", "granted_c0", "granted_c1").Result()
	if err != nil {
		t.Fatal(err)
	}
	var n int64
	for _, v := range folded {
		if s, ok := v.(string); ok {
			x, _ := strconv.ParseInt(s, 10, 64)
			n += x
		}
	}
	if n != 7 {
		t.Errorf("the stats hash holds %d grants after the minute changed, want the last minute's 7 (%v)", n, folded)
	}
	if st, err := b.Stats(ctx); err != nil || st.Granted != 8 {
		t.Errorf("Stats: %d granted (%v), want 8", st.Granted, err)
	}
}

// TestAccountsCoreGrantFoldsItsCount: an account of a group without a
// total runs the core grant, and its grants reach the group's stats hash
// as they go (every grantFold), not once a minute: the vendor's Stats
// reads that hash, not the accounts' lines. With the group of one's
// core grant (which counts in its line only) the vendor saw none of them
// until the minute changed.
func TestAccountsCoreGrantFoldsItsCount(t *testing.T) {
	ctx := context.Background()
	rdb, vendor, account := vendorAndAccount(t, Policy{Limits: []Limit{{Rate: 1000, Window: time.Second}}, Horizon: time.Second})
	var kinds []string
	account.gate.testScript = func(kind string) { kinds = append(kinds, kind) }
	now, err := rdb.Time(ctx).Result()
	if err != nil {
		t.Fatal(err)
	}
	clk := fakeRedisTime(account.gate, now.UnixMicro())
	const n = 3 * grantFold
	grantTicks(t, account, clk, n)
	if slices.Index(kinds, "core") < 0 {
		t.Fatalf("%d grants by %v; want most by the core grant", n, kinds)
	}
	st, err := vendor.Stats(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if st.Granted < n-grantFold {
		t.Errorf("the vendor's stats count %d of its account's %d grants, want at least %d (all but the last fold's)", st.Granted, n, n-grantFold)
	}
}
