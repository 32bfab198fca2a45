package shaper

import (
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"math"
	"reflect"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/shaper-dev/shaper/internal/redistest"
)

// copyKeys copies every key under prefix from one Redis to another, with
// its TTL: what a replica holds of its master at some moment.
func copyKeys(t *testing.T, from, to *redis.Client, prefix string) int {
	t.Helper()
	ctx := context.Background()
	keys, err := from.Keys(ctx, prefix+":*").Result()
	if err != nil {
		t.Fatal(err)
	}
	for _, k := range keys {
		dump, err := from.Dump(ctx, k).Result()
		if err == redis.Nil {
			continue
		} else if err != nil {
			t.Fatal(err)
		}
		ttl, err := from.PTTL(ctx, k).Result()
		if err != nil {
			t.Fatal(err)
		}
		if ttl < 0 {
			ttl = 0
		}
		if err := to.RestoreReplace(ctx, k, ttl, dump).Err(); err != nil {
			t.Fatal(err)
		}
	}
	return len(keys)
}

// TestOwnRedisStaleCopy is the failover that lost the last writes: the gate's
// state is copied from server A to server B (a replica's copy), A grants
// ticks for 400 ms more, and then every caller moves to B (the promoted
// replica), whose copy lacks those ticks. B's state was written by
// another server (its run_id differs), so it is treated as lost: no tick
// before the horizon A could have reserved up to, and G1 holds across
// the switch, for a bucket of its own and for one in a group with a
// total.
func TestOwnRedisStaleCopy(t *testing.T) {
	t.Parallel() // servers of its own; G1 is what it checks, not timing
	for _, sc := range []struct {
		name  string
		total *Policy // the group's total; the bucket's own limit is then 200/s
	}{{"bucket", nil}, {"group with a total", &Policy{Limits: []Limit{{Rate: 100, Window: time.Second}}}}} {
		t.Run(sc.name, func(t *testing.T) {
			t.Parallel()
			srvA, srvB := redistest.Start(t), redistest.Start(t)
			prefix := redistest.Prefix(t)
			a, b := newReplica(t, srvA.Addr, prefix, nil), newReplica(t, srvB.Addr, prefix, nil)
			p := Policy{Limits: []Limit{{Rate: 100, Window: time.Second}}}
			bucketOf := func(g *Gate) *Bucket {
				t.Helper()
				if sc.total == nil {
					bk, err := g.Bucket("acme", p)
					if err != nil {
						t.Fatal(err)
					}
					return bk
				}
				grp, err := g.Group("shop", sc.total)
				if err != nil {
					t.Fatal(err)
				}
				bk, err := grp.Bucket("store-1", Policy{Limits: []Limit{{Rate: 200, Window: time.Second}}})
				if err != nil {
					t.Fatal(err)
				}
				return bk
			}
			ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
			defer cancel()
			rec := &recorder{}
			run := func(bk *Bucket, until time.Time) {
				var wg sync.WaitGroup
				for range 16 {
					wg.Go(func() {
						for time.Now().Before(until) {
							permit, err := bk.Acquire(ctx)
							if err != nil {
								t.Error(err)
								return
							}
							rec.add(permit.granted)
						}
					})
				}
				wg.Wait()
			}
			start := time.Now()
			done := make(chan struct{})
			onA := bucketOf(a.gate) // on the test's goroutine: it may t.Fatal
			go func() {
				defer close(done)
				run(onA, start.Add(3*time.Second))
			}()
			// A Fatal below ends the test only once A's callers have
			// stopped (the context ends them).
			defer func() { cancel(); <-done }()
			time.Sleep(2600 * time.Millisecond)
			n := copyKeys(t, a.rdb, b.rdb, prefix) // the replica's copy, 400 ms before the failover
			time.Sleep(time.Until(start.Add(3 * time.Second)))
			// The failover: new callers ask B while the ticks A granted
			// last are still being used.
			switched := len(rec.times())
			run(bucketOf(b.gate), time.Now().Add(2500*time.Millisecond))
			<-done
			ts := rec.times()
			t.Logf("%d keys copied; %d calls on A, %d on B after the switch", n, switched, len(ts)-switched)
			if len(ts) == switched {
				t.Errorf("no call on B after the switch: the gate did not recover")
			}
			checkWindows(t, ts, p, 60)
		})
	}
}

