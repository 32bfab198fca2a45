package shaper

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"os"
	"os/exec"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"
	"go.uber.org/goleak"

	"github.com/shaper-dev/shaper/internal/redistest"
	"github.com/shaper-dev/shaper/internal/windows"
)

const helperEnv = "SHAPER_GATE_HELPER"

func TestMain(m *testing.M) {
	if os.Getenv(helperEnv) != "" {
		os.Exit(runHelper())
	}
	code := redistest.Main(m)
	if code == 0 {
		if err := goleak.Find(); err != nil {
			fmt.Fprintln(os.Stderr, "goleak:", err)
			code = 1
		}
	}
	os.Exit(code)
}

// replica is one client of the gate, as a worker replica would be: its own
// Redis connection pool and its own clock.
type replica struct {
	rdb  *redis.Client
	gate *Gate
}

func newReplica(t testing.TB, addr, prefix string, clock Clock) *replica {
	t.Helper()
	rdb := redis.NewClient(&redis.Options{Addr: addr, PoolSize: 64})
	t.Cleanup(func() { _ = rdb.Close() })
	return &replica{rdb: rdb, gate: NewGate(rdb, Config{KeyPrefix: prefix, Clock: clock})}
}

// skewedClock is a system clock that reads offset away from the truth.
type skewedClock struct{ offset time.Duration }

func (c skewedClock) Now() time.Time { return time.Now().Add(c.offset) }
func (c skewedClock) Sleep(ctx context.Context, d time.Duration) error {
	return systemClock{}.Sleep(ctx, d)
}

// recorder collects the time the gate handed out each permit (when the
// call may start: what follows is the caller's scheduling, not the gate's).
type recorder struct {
	mu sync.Mutex
	ts []time.Time
}

func (r *recorder) add(t time.Time) {
	r.mu.Lock()
	r.ts = append(r.ts, t)
	r.mu.Unlock()
}

func (r *recorder) times() []time.Time {
	r.mu.Lock()
	defer r.mu.Unlock()
	return append([]time.Time(nil), r.ts...)
}

// drain has callers goroutines on each replica acquire permits until calls
// permits were handed out in all, recording when each call started.
func drain(t *testing.T, reps []*replica, bucket string, p Policy, callers, calls int, rec *recorder) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	var left atomic.Int64
	left.Store(int64(calls))
	var wg sync.WaitGroup
	for _, r := range reps {
		b, err := r.gate.Bucket(bucket, p)
		if err != nil {
			t.Fatal(err)
		}
		for range callers {
			wg.Go(func() {
				for left.Add(-1) >= 0 {
					permit, err := b.Acquire(ctx)
					if err != nil {
						t.Errorf("acquire: %v", err)
						return
					}
					rec.add(permit.granted)
					_ = permit.Release(ctx)
				}
			})
		}
	}
	wg.Wait()
}

// callUntil has callers goroutines on each replica acquire permits of
// bucket until stop, recording when each call started and counting
// failed acquisitions (each followed by 50 ms of rest); wait waits for
// them.
func callUntil(t *testing.T, reps []*replica, bucket string, p Policy, callers int, stop time.Time, rec *recorder) (errs *atomic.Int64, wait func()) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), time.Until(stop)+time.Minute)
	errs = &atomic.Int64{}
	var wg sync.WaitGroup
	for _, r := range reps {
		b, err := r.gate.Bucket(bucket, p)
		if err != nil {
			t.Fatal(err)
		}
		for range callers {
			wg.Go(func() {
				for time.Now().Before(stop) && ctx.Err() == nil {
					permit, err := b.Acquire(ctx)
					if err != nil {
						errs.Add(1)
						time.Sleep(50 * time.Millisecond)
						continue
					}
					rec.add(permit.granted)
				}
			})
		}
	}
	// A test that ends early (a Fatal) stops its callers on the way out.
	t.Cleanup(func() { cancel(); wg.Wait() })
	return errs, func() { wg.Wait(); cancel() }
}