// TestOwnRedisMissingStateAfterSwitch: a replica's copy can hold a group's
// epoch but not yet a bucket's state that the old master had just
// written. On the server that took over, for a window after the switch, a
// missing state counts as lost (its first tick waits out the horizon the
// old server could have reserved up to); on a server that did not switch,
// a bucket new to a group in use for a window and a horizon is granted at once.
func TestOwnRedisMissingStateAfterSwitch(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	srvA, srvB := redistest.Start(t), redistest.Start(t)
	prefix := redistest.Prefix(t)
	a, b := newReplica(t, srvA.Addr, prefix, nil), newReplica(t, srvB.Addr, prefix, nil)
	p := Policy{Limits: []Limit{{Rate: 100, Window: time.Second}}}
	bucket := func(r *replica, group, name string) *Bucket {
		t.Helper()
		grp, err := r.gate.Group(group, nil)
		if err != nil {
			t.Fatal(err)
		}
		bk, err := grp.Bucket(name, p)
		if err != nil {
			t.Fatal(err)
		}
		return bk
	}
	// The first grant of a bucket: how long it took, and the bucket's
	// resets (states found lost) after it.
	first := func(bk *Bucket) (time.Duration, int64) {
		t.Helper()
		asked := time.Now()
		if _, err := bk.Acquire(ctx); err != nil {
			t.Fatal(err)
		}
		took := time.Since(asked)
		st, err := bk.Stats(ctx)
		if err != nil {
			t.Fatal(err)
		}
		return took, st.Resets
	}
	onA := bucket(a, "shop", "store-1")
	for range 20 {
		if _, err := onA.Acquire(ctx); err != nil {
			t.Fatal(err)
		}
	}
	// B's copy: the group's epoch, not store-1's state.
	dump, err := a.rdb.Dump(ctx, onA.keys.epoch).Result()
	if err != nil {
		t.Fatal(err)
	}
	if err := b.rdb.RestoreReplace(ctx, onA.keys.epoch, 0, dump).Err(); err != nil {
		t.Fatal(err)
	}
	// The first grant on B stamps the epoch with the switch: another
	// state of the group missing on B, asked for just after it, still
	// counts as lost. It asks while the first waits (the switch's window
	// is the bucket's keep, about the horizon the first one waits out:
	// asked after the first grant, on a busy machine, it came too late).
	store1, store2 := bucket(b, "shop", "store-1"), bucket(b, "shop", "store-2")
	var switched time.Duration
	var firstErr error
	firstDone := make(chan struct{})
	go func() {
		defer close(firstDone)
		asked := time.Now()
		_, firstErr = store1.Acquire(ctx)
		switched = time.Since(asked)
	}()
	time.Sleep(50 * time.Millisecond)
	after, _ := first(store2)
	<-firstDone
	if firstErr != nil {
		t.Fatal(firstErr)
	}
	st, err := store1.Stats(ctx)
	if err != nil {
		t.Fatal(err)
	}
	resets := st.Resets
	// A group B has served all along: its first bucket starts the epoch
	// (a first use counts as a loss), and every bucket new to the group
	// for a window and a horizon after it is lost too (Redis may have lost
	// everything without a switch the gate saw): its first tick comes
	// with the first bucket's, a horizon after the epoch was made. A
	// later one is new, not lost.
	made := time.Now()
	mall1 := bucket(b, "mall", "store-1")
	went := make(chan struct{})
	go func() { defer close(went); mall1.Acquire(ctx) }()
	time.Sleep(300 * time.Millisecond)
	first(bucket(b, "mall", "store-2"))
	soon := time.Since(made)
	<-went
	time.Sleep(2500 * time.Millisecond) // a window, a guard and a horizon
	fresh, _ := first(bucket(b, "mall", "store-3"))
	t.Logf("first grant on B: a bucket missing at the switch %s, another asked 50 ms after it %s (%d resets for both); a new bucket of a group B served all along, asked 300 ms after its first: granted %s after the epoch was made; %s later %s",
		switched, after, resets, soon, 2500*time.Millisecond, fresh)
	if soon < DefaultHorizon*8/10 {
		t.Errorf("a bucket new to a group whose epoch was just made: granted %s after the epoch; want it lost (a horizon, %s)", soon, DefaultHorizon)
	}
	if soon > DefaultHorizon+500*time.Millisecond {
		t.Errorf("a bucket new to a group whose epoch was just made: granted %s after the epoch; want a horizon after it (%s), with the first bucket", soon, DefaultHorizon)
	}
	if switched < DefaultHorizon*8/10 {
		t.Errorf("a state missing at the switch: first grant after %s; want it lost (about %s)", switched, DefaultHorizon)
	}
	if after < DefaultHorizon*8/10-50*time.Millisecond {
		t.Errorf("a state missing just after the switch: first grant after %s; want it lost (about %s after the first)", after, DefaultHorizon)
	}
	if resets < 2 {
		t.Errorf("two states missing at the switch counted %d resets, want 2", resets)
	}
	if fresh > DefaultHorizon/2 {
		t.Errorf("a bucket new to a group B served all along: first grant after %s; want it at once", fresh)
	}
}