// checkWindows asserts G1 for every limit of p: the most calls in any
// sliding window and in the fixed windows of phases random phases.
func checkWindows(t *testing.T, ts []time.Time, p Policy, phases int) {
	t.Helper()
	rng := rand.New(rand.NewPCG(uint64(time.Now().UnixNano()), 7))
	for _, l := range p.Limits {
		sliding := windows.MaxSliding(ts, l.Window)
		worstFixed := 0
		for range phases {
			phase := time.Duration(rng.Int64N(int64(l.Window)))
			worstFixed = max(worstFixed, windows.MaxFixed(ts, l.Window, phase))
		}
		t.Logf("limit %s: %d calls, most in a sliding window %d, in a fixed window (%d phases) %d",
			l, len(ts), sliding, phases, worstFixed)
		if sliding > l.Rate || worstFixed > l.Rate {
			t.Errorf("G1 violated for %s: %d calls in a sliding window, %d in a fixed one", l, sliding, worstFixed)
		}
	}
}

func logStats(t *testing.T, r *replica, bucket string, p Policy) {
	t.Helper()
	b, err := r.gate.Bucket(bucket, p)
	if err != nil {
		t.Fatal(err)
	}
	st, err := b.Stats(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	t.Logf("gate: %d granted, %d deferred, %d given up late, %d resets", st.Granted, st.Deferred, st.Late, st.Resets)
}

// testEpoch is a Redis time (µs) for tests that set their own: the start of
// a clock minute.
var testEpoch = time.Date(2026, 1, 1, 0, 0, 0, 0, time.UTC).UnixMicro()

// redisClock is the Redis time a gate's scripts see in a test
// (Gate.testNow): it moves only when the test moves it.
type redisClock struct{ us atomic.Int64 }

// fakeRedisTime makes g's scripts read the time from the returned clock,
// starting at start (µs).
func fakeRedisTime(g *Gate, start int64) *redisClock {
	c := &redisClock{}
	c.us.Store(start)
	g.testNow = c.us.Load
	return c
}

func (c *redisClock) now() int64              { return c.us.Load() }
func (c *redisClock) set(us int64)            { c.us.Store(us) }
func (c *redisClock) advance(d time.Duration) { c.us.Add(d.Microseconds()) }

// grantTicks reserves ticks of b until n are granted, and returns them in
// Redis time (µs), in the order granted. b's gate must read the time from
// clk: a deferral moves clk to the moment the gate said to ask again, so
// nothing sleeps.
func grantTicks(t *testing.T, b *Bucket, clk *redisClock, n int) []int64 {
	t.Helper()
	var ticks []int64
	for tries := 0; len(ticks) < n; tries++ {
		if tries > 2*n+10 {
			t.Fatalf("%d grants after %d reservations", len(ticks), tries)
		}
		r := reserveOnce(t, b)
		if !r.ok {
			clk.advance(r.wait)
			continue
		}
		ticks = append(ticks, clk.now()+r.wait.Microseconds())
	}
	return ticks
}

// reserveOnce is one reservation of a unit call of b; a deferral always
// says how long to wait.
func reserveOnce(t *testing.T, b *Bucket) reservation {
	t.Helper()
	r, err := b.reserve(context.Background(), Request{})
	if err != nil {
		t.Fatal(err)
	}
	if !r.ok && r.wait <= 0 {
		t.Fatalf("deferred (reason %d) with nothing to wait", r.reason)
	}
	return r
}

// utilisation is the share of the ticks between the first and the last
// call that carried a call: 1 when no tick was lost.
func utilisation(ts []time.Time, iv time.Duration, burst int) float64 {
	if len(ts) < 2 {
		return 0
	}
	lo, hi := ts[0], ts[0]
	for _, x := range ts {
		if x.Before(lo) {
			lo = x
		}
		if x.After(hi) {
			hi = x
		}
	}
	ticks := float64(hi.Sub(lo)+iv) / float64(iv)
	return float64(len(ts)) / (ticks * float64(burst))
}

func TestGateWindowSafety(t *testing.T) {
	addr := redistest.Addr(t)
	ms := time.Millisecond
	// G1 and every call started are asserted. G2, the share of ticks that
	// carried a call, is logged: on the wall clock a host stall longer
	// than the tolerance makes every caller of the stalled ticks give them
	// up (with a burst of b one stall costs b grants), so it measures the
	// machine's load too.
	tests := []struct {
		name     string
		p        Policy
		replicas int
		callers  int
		calls    int
	}{
		{"few per window", Policy{Limits: []Limit{{Rate: 10, Window: 200 * ms}}}, 4, 4, 200},
		{"100 per second", Policy{Limits: []Limit{{Rate: 100, Window: time.Second}}}, 4, 8, 400},
		{"2000 per second", Policy{Limits: []Limit{{Rate: 2000, Window: time.Second}}}, 4, 16, 4000},
		{"two limits", Policy{Limits: []Limit{{Rate: 20, Window: 100 * ms}, {Rate: 50, Window: time.Second, Spread: true}}}, 4, 4, 200},
		{"burst 10", Policy{Limits: []Limit{{Rate: 200, Window: time.Second}}, Burst: 10}, 4, 8, 1000},
		{"burst 4 with two limits", Policy{Limits: []Limit{{Rate: 8, Window: 100 * ms}, {Rate: 60, Window: time.Second, Spread: true}}, Burst: 4}, 4, 4, 320},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			t.Parallel() // safety only: side by side, a busy machine is part of the test
			prefix := redistest.Prefix(t)
			var reps []*replica
			for range tt.replicas {
				reps = append(reps, newReplica(t, addr, prefix, nil))
			}
			rec := &recorder{}
			drain(t, reps, "acme", tt.p, tt.callers, tt.calls, rec)
			ts := rec.times()
			if len(ts) != tt.calls {
				t.Fatalf("%d calls started, want %d", len(ts), tt.calls)
			}
			checkWindows(t, ts, tt.p, 60)
			logStats(t, reps[0], "acme", tt.p)
			iv, burst := tt.p.Tick()
			u := utilisation(ts, iv, burst)
			t.Logf("utilisation %.4f of %.1f calls per %s", u, EffectiveRate(iv, burst, tt.p.Limits[0].Window), tt.p.Limits[0].Window)
		})
	}
}

// TestGateSkewedClocks runs replicas whose clocks disagree by seconds: the
// waits are relative to Redis time, so the skew must not matter: G1 holds
// and every call starts (the utilisation is logged).
func TestGateSkewedClocks(t *testing.T) {
	t.Parallel()
	addr := redistest.Addr(t)
	prefix := redistest.Prefix(t)
	p := Policy{Limits: []Limit{{Rate: 100, Window: time.Second}}}
	var reps []*replica
	for _, off := range []time.Duration{-2 * time.Second, 0, 700 * time.Millisecond, 3 * time.Second} {
		reps = append(reps, newReplica(t, addr, prefix, skewedClock{off}))
	}
	rec := &recorder{}
	drain(t, reps, "acme", p, 8, 300, rec)
	ts := rec.times()
	if len(ts) != 300 {
		t.Fatalf("%d calls started, want 300", len(ts))
	}
	checkWindows(t, ts, p, 60)
	iv, burst := p.Tick()
	t.Logf("utilisation %.4f", utilisation(ts, iv, burst))
}

// TestGateIdleThenBacklog has a backlog, then silence longer than a window,
// then a backlog again: the gate must not catch up on the idle ticks.
func TestGateIdleThenBacklog(t *testing.T) {
	t.Parallel()
	addr := redistest.Addr(t)
	prefix := redistest.Prefix(t)
	p := Policy{Limits: []Limit{{Rate: 50, Window: 500 * time.Millisecond}}}
	reps := []*replica{newReplica(t, addr, prefix, nil), newReplica(t, addr, prefix, nil)}
	rec := &recorder{}
	drain(t, reps, "acme", p, 8, 120, rec)
	time.Sleep(700 * time.Millisecond)
	drain(t, reps, "acme", p, 8, 120, rec)
	checkWindows(t, rec.times(), p, 60)
}

// TestGateColdStartNoBurst checks the very first grants of a new bucket:
// however many callers arrive at once, the first window holds no more than
// the rate.
func TestGateColdStartNoBurst(t *testing.T) {
	addr := redistest.Addr(t)
	prefix := redistest.Prefix(t)
	p := Policy{Limits: []Limit{{Rate: 10, Window: 200 * time.Millisecond}}, Burst: 5}
	var reps []*replica
	for range 4 {
		reps = append(reps, newReplica(t, addr, prefix, nil))
	}
	rec := &recorder{}
	drain(t, reps, "acme", p, 16, 30, rec)
	ts := rec.times()
	checkWindows(t, ts, p, 60)
	// The first burst is at most Burst calls.
	first := ts[0]
	for _, x := range ts {
		if x.Before(first) {
			first = x
		}
	}
	n := 0
	for _, x := range ts {
		if x.Sub(first) < 20*time.Millisecond {
			n++
		}
	}
	if n > 5 {
		t.Errorf("%d calls in the first 20ms after a cold start, want <= burst 5", n)
	}
}