// layoutGate is the layout tests' world: a gate on the test Redis whose
// Redis time is simulated from the server's own, and a policy of 20/s
// with a quota of 30 an hour, a horizon of 100 ms.
func layoutGate(t *testing.T) (*redis.Client, *Gate, *redisClock, Policy) {
	t.Helper()
	rdb := redistest.Client(t)
	g := NewGate(rdb, Config{KeyPrefix: redistest.Prefix(t)})
	now, err := rdb.Time(context.Background()).Result()
	if err != nil {
		t.Fatal(err)
	}
	p := Policy{Limits: []Limit{{Rate: 20, Window: time.Second}, {Rate: 30, Window: time.Hour}}, Horizon: 100 * time.Millisecond}
	return rdb, g, fakeRedisTime(g, now.UnixMicro()), p
}

// TestOtherLayoutKeepsQuotas: a state another version of shaper wrote on
// the same server (a rolling upgrade between versions whose gate hashes
// differ: its run carries another layout's tag, its line may not read)
// costs the bucket a horizon without calls, as a stale copy does, but
// not its quotas: their counters are this server's, so the calls they
// still allow go on after the horizon, and no more.
func TestOtherLayoutKeepsQuotas(t *testing.T) {
	rdb, g, clk, p := layoutGate(t)
	ctx := context.Background()
	b, err := g.Bucket("acme", p)
	if err != nil {
		t.Fatal(err)
	}
	grantTicks(t, b, clk, 5)
	run, err := rdb.HGet(ctx, b.keys.gate, "run").Result()
	if err != nil || !strings.HasPrefix(run, runTag) {
		t.Fatalf("run %q, %v; want %s and the server's run_id", run, err, runTag)
	}
	// The older layout: a text line, the run tagged l1:.
	switched := clk.now()
	if err := rdb.HSet(ctx, b.keys.gate, "line", fmt.Sprintf("%d|1|0|0|0", switched), "run", "l1:"+strings.TrimPrefix(run, runTag)).Err(); err != nil {
		t.Fatal(err)
	}
	ticks := grantTicks(t, b, clk, 25)
	if first := time.Duration(ticks[0]-switched) * time.Microsecond; first < p.Horizon {
		t.Errorf("the first tick after the switch came %v after it, before the horizon (%v)", first, p.Horizon)
	}
	if last := time.Duration(ticks[24]-switched) * time.Microsecond; last > 5*time.Second {
		t.Errorf("the quota's last 25 calls took %v after the switch: the quota was counted as spent", last)
	}
	r := reserveOnce(t, b)
	if r.ok || r.wait < 30*time.Minute {
		t.Errorf("after 30 calls of a quota of 30 per hour: %+v; want a deferral until the quota frees", r)
	}
}