// TestGateSeparateProcesses runs the replicas as separate OS processes.
func TestGateSeparateProcesses(t *testing.T) {
	t.Parallel() // safety only: runs beside the other gate tests
	addr := redistest.Addr(t)
	prefix := redistest.Prefix(t)
	const procs, each = 3, 120
	p := Policy{Limits: []Limit{{Rate: 100, Window: time.Second}}}
	var cmds []*exec.Cmd
	var outs []*strings.Builder
	for range procs {
		cmd := exec.Command(os.Args[0], "-test.run=^$")
		cmd.Env = append(os.Environ(), helperEnv+"=1", "HELPER_ADDR="+addr, "HELPER_PREFIX="+prefix,
			"HELPER_CALLS="+strconv.Itoa(each), "HELPER_RATE=100", "HELPER_WINDOW=1s")
		out := &strings.Builder{}
		cmd.Stdout, cmd.Stderr = out, os.Stderr
		if err := cmd.Start(); err != nil {
			t.Fatal(err)
		}
		cmds, outs = append(cmds, cmd), append(outs, out)
	}
	var ts []time.Time
	for i, cmd := range cmds {
		if err := cmd.Wait(); err != nil {
			t.Fatalf("helper %d: %v", i, err)
		}
		sc := bufio.NewScanner(strings.NewReader(outs[i].String()))
		for sc.Scan() {
			ns, err := strconv.ParseInt(sc.Text(), 10, 64)
			if err != nil {
				t.Fatalf("helper %d printed %q", i, sc.Text())
			}
			ts = append(ts, time.Unix(0, ns))
		}
	}
	if len(ts) != procs*each {
		t.Fatalf("%d calls, want %d", len(ts), procs*each)
	}
	checkWindows(t, ts, p, 60)
}

// runHelper is a replica process for TestGateSeparateProcesses: it starts
// HELPER_CALLS calls with 8 callers and prints their start times.
func runHelper() int {
	calls, _ := strconv.Atoi(os.Getenv("HELPER_CALLS"))
	rate, _ := strconv.Atoi(os.Getenv("HELPER_RATE"))
	window, _ := time.ParseDuration(os.Getenv("HELPER_WINDOW"))
	rdb := redis.NewClient(&redis.Options{Addr: os.Getenv("HELPER_ADDR")})
	defer rdb.Close()
	b, err := NewGate(rdb, Config{KeyPrefix: os.Getenv("HELPER_PREFIX")}).Bucket("acme", Policy{Limits: []Limit{{Rate: rate, Window: window}}})
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 2
	}
	var left atomic.Int64
	left.Store(int64(calls))
	var mu sync.Mutex
	var starts []int64
	var wg sync.WaitGroup
	var failed atomic.Bool
	for range 8 {
		wg.Go(func() {
			for left.Add(-1) >= 0 {
				if _, err := b.Acquire(context.Background()); err != nil {
					fmt.Fprintln(os.Stderr, err)
					failed.Store(true)
					return
				}
				now := time.Now().UnixNano()
				mu.Lock()
				starts = append(starts, now)
				mu.Unlock()
			}
		})
	}
	wg.Wait()
	for _, s := range starts {
		fmt.Println(s)
	}
	if failed.Load() {
		return 1
	}
	return 0
}

// TestGateMaxInFlight has a client take a slot and die without releasing
// it: the others must stay within the cap while its lease lives, and get
// the slot back when the lease expires.
func TestGateMaxInFlight(t *testing.T) {
	t.Parallel()
	addr := redistest.Addr(t)
	prefix := redistest.Prefix(t)
	const leaseTTL = 1500 * time.Millisecond
	p := Policy{Limits: []Limit{{Rate: 200, Window: time.Second}}, MaxInFlight: 2, LeaseTTL: leaseTTL}
	reps := []*replica{newReplica(t, addr, prefix, nil), newReplica(t, addr, prefix, nil), newReplica(t, addr, prefix, nil)}
	ctx := context.Background()

	dead, err := reps[0].gate.Bucket("acme", p)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := dead.Acquire(ctx); err != nil { // never released: the holder "crashed"
		t.Fatal(err)
	}
	crashed := time.Now()

	var inFlight, peakBefore, peakAfter atomic.Int64
	var wg sync.WaitGroup
	stop := crashed.Add(leaseTTL + 1500*time.Millisecond)
	for _, r := range reps[1:] {
		b, err := r.gate.Bucket("acme", p)
		if err != nil {
			t.Fatal(err)
		}
		for range 4 {
			wg.Go(func() {
				for time.Now().Before(stop) {
					permit, err := b.Acquire(ctx)
					if err != nil {
						t.Errorf("acquire: %v", err)
						return
					}
					n := inFlight.Add(1)
					peak := &peakAfter
					// Leave a margin around the expiry for clock differences.
					if time.Since(crashed) < leaseTTL-100*time.Millisecond {
						peak = &peakBefore
					}
					for {
						old := peak.Load()
						if n <= old || peak.CompareAndSwap(old, n) {
							break
						}
					}
					time.Sleep(20 * time.Millisecond) // the call
					inFlight.Add(-1)
					if err := permit.Release(ctx); err != nil {
						t.Errorf("release: %v", err)
					}
				}
			})
		}
	}
	wg.Wait()
	t.Logf("most calls in flight: %d while the dead lease lived, %d after it expired", peakBefore.Load(), peakAfter.Load())
	if peakBefore.Load() != 1 {
		t.Errorf("while a dead client holds one of 2 slots, %d calls ran at once, want 1", peakBefore.Load())
	}
	if peakAfter.Load() != 2 {
		t.Errorf("after the dead lease expired, %d calls ran at once, want 2", peakAfter.Load())
	}
}

// TestOwnRedisGateRestart kills Redis mid-run and starts it again empty: the
// ticks reserved before the loss still go out, and the gate must wait them
// out instead of starting a second stream on top of them.
func TestOwnRedisGateRestart(t *testing.T) {
	srv := redistest.Start(t)
	prefix := redistest.Prefix(t)
	p := Policy{Limits: []Limit{{Rate: 100, Window: time.Second}}}
	var reps []*replica
	for range 3 {
		reps = append(reps, newReplica(t, srv.Addr, prefix, nil))
	}
	rec := &recorder{}
	stop := time.Now().Add(4 * time.Second)
	errs, wait := callUntil(t, reps, "acme", p, 40, stop, rec)
	time.Sleep(1500 * time.Millisecond)
	srv.Kill()
	time.Sleep(300 * time.Millisecond)
	if err := srv.Restart(); err != nil {
		t.Fatal(err)
	}
	wait()
	ts := rec.times()
	t.Logf("%d calls, %d failed acquisitions while Redis was down", len(ts), errs.Load())
	// The state was lost: the grant counter restarted from zero.
	b, _ := reps[0].gate.Bucket("acme", p)
	st, err := b.Stats(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	if st.Granted >= int64(len(ts)) || st.Resets != 1 {
		t.Errorf("after the restart the gate counts %d grants and %d resets: the state was not lost (%d calls in all)", st.Granted, st.Resets, len(ts))
	}
	checkWindows(t, ts, p, 60)
	// The gate recovered: calls went out after the restart.
	last := ts[0]
	for _, x := range ts {
		if x.After(last) {
			last = x
		}
	}
	if time.Until(stop) > -500*time.Millisecond && last.Before(stop.Add(-time.Second)) {
		t.Errorf("no call in the last second: the gate did not recover after the restart")
	}
}

func TestReserveDeferredIsNotAnError(t *testing.T) {
	rdb := redistest.Client(t)
	g := NewGate(rdb, Config{KeyPrefix: redistest.Prefix(t)})
	b, err := g.Bucket("acme", Policy{Limits: []Limit{{Rate: 1, Window: time.Minute}}, Horizon: 100 * time.Millisecond})
	if err != nil {
		t.Fatal(err)
	}
	ctx := context.Background()
	r, err := b.reserve(ctx, Request{})
	if err != nil || r.ok || r.reason != stateReset {
		t.Fatalf("first reserve on a new bucket = %+v, %v; want deferred for a state reset", r, err)
	}
	if _, err := g.Bucket("a{b}", Policy{Limits: []Limit{{Rate: 1, Window: time.Second}}}); err == nil {
		t.Error("a bucket name with a hash tag brace was accepted")
	}
	if _, err := g.Bucket("acme", Policy{Limits: []Limit{{Rate: 1, Window: time.Second}}, Burst: 2}); !errors.Is(err, errBurstOver) {
		t.Errorf("burst over rate: err = %v, want errBurstOver", err)
	}
}

// TestGateStateIsSmall checks that a bucket's state in Redis is a few small
// keys whatever has passed through it.
func TestGateStateIsSmall(t *testing.T) {
	rdb := redistest.Client(t)
	if strings.Contains(redistest.Kind(), "miniredis") {
		t.Skip("MEMORY USAGE needs a real Redis; set REDIS_ADDR")
	}
	prefix := redistest.Prefix(t)
	g := NewGate(rdb, Config{KeyPrefix: prefix})
	b, err := g.Bucket("acme", Policy{Limits: []Limit{{Rate: 1_000_000, Window: time.Second}}, NoGuard: true, MaxInFlight: 8})
	if err != nil {
		t.Fatal(err)
	}
	ctx := context.Background()
	ctl := b.Control()
	if _, err := ctl.Pause(ctx, time.Millisecond, "test"); err != nil {
		t.Fatal(err)
	}
	if err := ctl.overrideRate(ctx, 900_000, "test"); err != nil {
		t.Fatal(err)
	}
	if err := ctl.CountRateLimited(ctx); err != nil {
		t.Fatal(err)
	}
	granted := 0
	for granted < 5000 {
		r, err := b.reserve(ctx, Request{})
		if err != nil {
			t.Fatal(err)
		}
		if r.ok {
			granted++
			if err := b.giveUp(ctx, r.lease, "", 0, 1, ""); err != nil {
				t.Fatal(err)
			}
		}
	}
	keys, err := rdb.Keys(ctx, prefix+":*").Result()
	if err != nil {
		t.Fatal(err)
	}
	total := int64(0)
	for _, k := range keys {
		n, err := rdb.MemoryUsage(ctx, k).Result()
		if err != nil {
			t.Fatal(err)
		}
		t.Logf("%s: %d bytes", k, n)
		total += n
	}
	ticks, err := rdb.MemoryUsage(ctx, b.keys.ticks).Result()
	if err != nil {
		t.Fatal(err)
	}
	t.Logf("%d keys, %d bytes after %d grants (%d in the ticks list)", len(keys), total, granted, ticks)
	if len(keys) > 7 || total-ticks > 2048 {
		t.Errorf("gate state is %d keys, %d bytes besides the ticks list: want at most 7 keys (gate, control, stats, leases, ticks, and the group's epoch and expiry set) and 2 KiB", len(keys), total-ticks)
	}
	// The ticks list holds three windows at the configured rate, at most
	// maxTickLog ticks (and up to tickTrim more before it is cut back):
	// bounded by the rate, whatever the backlog.
	if n := rdb.LLen(ctx, b.keys.ticks).Val(); n < maxTickLog || n > maxTickLog+tickTrim || ticks > 12*1024 {
		t.Errorf("ticks list: %d ticks, %d bytes; want %d to %d ticks in at most 12 KiB", n, ticks, maxTickLog, maxTickLog+tickTrim)
	}
}

// startWatch runs g.Watch until ctx ends, in a goroutine wg waits for, and
// returns once the subscription is confirmed: a pause published after that
// reaches g.
func startWatch(t *testing.T, ctx context.Context, wg *sync.WaitGroup, g *Gate) {
	t.Helper()
	up := make(chan struct{}, 1)
	g.testWatchedUp = func() {
		select {
		case up <- struct{}{}:
		default: // a resubscription after an error
		}
	}
	wg.Go(func() { g.Watch(ctx) })
	select {
	case <-up:
	case <-time.After(10 * time.Second):
		t.Fatal("Watch did not subscribe within 10s")
	}
}

// TestPauseDropsReservedTicks pauses a bucket while callers on two
// watching replicas hold ticks reserved up to a horizon ahead: once a
// replica has heard of the pause, it hands out no permit inside it. The
// check is on the gate's own record of when it heard and when it handed
// each permit out, not on wall-clock slack, so a loaded machine that
// delivers the message late, or runs a caller late, cannot fail it; the
// test also asserts that both replicas heard and that ticks were dropped.
func TestPauseDropsReservedTicks(t *testing.T) {
	t.Parallel()
	p := Policy{Limits: []Limit{{Rate: 100, Window: time.Second}}}
	type heard struct{ at, until time.Time }
	noted := make([]heard, 2) // written under each gate's mu, read after the drain
	reps := watchingReplicas(t, 2, func(i int, g *Gate) {
		g.testNotedPause = func(_ string, until time.Time) {
			if noted[i].at.IsZero() {
				noted[i] = heard{time.Now(), until}
			}
		}
	})
	var pausedAt time.Time
	const pause = 600 * time.Millisecond
	var wg sync.WaitGroup
	wg.Go(func() {
		time.Sleep(2500 * time.Millisecond) // a backlog with ticks reserved ahead
		b, _ := reps[0].gate.Bucket("acme", p)
		pausedAt = time.Now()
		if _, err := b.Control().Pause(context.Background(), pause, "test"); err != nil {
			t.Error(err)
		}
	})
	granted := drainPermits(t, reps, "acme", p, 16, 400)
	wg.Wait()
	for i, r := range reps {
		r.gate.mu.Lock()
		h := noted[i]
		r.gate.mu.Unlock()
		if h.at.IsZero() {
			t.Errorf("replica %d never heard of the pause", i)
			continue
		}
		inside := 0
		for _, at := range granted[i] {
			if at.After(h.at) && at.Before(h.until) {
				inside++
			}
		}
		t.Logf("replica %d heard of the %s pause %s after it was set; %d permits handed out inside it after that",
			i, pause, h.at.Sub(pausedAt).Round(time.Millisecond), inside)
		if inside > 0 {
			t.Errorf("replica %d handed out %d permits inside the pause after hearing of it", i, inside)
		}
	}
	b, _ := reps[1].gate.Bucket("acme", p)
	st, _ := b.Stats(context.Background())
	t.Logf("%d reserved ticks dropped", st.Dropped)
	if st.Dropped == 0 {
		t.Error("no reserved tick was dropped: the test did not pause a busy bucket")
	}
}

// drainPermits is drain recording, per replica, the local time each
// permit was handed out (Permit.granted).
func drainPermits(t *testing.T, reps []*replica, bucket string, p Policy, callers, calls int) [][]time.Time {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	var left atomic.Int64
	left.Store(int64(calls))
	var mu sync.Mutex
	granted := make([][]time.Time, len(reps))
	var wg sync.WaitGroup
	for i, r := range reps {
		b, err := r.gate.Bucket(bucket, p)
		if err != nil {
			t.Fatal(err)
		}
		for range callers {
			wg.Go(func() {
				for left.Add(-1) >= 0 {
					permit, err := b.Acquire(ctx)
					if err != nil {
						t.Errorf("acquire: %v", err)
						return
					}
					mu.Lock()
					granted[i] = append(granted[i], permit.granted)
					mu.Unlock()
					_ = permit.Release(ctx)
				}
			})
		}
	}
	wg.Wait()
	return granted
}

// TestRespaceAppliesAtOnce lowers a busy bucket's rate from 100/s to 25/s
// while callers on two watching replicas hold ticks reserved up to a
// horizon ahead at the old spacing, and respaces it: those ticks are
// dropped and asked for again, so from a moment after the change no
// sliding second holds more than the new rate (without the respace, up
// to a second of calls at 100/s still go out).
func TestRespaceAppliesAtOnce(t *testing.T) {
	t.Parallel() // safety only: runs beside the other gate tests
	p := Policy{Limits: []Limit{{Rate: 100, Window: time.Second}}}
	// When each replica heard of the respace and dropped the ticks it
	// held at the old spacing: what the change's moment is measured
	// from, whatever the machine's load made of the message's way.
	var heardMu sync.Mutex
	heard := make([]time.Time, 2)
	reps := watchingReplicas(t, 2, func(i int, g *Gate) {
		g.testNotedRespace = func(_ string, at time.Time) {
			heardMu.Lock()
			heard[i] = latest(heard[i], at)
			heardMu.Unlock()
		}
	})
	rec := &recorder{}
	var changedAt, respaced time.Time
	var wg sync.WaitGroup
	wg.Go(func() {
		time.Sleep(1500 * time.Millisecond) // a backlog with ticks reserved ahead
		b, _ := reps[0].gate.Bucket("acme", p)
		changedAt = time.Now()
		if err := b.Control().overrideRate(context.Background(), 25, "test"); err != nil {
			t.Error(err)
		}
		if err := b.Control().Respace(context.Background()); err != nil {
			t.Error(err)
		}
		respaced = time.Now()
	})
	drain(t, reps, "acme", p, 16, 250, rec)
	wg.Wait()
	// From respaceSlack after the respace took effect everywhere (its
	// script ran and every replica heard of it), the new rate: ticks at
	// the old spacing within respaceSlack of it stand.
	heardMu.Lock()
	took := respaced
	for _, h := range heard { // none: the line reached no further than respaceSlack, nothing was cut
		took = latest(took, h)
	}
	heardMu.Unlock()
	t.Logf("the respace took effect everywhere %s after the change began (its round trips and the message's way)", took.Sub(changedAt).Round(time.Millisecond))
	from := took.Add(respaceSlack)
	var after []time.Time
	lastOld := changedAt
	for _, x := range rec.times() {
		if x.After(from) {
			after = append(after, x)
		} else if x.After(lastOld) {
			lastOld = x
		}
	}
	most := windows.MaxSliding(after, time.Second)
	b, _ := reps[1].gate.Bucket("acme", p)
	st, _ := b.Stats(context.Background())
	t.Logf("rate 100/s -> 25/s: last call at the old spacing %s after the change; then at most %d calls in a sliding second (%d calls); %d reserved ticks dropped",
		lastOld.Sub(changedAt).Round(time.Millisecond), most, len(after), st.Dropped)
	if most > 25 {
		t.Errorf("%d calls in a sliding second after the change to 25/s", most)
	}
	if len(after) < 10 {
		t.Errorf("only %d calls after the change: the test did not respace a busy bucket", len(after))
	}
}

// latest is the later of a and b.
func latest(a, b time.Time) time.Time {
	if a.After(b) {
		return a
	}
	return b
}

// watchingReplicas returns n replicas on one Redis and key prefix, each
// with its gate watching pauses and respaces until the test ends; each
// before function is applied to replica i's gate before it starts to
// watch (to set test hooks without a race).
func watchingReplicas(t *testing.T, n int, before ...func(i int, g *Gate)) []*replica {
	t.Helper()
	addr, prefix := redistest.Addr(t), redistest.Prefix(t)
	ctx, cancel := context.WithCancel(context.Background())
	var watchers sync.WaitGroup
	var reps []*replica
	for range n {
		reps = append(reps, newReplica(t, addr, prefix, nil))
	}
	t.Cleanup(func() { cancel(); watchers.Wait() }) // before the replicas' clients close
	for i, r := range reps {
		for _, f := range before {
			f(i, r.gate)
		}
		startWatch(t, ctx, &watchers, r.gate)
	}
	return reps
}

// TestRespaceAppliesARaiseAtOnce raises two replicas' configured rate
// from 50/s to 100/s mid-drain, each replica respacing on its new handle
// while its callers still wait under the old one: no sliding second holds
// more than 100 calls across the raise. How soon the new rate shows (98
// calls in the second starting a second after the change, once applied)
// is logged, as load moves it; the test asserts only that calls go on.
func TestRespaceAppliesARaiseAtOnce(t *testing.T) {
	t.Parallel()
	slow := Policy{Limits: []Limit{{Rate: 50, Window: time.Second}}}
	fast := Policy{Limits: []Limit{{Rate: 100, Window: time.Second}}}
	reps := watchingReplicas(t, 2)
	rec := &recorder{}
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	var changedAt time.Time
	var handles [2]atomic.Pointer[Bucket]
	for i, r := range reps {
		b, err := r.gate.Bucket("acme", slow)
		if err != nil {
			t.Fatal(err)
		}
		handles[i].Store(b)
	}
	end := time.Now().Add(4 * time.Second)
	var wg sync.WaitGroup
	for i := range reps {
		for range 16 {
			wg.Go(func() {
				for time.Now().Before(end) {
					permit, err := handles[i].Load().Acquire(ctx)
					if err != nil {
						t.Errorf("acquire: %v", err)
						return
					}
					rec.add(permit.granted)
					_ = permit.Release(ctx)
				}
			})
		}
	}
	time.Sleep(1500 * time.Millisecond) // a backlog with ticks reserved ahead at 50/s
	changedAt = time.Now()
	for i, r := range reps {
		b, err := r.gate.Bucket("acme", fast)
		if err != nil {
			t.Fatal(err)
		}
		handles[i].Store(b)
		if err := b.Control().Respace(ctx); err != nil {
			t.Fatal(err)
		}
	}
	wg.Wait()
	ts := rec.times()
	var second []time.Time // the second that starts a second after the change
	for _, x := range ts {
		if !x.Before(changedAt.Add(time.Second)) && x.Before(changedAt.Add(2*time.Second)) {
			second = append(second, x)
		}
	}
	most := windows.MaxSliding(ts, time.Second)
	t.Logf("rate 50/s -> 100/s: %d calls in the second starting 1 s after the change; at most %d in any sliding second", len(second), most)
	if most > 100 {
		t.Errorf("%d calls in a sliding second: a burst across the raise", most)
	}
	if len(second) == 0 {
		t.Errorf("no call in the second starting 1 s after the raise to 100/s")
	}
}