// TestOwnRedisRestartLosesEveryAccount is a Redis that restarts without
// its data while a per-account vendor's callers hold ticks it granted up
// to a horizon ahead. The group's epoch is gone with everything else, so
// the first account asked cannot tell a loss from a first start; but the
// gate had granted on the old server (it passes that server's run_id):
// every account's missing state counts as lost, not the first alone.
// Before the fix the second account was granted at once beside the ticks
// its callers still held: over its limit in one window.
func TestOwnRedisRestartLosesEveryAccount(t *testing.T) {
	t.Parallel()
	srv := redistest.Start(t)
	r := newReplica(t, srv.Addr, redistest.Prefix(t), nil)
	p := Policy{Limits: []Limit{{Rate: 100, Window: time.Second}}}
	grp, err := r.gate.Group("shop", nil)
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	stop := time.Now().Add(3 * time.Second)
	var wg sync.WaitGroup
	recs := map[string]*recorder{}
	for _, name := range []string{"store-1", "store-2", "store-3"} {
		bk, err := grp.Bucket(name, p)
		if err != nil {
			t.Fatal(err)
		}
		rec := &recorder{}
		recs[name] = rec
		// Callers enough to hold ticks most of a horizon ahead.
		for range 64 {
			wg.Go(func() {
				for time.Now().Before(stop) && ctx.Err() == nil {
					permit, err := bk.Acquire(ctx)
					if errors.Is(err, ErrUnavailable) {
						time.Sleep(5 * time.Millisecond) // the restart
						continue
					}
					if err != nil {
						t.Error(err)
						return
					}
					rec.add(permit.granted)
				}
			})
		}
	}
	time.Sleep(1200 * time.Millisecond)
	srv.Kill()
	if err := srv.Restart(); err != nil {
		t.Fatal(err)
	}
	wg.Wait()
	for name, rec := range recs {
		ts := rec.times()
		t.Logf("%s: %d calls", name, len(ts))
		checkWindows(t, ts, p, 60)
	}
}

// TestOwnRedisRestartCountsQuotasSpent: Redis restarts empty under a gate
// that granted on it, half-way through an account's quota. The gate saw
// the switch (it passes the old server's run_id), so the loss is certain:
// the account's quota counts as spent for its window, and the minute
// holds no more calls than the quota, on the virtual clock.
func TestOwnRedisRestartCountsQuotasSpent(t *testing.T) {
	t.Parallel()
	srv := redistest.Start(t)
	r := newReplica(t, srv.Addr, redistest.Prefix(t), nil)
	clk := fakeRedisTime(r.gate, testEpoch)
	grp, err := r.gate.Group("shop", nil)
	if err != nil {
		t.Fatal(err)
	}
	b, err := grp.Bucket("store-1", Policy{Limits: []Limit{{Rate: 20, Window: time.Second}, {Rate: 300, Window: time.Minute}}})
	if err != nil {
		t.Fatal(err)
	}
	before := simulate(t, b, clk, 200, one)
	srv.Kill()
	if err := srv.Restart(); err != nil {
		t.Fatal(err)
	}
	// The first asks after the restart find the pool's connections gone
	// (a tick granted meanwhile counts with the others).
	var after []simCall
	for range 50 {
		res, err := b.reserve(context.Background(), Request{})
		if err == nil {
			if res.ok {
				after = append(after, simCall{at: clk.now() + res.wait.Microseconds(), cost: 1})
			}
			break
		}
		time.Sleep(20 * time.Millisecond)
	}
	after = append(after, simulate(t, b, clk, 200, one)...)
	all := append(before, after...)
	if n := maxUnits(all, time.Minute); n > 300 {
		t.Errorf("%d calls in a minute across the restart, the quota allows 300", n)
	}
}

// TestNewerLayoutGrantsNothing: a bucket whose state a newer shaper wrote
// (its run tagged with a layout above this version's) is not this
// version's to read or write. Each ask is deferred a horizon as
// BoundUpgrade, Acquire past MaxWait says so, and nothing in Redis
// changes: not the gate hash, not the quota's counters, not the stats.
// The newer version's line may be one this version reads (the same
// form) or one it cannot; a total's hash tagged newer holds its accounts
// alike. Before the check this version took the state for another
// layout's and granted after a horizon, writing its own line over it.
func TestNewerLayoutGrantsNothing(t *testing.T) {
	rdb, g, clk, p := layoutGate(t)
	ctx := context.Background()
	newer := fmt.Sprintf("l%d:", layout+1)
	snapshot := func(keys ...string) map[string]map[string]string {
		out := map[string]map[string]string{}
		for _, k := range keys {
			out[k] = rdb.HGetAll(ctx, k).Val()
		}
		return out
	}
	holds := func(t *testing.T, b *Bucket, keys ...string) {
		t.Helper()
		before := snapshot(keys...)
		for range 20 {
			r := reserveOnce(t, b)
			if r.ok || r.reason != newerLayout || r.wait != b.policy.Horizon {
				t.Fatalf("a state of layout %s: %+v; want a deferral of one horizon (%v) for the upgrade", newer, r, b.policy.Horizon)
			}
			clk.advance(r.wait)
		}
		_, err := b.Acquire(ctx, Request{MaxWait: 10 * time.Millisecond})
		var w *Wait
		if !errors.As(err, &w) || w.Binding != BoundUpgrade {
			t.Fatalf("Acquire past MaxWait: %v; want a *Wait bound by %q", err, BoundUpgrade)
		}
		if after := snapshot(keys...); !reflect.DeepEqual(before, after) {
			t.Errorf("the newer state changed:\nbefore %v\nafter  %v", before, after)
		}
	}

	for _, line := range []string{"same", "unreadable"} {
		t.Run("line "+line, func(t *testing.T) {
			b, err := g.Bucket("acme-"+line, p)
			if err != nil {
				t.Fatal(err)
			}
			grantTicks(t, b, clk, 5)
			run := rdb.HGet(ctx, b.keys.gate, "run").Val()
			fields := []any{"run", newer + strings.TrimPrefix(run, runTag)}
			if line == "unreadable" {
				fields = append(fields, "line", "v4")
			}
			if err := rdb.HSet(ctx, b.keys.gate, fields...).Err(); err != nil {
				t.Fatal(err)
			}
			holds(t, b, b.keys.gate, b.keys.counts, b.keys.stats)
		})
	}

	t.Run("total", func(t *testing.T) {
		total := Policy{Limits: []Limit{{Rate: 50, Window: time.Second}}}
		grp, err := g.Group("shop", &total)
		if err != nil {
			t.Fatal(err)
		}
		b, err := grp.Bucket("store-1", p)
		if err != nil {
			t.Fatal(err)
		}
		grantTicks(t, b, clk, 5)
		run := rdb.HGet(ctx, b.keys.total, "run").Val()
		if run == "" {
			t.Fatal("the total's hash records no run")
		}
		if err := rdb.HSet(ctx, b.keys.total, "run", newer+run).Err(); err != nil {
			t.Fatal(err)
		}
		holds(t, b, b.keys.gate, b.keys.total, b.keys.counts, b.keys.stats)
	})
}

// TestPreviousLayoutConvertsOnFirstTouch: two accounts of a per-account
// vendor with a total, each with a quota, left by the previous release
// mid-quota and mid-total (layout 4: their gate hashes' run tagged l4:,
// the total's numbers in fields of their own and its run untagged),
// beside a twin group that ran the same calls in this layout all along.
// This release's first grants convert the state in place and answer as
// the twin's do, call for call: no horizon's wait (the state is this
// server's), no tick closer to the last ones than the twin's (nothing
// granted twice), the quotas counting every unit once; the total keeps
// its numbers in one field under a run a worker of layout 4 reads as
// newer (so that it waits).
func TestPreviousLayoutConvertsOnFirstTouch(t *testing.T) {
	// A total of one call a tick keeps its ticks in a ring of slots, one
	// of two calls a tick in its line (last, n): the line is what a
	// conversion that lost the numbers would lose.
	for _, burst := range []int{1, 2} {
		t.Run(fmt.Sprintf("total burst %d", burst), func(t *testing.T) { convertsOnFirstTouch(t, burst) })
	}
}

func convertsOnFirstTouch(t *testing.T, burst int) {
	rdb, g, clk, p := layoutGate(t)
	ctx := context.Background()
	total := &Policy{Limits: []Limit{{Rate: 10, Window: time.Second}}, Burst: burst}
	var old, twin []*Bucket
	for _, name := range []string{"acme", "twin"} {
		grp, err := g.Group(name, total)
		if err != nil {
			t.Fatal(err)
		}
		for _, account := range []string{"store-1", "store-2", "store-3"} {
			b, err := grp.Bucket(account, p)
			if err != nil {
				t.Fatal(err)
			}
			if name == "acme" {
				old = append(old, b)
			} else {
				twin = append(twin, b)
			}
		}
	}
	// step reserves one call of each account in both groups at one moment
	// (after advance) and checks that the two groups answer alike.
	joined := false // store-3 makes its first calls after the downgrade
	step := func(when string, advance time.Duration) (granted int) {
		t.Helper()
		clk.advance(advance)
		for i := range old {
			if i == 2 && !joined {
				continue
			}
			ro, err := old[i].reserve(ctx, Request{})
			if err != nil {
				t.Fatal(err)
			}
			rt, err := twin[i].reserve(ctx, Request{})
			if err != nil {
				t.Fatal(err)
			}
			if ro.ok != rt.ok || ro.tick != rt.tick || ro.wait != rt.wait || ro.reason != rt.reason {
				t.Fatalf("%s, %s: %+v; its twin in this layout: %+v", when, old[i].name, ro, rt)
			}
			if ro.ok {
				granted++
			}
		}
		return granted
	}
	for range 12 {
		step("before the downgrade", 120*time.Millisecond)
	}
	// Layout 4's state: the gate hashes' run tagged l4:, the total's
	// numbers in fields, its run the server's run_id alone.
	run := rdb.HGet(ctx, old[0].keys.gate, "run").Val()
	server := strings.TrimPrefix(run, runTag)
	if server == run || server == "" {
		t.Fatalf("the gate hash's run %q is not tagged %s with a server", run, runTag)
	}
	for _, b := range old {
		if err := rdb.HSet(ctx, b.keys.gate, "run", "l4:"+server).Err(); err != nil {
			t.Fatal(err)
		}
	}
	k := old[0].keys.total
	tl := rdb.HGet(ctx, k, "tl").Val()
	if len(tl) != 64 {
		t.Fatalf("the total's tl is %d bytes, want 8 doubles", len(tl))
	}
	names := []string{"last", "n", "kept", "blocked", "costly_until", "share", "share_at", "cleared"}
	fields := []any{"run", server}
	for i, name := range names {
		v := math.Float64frombits(binary.LittleEndian.Uint64([]byte(tl[8*i : 8*i+8])))
		if v == -1 || (v == 0 && name == "costly_until") {
			continue // not set: layout 4 had no field
		}
		fields = append(fields, name, strconv.FormatFloat(v, 'f', -1, 64))
	}
	if err := rdb.HDel(ctx, k, "tl").Err(); err != nil {
		t.Fatal(err)
	}
	if err := rdb.HSet(ctx, k, fields...).Err(); err != nil {
		t.Fatal(err)
	}

	// The first calls after come at the moment of the last ones, a new
	// account's among them: the total's last tick is what keeps them
	// apart.
	joined = true
	granted := step("at the downgrade", 0)
	for range 12 {
		granted += step("after the downgrade", 120*time.Millisecond)
	}
	if granted == 0 {
		t.Fatal("no call granted after the conversion")
	}
	if got := rdb.HGet(ctx, k, "run").Val(); got != run {
		t.Errorf("the total's run %q after the conversion, want %q", got, run)
	}
	if n := rdb.HExists(ctx, k, "last").Val(); n || rdb.HGet(ctx, k, "tl").Val() == "" {
		t.Errorf("the total keeps its numbers in fields after the conversion: %v", rdb.HGetAll(ctx, k).Val())
	}
	for i := range old {
		if got := rdb.HGet(ctx, old[i].keys.gate, "run").Val(); got != run {
			t.Errorf("%s: run %q after the conversion, want %q", old[i].name, got, run)
		}
		uo, err := old[i].limitUse(ctx)
		if err != nil {
			t.Fatal(err)
		}
		ut, err := twin[i].limitUse(ctx)
		if err != nil {
			t.Fatal(err)
		}
		if fmt.Sprint(uo) != fmt.Sprint(ut) {
			t.Errorf("%s: quotas %v after the conversion; its twin's %v", old[i].name, uo, ut)
		}
	}
}
