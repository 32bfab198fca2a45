package shaper

import (
	"context"
	"fmt"
	"math/rand/v2"
	"os"
	"path/filepath"
	"reflect"
	"regexp"
	"slices"
	"sort"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/shaper-dev/shaper/internal/redistest"
)

// TestScriptBindings checks that each script fed from a Go struct binds
// every KEYS and ARGV entry to a named local at its top, in the order Go
// passes them: the keys as its key names list them, the arguments as the
// fields of its args struct, which argv returns in order.
func TestScriptBindings(t *testing.T) {
	if got := len(keysOf("p", "g", "b").reserve()); got != len(reserveKeyNames) {
		t.Errorf("bucketKeys.reserve passes %d keys, reserveKeyNames has %d", got, len(reserveKeyNames))
	}
	if got := len(keysOf("p", "g", "b").core()); got != len(coreKeyNames) {
		t.Errorf("bucketKeys.core passes %d keys, coreKeyNames has %d", got, len(coreKeyNames))
	}
	// Replies name their codes (codesLua, made from the Go constants):
	// a bare number where a code goes could drift from Go.
	for name, body := range map[string]string{"reserve": reserveLua, "core": coreLua, "adapt": adaptGrantLua, "counted": countedLua} {
		if m := regexp.MustCompile(`return \{-?\d`).FindString(body); m != "" {
			t.Errorf("the %s script returns a bare code (%q): use the names of codesLua", name, m)
		}
		if m := regexp.MustCompile(`reason(, \w+)* = (\w+, )*\d`).FindString(body); m != "" {
			t.Errorf("the %s script sets a bare defer reason (%q): use the names of codesLua", name, m)
		}
		// Every reply has the one shape (replyHeader): a handover, or
		// the header with the items after it; out is the core grant's
		// reply, built from the header.
		for _, m := range regexp.MustCompile(`return (\{|handover|out)[^\n]*`).FindAllString(body, -1) {
			ok := strings.HasPrefix(m, "return handover(NEED_") || m == "return out" ||
				regexp.MustCompile(`^return \{ANSWERED(, [^,]+){4}, (GRANTED|DEFERRED), .+\}$`).MatchString(m)
			if !ok {
				t.Errorf("the %s grant replies %q: reply with handover(...) or {ANSWERED, server, tol, iv, bare, code, wait, reason, tick}", name, m)
			}
		}
	}
	// Hash fields are read by name: an HMGET of named fields is unpacked
	// into locals named beside it, never indexed by position far from the
	// read (an HMGET of a list built at run time pairs names and values in
	// its loop).
	files, err := filepath.Glob("*.go")
	if err != nil {
		t.Fatal(err)
	}
	hmget := regexp.MustCompile(`(unpack\()?redis\.call\('HMGET', [^)]*\)`)
	for _, f := range files {
		if strings.HasSuffix(f, "_test.go") {
			continue
		}
		src, err := os.ReadFile(f)
		if err != nil {
			t.Fatal(err)
		}
		for _, m := range hmget.FindAllStringSubmatch(string(src), -1) {
			if m[1] == "" && !strings.Contains(m[0], "unpack(") {
				t.Errorf("%s: %s reads fields by position: unpack it into named locals", f, m[0])
			}
		}
	}
	for _, sc := range []struct {
		name, body string
		keys       []string
		args       interface{ argv() []any }
	}{
		{"reserve", reserveLua, reserveKeyNames, &fullArgs{}},
		{"counted", countedLua, countedKeyNames, &countedArgs{}},
		{"core", coreLua, coreKeyNames, &coreArgs{}},
		{"adapt", adaptGrantLua, adaptKeyNames, &coreArgs{}},
		{"refused", refusedLua, refusedKeyNames, &refusedArgs{}},
		{"start", startLua, startKeyNames, &startArgs{}},
		{"apply", applyLua, applyKeyNames, &applyArgs{}},
	} {
		t.Run(sc.name, func(t *testing.T) { checkBindings(t, sc.body, sc.keys, sc.args) })
	}
}

// checkBindings checks one script body against its key names and its
// args struct (a pointer; see TestScriptBindings).
func checkBindings(t *testing.T, body string, keyNames []string, args interface{ argv() []any }) {
	keys := regexp.MustCompile(`(?m)^local k_(\w+) = KEYS\[(\d+)\]$`).FindAllStringSubmatch(body, -1)
	var names []string
	for i, m := range keys {
		if n, _ := strconv.Atoi(m[2]); n != i+1 {
			t.Errorf("k_%s binds KEYS[%s], want KEYS[%d]", m[1], m[2], i+1)
		}
		names = append(names, m[1])
	}
	if !slices.Equal(names, keyNames) {
		t.Errorf("the script binds keys %v, Go names %v", names, keyNames)
	}
	if n := len(regexp.MustCompile(`KEYS\[`).FindAllString(body, -1)); n != len(keys) {
		t.Errorf("KEYS is read %d times, bound %d times: read every key through its local", n, len(keys))
	}

	binding := regexp.MustCompile(`(?m)^local a_(\w+) = (?:tonumber\()?ARGV\[(\d+)\].*$`)
	bound := binding.FindAllStringSubmatchIndex(body, -1)
	v := reflect.ValueOf(args).Elem()
	typ := v.Type()
	if len(bound) != typ.NumField() {
		t.Errorf("the script binds %d arguments, %s has %d fields", len(bound), typ.Name(), typ.NumField())
	}
	for i, ix := range bound {
		name, n := body[ix[2]:ix[3]], body[ix[4]:ix[5]]
		if n != strconv.Itoa(i+1) {
			t.Errorf("a_%s binds ARGV[%s], want ARGV[%d]", name, n, i+1)
		}
		if i < typ.NumField() && typ.Field(i).Tag.Get("lua") != name {
			t.Errorf("ARGV[%d] is a_%s in the script, %s (lua:%q) in Go", i+1, name, typ.Field(i).Name, typ.Field(i).Tag.Get("lua"))
		}
	}
	// argv returns the fields in order: give each field a distinct value
	// and find it at its place.
	for i := range typ.NumField() {
		switch f := v.Field(i); f.Kind() {
		case reflect.Int, reflect.Int64:
			f.SetInt(int64(1000 + i))
		case reflect.Float64:
			f.SetFloat(float64(1000 + i))
		case reflect.String:
			f.SetString(fmt.Sprintf("s%d", i))
		case reflect.Bool:
			f.SetBool(true)
		}
	}
	argv := args.argv()
	if len(argv) != typ.NumField() {
		t.Fatalf("argv returns %d values for %d fields", len(argv), typ.NumField())
	}
	for i, x := range argv {
		want := v.Field(i).Interface()
		if b, ok := want.(bool); ok && b {
			want = 1
		}
		if fmt.Sprint(x) != fmt.Sprint(want) {
			t.Errorf("argv()[%d] = %v, want field %s = %v", i, x, typ.Field(i).Name, want)
		}
	}
	// Every ARGV read goes through a local: no ARGV[n] past the bindings.
	if len(bound) == 0 {
		return
	}
	rest := body[bound[len(bound)-1][1]:]
	for _, m := range regexp.MustCompile(`ARGV\[(\d+)\]`).FindAllStringSubmatch(rest, -1) {
		t.Errorf("ARGV[%s] is read past the bindings", m[1])
	}
	if n := len(regexp.MustCompile(`ARGV\[`).FindAllString(body, -1)); n != len(bound) {
		t.Errorf("ARGV is read %d times, bound %d times", n, len(bound))
	}
}

// simCall is one call of a simulation: when it was granted, its cost.
type simCall struct {
	at   int64 // Redis time (µs)
	cost int
}

// simulate drives a bucket through n calls on the virtual Redis clock:
// each call asks until it is granted, with the clock moved to the
// moment the gate said to come back; a granted call starts at its tick,
// and the clock moves to it (one caller at a time, as a worker's calls
// come one after another).
func simulate(t *testing.T, b *Bucket, clk *redisClock, n int, req func(i int) Request) []simCall {
	t.Helper()
	ctx := context.Background()
	var out []simCall
	for i := 0; i < n; i++ {
		r := req(i)
		for tries := 0; ; tries++ {
			if tries > 10_000 {
				t.Fatalf("call %d not granted after %d reservations", i, tries)
			}
			res, err := b.reserve(ctx, r)
			if err != nil {
				t.Fatal(err)
			}
			if !res.ok {
				if res.wait <= 0 {
					t.Fatalf("deferred (reason %d) with nothing to wait", res.reason)
				}
				clk.advance(res.wait)
				continue
			}
			clk.advance(res.wait)
			out = append(out, simCall{at: clk.now(), cost: max(r.Cost, 1)})
			break
		}
	}
	return out
}

// maxUnits is the most units the calls put in any half-open interval of
// length w (a sliding window: every fixed window at every phase).
func maxUnits(calls []simCall, w time.Duration) int {
	sort.Slice(calls, func(i, j int) bool { return calls[i].at < calls[j].at })
	most, sum, lo := 0, 0, 0
	for hi := range calls {
		sum += calls[hi].cost
		for calls[hi].at-calls[lo].at >= w.Microseconds() {
			sum -= calls[lo].cost
			lo++
		}
		most = max(most, sum)
	}
	return most
}

func one(int) Request { return Request{} }

// TestQuotaPaceThenWait is the quota of issue 18 on the real script and
// a virtual clock: 20 per second and 300 per minute. 250 calls go out at
// the pace of the per-second limit (not spread over the minute); 100 more
// 20 s after the first: 50 at once, the rest only when the first calls
// leave the minute; never more than 20 in a second or 300 in a minute.
func TestQuotaPaceThenWait(t *testing.T) {
	g := NewGate(redistest.Client(t), Config{KeyPrefix: redistest.Prefix(t)})
	clk := fakeRedisTime(g, testEpoch)
	p := Policy{Limits: []Limit{{Rate: 20, Window: time.Second}, {Rate: 300, Window: time.Minute}}}
	if !p.Quota(1) || p.Quota(0) {
		t.Fatal("the minute limit must be a quota, the second spaced")
	}
	b, err := g.Bucket("crm", p)
	if err != nil {
		t.Fatal(err)
	}
	first := simulate(t, b, clk, 250, one)
	start := first[0].at
	took := time.Duration(first[len(first)-1].at-start) * time.Microsecond
	t.Logf("250 calls in %v", took)
	if took > 13*time.Second {
		t.Errorf("250 calls took %v: the quota slowed the pace (20/s takes 12.75 s with the guard)", took)
	}
	clk.set(start + (20 * time.Second).Microseconds())
	second := simulate(t, b, clk, 100, one)
	at := func(c simCall) time.Duration { return time.Duration(c.at-start) * time.Microsecond }
	t.Logf("the next 100: the 50th at %v, the 51st at %v, the last at %v", at(second[49]), at(second[50]), at(second[99]))
	if at(second[49]) > 23*time.Second {
		t.Errorf("the 50th of the second batch at %v: what was left of the quota did not go at once", at(second[49]))
	}
	if at(second[50]) < 60*time.Second {
		t.Errorf("the 51st of the second batch at %v: the quota let it go before the first calls left the minute", at(second[50]))
	}
	// The counter errs by at most one slot (1/60 of the window).
	if at(second[50]) > 62*time.Second {
		t.Errorf("the 51st of the second batch at %v: more than a slot after the first calls left the minute", at(second[50]))
	}
	all := append(first, second...)
	if n := maxUnits(all, time.Second); n > 20 {
		t.Errorf("%d calls in a second, limit 20", n)
	}
	if n := maxUnits(all, time.Minute); n > 300 {
		t.Errorf("%d calls in a minute, limit 300", n)
	}
	use, err := b.limitUse(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	if q := use[1]; !q.Quota || q.Used+q.Left != 300 || q.Used < 50 {
		t.Errorf("quota use %+v", q)
	}
}

// TestQuotaStateIsBounded spends an hourly quota of 5,000 at 50 per
// second: the counters stay a few dozen fields whatever the quota, no
// hour holds more than 5,000 calls, and the next call waits for the
// first to leave the hour.
func TestQuotaStateIsBounded(t *testing.T) {
	rdb := redistest.Client(t)
	g := NewGate(rdb, Config{KeyPrefix: redistest.Prefix(t)})
	clk := fakeRedisTime(g, testEpoch)
	b, err := g.Bucket("gh", Policy{Limits: []Limit{{Rate: 50, Window: time.Second}, {Rate: 5000, Window: time.Hour}}})
	if err != nil {
		t.Fatal(err)
	}
	calls := simulate(t, b, clk, 5001, one)
	fields, err := rdb.HLen(context.Background(), b.keys.counts).Result()
	if err != nil {
		t.Fatal(err)
	}
	t.Logf("5,001 calls: %d counter fields", fields)
	if fields > 2*(limitSlots+10) {
		t.Errorf("%d counter fields for two limits: the state grows with the calls", fields)
	}
	if n := maxUnits(calls, time.Hour); n > 5000 {
		t.Errorf("%d calls in an hour, quota 5000", n)
	}
	last := time.Duration(calls[5000].at-calls[0].at) * time.Microsecond
	if last < time.Hour || last > time.Hour+2*time.Hour/limitSlots {
		t.Errorf("the 5,001st call %v after the first, want an hour (and at most two slots) later", last)
	}
}

// TestCostsKeepEveryLimit draws costs of 1 to 10 units against 100 units
// per second and a quota of 3,000 per minute: no second holds more than
// 100 units, no minute more than 3,000, and the units flow at no less
// than 95% of the per-second limit while the quota lasts.
func TestCostsKeepEveryLimit(t *testing.T) {
	g := NewGate(redistest.Client(t), Config{KeyPrefix: redistest.Prefix(t)})
	clk := fakeRedisTime(g, testEpoch)
	b, err := g.Bucket("shop", Policy{Limits: []Limit{{Rate: 100, Window: time.Second}, {Rate: 3000, Window: time.Minute}}})
	if err != nil {
		t.Fatal(err)
	}
	rng := rand.New(rand.NewPCG(18, 5))
	costs := make([]int, 1000)
	for i := range costs {
		costs[i] = 1 + rng.IntN(10)
	}
	calls := simulate(t, b, clk, len(costs), func(i int) Request { return Request{Cost: costs[i]} })
	if n := maxUnits(calls, time.Second); n > 100 {
		t.Errorf("%d units in a second, limit 100", n)
	}
	if n := maxUnits(calls, time.Minute); n > 3000 {
		t.Errorf("%d units in a minute, quota 3000", n)
	}
	// While the quota lasts (the first 2,900 units): the share of the
	// per-second limit delivered.
	units, i := 0, 0
	for ; i < len(calls) && units+calls[i].cost <= 2900; i++ {
		units += calls[i].cost
	}
	span := time.Duration(calls[i-1].at-calls[0].at)*time.Microsecond + time.Second/100*time.Duration(calls[i-1].cost)
	share := float64(units) / (span.Seconds() * 100)
	t.Logf("%d units in %v: %.1f%% of 100 units/s", units, span, 100*share)
	if share < 0.95 {
		t.Errorf("%.1f%% of the units the vendor allows, want at least 95%%", 100*share)
	}
	if _, err := b.Acquire(context.Background(), Request{Cost: 101}); err == nil {
		t.Error("a cost above the rate was accepted")
	}
	if _, err := b.Acquire(context.Background(), Request{Cost: -1}); err == nil {
		t.Error("a negative cost was accepted")
	}
}

// TestHighLaneGoesFirst crowds a bucket at 20 per second with normal
// calls reserved up to the horizon and more waiting beyond it; a high
// call then gets the first tick after those already granted, ahead of
// every waiting normal call, and normal calls step aside while it waits.
func TestHighLaneGoesFirst(t *testing.T) {
	g := NewGate(redistest.Client(t), Config{KeyPrefix: redistest.Prefix(t)})
	clk := fakeRedisTime(g, testEpoch)
	ctx := context.Background()
	b, err := g.Bucket("crm", Policy{Limits: []Limit{{Rate: 20, Window: time.Second}}})
	if err != nil {
		t.Fatal(err)
	}
	simulate(t, b, clk, 1, one) // past the first use's wait
	var lastNormal int64
	for {
		r, err := b.reserve(ctx, Request{})
		if err != nil {
			t.Fatal(err)
		}
		if !r.ok {
			break // the horizon is full
		}
		lastNormal = clk.now() + r.wait.Microseconds()
	}
	hi, err := b.reserve(ctx, Request{Lane: High})
	if err != nil {
		t.Fatal(err)
	}
	if hi.ok {
		t.Fatalf("the high call was granted beyond the horizon: %+v", hi)
	}
	// While it waits, a normal call steps aside.
	n, err := b.reserve(ctx, Request{})
	if err != nil {
		t.Fatal(err)
	}
	if n.ok || n.reason != behindHigh {
		t.Fatalf("a normal call while a high one waits: %+v", n)
	}
	// So does a batch of them, as one (see runBatch), each told to come
	// back just after the one before it.
	batch := make([]Request, 5)
	before, err := b.Stats(ctx)
	if err != nil {
		t.Fatal(err)
	}
	rs, err := b.reserveMany(ctx, batch)
	if err != nil {
		t.Fatal(err)
	}
	for i, r := range rs {
		if r.ok || r.reason != behindHigh || (i > 0 && r.wait <= rs[i-1].wait) {
			t.Fatalf("call %d of a batch while a high one waits: %+v (the one before: %+v)", i+1, r, rs[max(i-1, 0)])
		}
	}
	// Each call of the batch counts as deferred, as one after the other
	// would.
	after, err := b.Stats(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if d := after.Deferred - before.Deferred; d != int64(len(batch)) {
		t.Errorf("a batch of %d stepping aside for a high call counted %d deferred", len(batch), d)
	}
	clk.advance(hi.wait)
	hi, err = b.reserve(ctx, Request{Lane: High})
	if err != nil {
		t.Fatal(err)
	}
	if !hi.ok {
		t.Fatalf("the high call came back when told and was deferred again: %+v", hi)
	}
	iv, _ := b.Policy().Tick()
	if tick := clk.now() + hi.wait.Microseconds(); tick != lastNormal+iv.Microseconds() {
		t.Errorf("the high call's tick is %v after the last normal one, want one tick (%v)", time.Duration(tick-lastNormal)*time.Microsecond, iv)
	}
	// And the normal calls go on after it.
	n, err = b.reserve(ctx, Request{})
	if err != nil {
		t.Fatal(err)
	}
	if n.reason == behindHigh {
		t.Errorf("a normal call still steps aside after the high one was granted: %+v", n)
	}
	// The batch that stepped aside, asking again in its order, keeps it:
	// each call's tick (or moment to come back) after the one before.
	rs, err = b.reserveMany(ctx, batch)
	if err != nil {
		t.Fatal(err)
	}
	for i := 1; i < len(rs); i++ {
		if rs[i].reason == behindHigh {
			t.Fatalf("call %d of the batch still steps aside: %+v", i+1, rs[i])
		}
		if rs[i].wait <= rs[i-1].wait {
			t.Errorf("call %d of the batch comes after %v, call %d after %v: the batch lost its order", i+1, rs[i].wait, i, rs[i-1].wait)
		}
	}
}

// TestQuotaLostCountsSpent loses a bucket's state while its group knows
// it should be there (Redis lost data): the quota counts as spent for
// its window, since what the lost state granted is unknown, until the
// vendor's own count replaces the guess.
func TestQuotaLostCountsSpent(t *testing.T) {
	rdb := redistest.Client(t)
	g := NewGate(rdb, Config{KeyPrefix: redistest.Prefix(t)})
	clk := fakeRedisTime(g, testEpoch)
	ctx := context.Background()
	grp, err := g.Group("crm", nil)
	if err != nil {
		t.Fatal(err)
	}
	b, err := grp.Bucket("acct-1", Policy{Limits: []Limit{{Rate: 10, Window: time.Second}, {Rate: 500, Window: time.Hour}}})
	if err != nil {
		t.Fatal(err)
	}
	simulate(t, b, clk, 20, one)
	if err := rdb.Del(ctx, b.keys.gate, b.keys.counts).Err(); err != nil {
		t.Fatal(err)
	}
	r, err := b.reserve(ctx, Request{})
	if err != nil {
		t.Fatal(err)
	}
	if r.ok || r.wait < 59*time.Minute {
		t.Fatalf("after a loss: %+v, want a wait of about the quota's hour", r)
	}
	use, err := b.limitUse(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if use[1].Left != 0 {
		t.Errorf("after a loss the quota has %d left, want 0", use[1].Left)
	}
	// The vendor says 30 were used: its count replaces the guess.
	if _, err := b.Control().CountUsed(ctx, 1, 30); err != nil {
		t.Fatal(err)
	}
	use, err = b.limitUse(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if use[1].Used != 30 {
		t.Errorf("after the vendor's count of 30 the quota counts %d", use[1].Used)
	}
	// A lower count than the gate's own never lowers it.
	simulate(t, b, clk, 5, one)
	if _, err := b.Control().CountUsed(ctx, 1, 3); err != nil {
		t.Fatal(err)
	}
	use, err = b.limitUse(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if use[1].Used != 35 {
		t.Errorf("after 5 more grants and a vendor count of 3, the quota counts %d, want 35", use[1].Used)
	}
}

// TestCountUsedRaisesTheQuota: another app with the same credential used
// most of the hour's quota; the vendor's headers say so, and the gate
// lets only what is left go.
func TestCountUsedRaisesTheQuota(t *testing.T) {
	g := NewGate(redistest.Client(t), Config{KeyPrefix: redistest.Prefix(t)})
	clk := fakeRedisTime(g, testEpoch)
	ctx := context.Background()
	b, err := g.Bucket("gh", Policy{Limits: []Limit{{Rate: 50, Window: time.Second}, {Rate: 1000, Window: time.Hour}}})
	if err != nil {
		t.Fatal(err)
	}
	simulate(t, b, clk, 10, one)
	added, err := b.Control().CountUsed(ctx, 1, 990)
	if err != nil {
		t.Fatal(err)
	}
	if added != 980 {
		t.Errorf("added %d units, want 980 (990 announced less the 10 granted)", added)
	}
	calls := simulate(t, b, clk, 11, one)
	gap := time.Duration(calls[10].at-calls[9].at) * time.Microsecond
	if gap < 50*time.Minute {
		t.Errorf("the 11th call after the announcement came %v after the 10th: the quota had only 10 left", gap)
	}
}

// TestOwnRedisQuotaStaleCopyCountsSpent: the state was written by another Redis
// server (a replica promoted by a failover, a restart from a snapshot):
// it may lack the last grants, so its quota counts as spent for its
// window, like the rest of the lost state.
func TestOwnRedisQuotaStaleCopyCountsSpent(t *testing.T) {
	// A server of its own: failover detection reads INFO's run_id, which
	// the embedded Redis does not give.
	srv := redistest.Start(t)
	rdb := redis.NewClient(&redis.Options{Addr: srv.Addr})
	t.Cleanup(func() { rdb.Close() })
	g := NewGate(rdb, Config{KeyPrefix: redistest.Prefix(t)})
	clk := fakeRedisTime(g, testEpoch)
	ctx := context.Background()
	b, err := g.Bucket("crm", Policy{Limits: []Limit{{Rate: 10, Window: time.Second}, {Rate: 500, Window: time.Hour}}})
	if err != nil {
		t.Fatal(err)
	}
	simulate(t, b, clk, 20, one)
	if info, err := rdb.Info(ctx, "server").Result(); err != nil || !regexp.MustCompile(`run_id:\w+`).MatchString(info) {
		t.Fatalf("INFO server gives no run_id here (%v): the tests' Redis must allow it", err)
	}
	// As a copy from another server: its epoch and state name that one.
	if err := rdb.Set(ctx, b.keys.epoch, "0123456789abcdef|0", 0).Err(); err != nil {
		t.Fatal(err)
	}
	if err := rdb.HSet(ctx, b.keys.gate, "run", "0123456789abcdef").Err(); err != nil {
		t.Fatal(err)
	}
	r, err := b.reserve(ctx, Request{})
	if err != nil {
		t.Fatal(err)
	}
	if r.ok || r.reason != stateReset || r.wait < 59*time.Minute {
		t.Errorf("a stale copy's quota: %+v, want a reset waiting about the quota's hour", r)
	}
}

// TestTotalQuotaAcrossAccounts: a group's total has a quota of 100 an
// hour; two accounts together get 100, not 100 each.
func TestTotalQuotaAcrossAccounts(t *testing.T) {
	g := NewGate(redistest.Client(t), Config{KeyPrefix: redistest.Prefix(t)})
	clk := fakeRedisTime(g, testEpoch)
	ctx := context.Background()
	grp, err := g.Group("shop", &Policy{Limits: []Limit{{Rate: 40, Window: time.Second}, {Rate: 100, Window: time.Hour}}})
	if err != nil {
		t.Fatal(err)
	}
	var buckets []*Bucket
	for _, a := range []string{"a", "b"} {
		b, err := grp.Bucket(a, Policy{Limits: []Limit{{Rate: 20, Window: time.Second}}})
		if err != nil {
			t.Fatal(err)
		}
		buckets = append(buckets, b)
	}
	granted := 0
	for i := 0; i < 400; i++ {
		r, err := buckets[i%2].reserve(ctx, Request{})
		if err != nil {
			t.Fatal(err)
		}
		if r.ok {
			granted++
		} else if r.reason == heldByLimit && r.wait > 10*time.Minute {
			break // the quota is spent
		} else {
			clk.advance(max(r.wait, time.Millisecond))
		}
	}
	if granted != 100 {
		t.Errorf("%d calls granted to two accounts under a total quota of 100 an hour", granted)
	}
	use, err := buckets[0].totalLimitUse(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if len(use) != 2 || !use[1].Quota || use[1].Used != 100 || use[1].Left != 0 {
		t.Errorf("the total's limits: %+v", use)
	}
}

// TestCostlyCallsAfterUnitCalls: calls of one unit, then costlier ones,
// for a bucket of its own and one under a total with a quota. The first
// costly call counts the window before it as full (its units were not
// counted), so it waits up to a window; after it the calls flow, and no
// second holds more than the limit's units. (A costly call deferred once
// used to count that window as full again on every try, and never got a
// tick.)
func TestCostlyCallsAfterUnitCalls(t *testing.T) {
	g := NewGate(redistest.Client(t), Config{KeyPrefix: redistest.Prefix(t)})
	clk := fakeRedisTime(g, testEpoch)
	alone, err := g.Bucket("alone", Policy{Limits: []Limit{{Rate: 10, Window: time.Second}}})
	if err != nil {
		t.Fatal(err)
	}
	grp, err := g.Group("shop", &Policy{Limits: []Limit{{Rate: 40, Window: time.Second}, {Rate: 1000, Window: time.Hour}}})
	if err != nil {
		t.Fatal(err)
	}
	account, err := grp.Bucket("a", Policy{Limits: []Limit{{Rate: 10, Window: time.Second}}})
	if err != nil {
		t.Fatal(err)
	}
	for _, b := range []*Bucket{alone, account} {
		calls := simulate(t, b, clk, 30, func(i int) Request {
			if i < 15 {
				return Request{}
			}
			return Request{Cost: 2 + i%3}
		})
		gap := time.Duration(calls[15].at-calls[14].at) * time.Microsecond
		if gap > 1100*time.Millisecond {
			t.Errorf("%s: the first costly call came %v after the last unit call, want at most a window and a guard", b.Name(), gap)
		}
		if n := maxUnits(calls, time.Second); n > 10 {
			t.Errorf("%s: %d units in a second, limit 10", b.Name(), n)
		}
	}
}

// TestGivenUpTickLeavesTheQuota: a tick given up (its caller woke too
// late, a pause began) started no call: its units leave the quota.
func TestGivenUpTickLeavesTheQuota(t *testing.T) {
	g := NewGate(redistest.Client(t), Config{KeyPrefix: redistest.Prefix(t)})
	clk := fakeRedisTime(g, testEpoch)
	ctx := context.Background()
	b, err := g.Bucket("gh", Policy{Limits: []Limit{{Rate: 50, Window: time.Second}, {Rate: 100, Window: time.Hour}}})
	if err != nil {
		t.Fatal(err)
	}
	simulate(t, b, clk, 5, func(int) Request { return Request{Cost: 2} })
	r, err := b.reserve(ctx, Request{Cost: 3})
	if err != nil || !r.ok {
		t.Fatalf("%+v %v", r, err)
	}
	if err := b.giveUp(ctx, r.lease, gaveUpLate, r.tick, 3, r.tag); err != nil {
		t.Fatal(err)
	}
	use, err := b.limitUse(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if use[1].Used != 10 {
		t.Errorf("the quota counts %d after 5 calls of 2 and a given-up tick of 3, want 10", use[1].Used)
	}
}

// TestQuotaKeepsItsCountAcrossAnEdit edits a bucket's limits while its
// quota is half spent, in the ways a config.toml edit may: a limit added
// ahead of the quota, one taken away ahead of it (before the fix the
// counters were named by their place in the list, and the quota counted
// from zero: 350 calls in a minute), the quota's own rate lowered, the
// guard widened (its slots change width). The quota counts on from what
// it counted (G1 across config edits): no minute holds more calls than
// the quota allows.
func TestQuotaKeepsItsCountAcrossAnEdit(t *testing.T) {
	perMinute := Limit{Rate: 300, Window: time.Minute}
	hourly := Limit{Rate: 5000, Window: time.Hour}
	for _, c := range []struct {
		name          string
		before, after []Limit
		was, guard    time.Duration // before and after the edit (0: the default)
		most          int           // calls a minute the quota allows after the edit
	}{
		{"a limit added ahead of it", []Limit{{Rate: 20, Window: time.Second}, perMinute},
			[]Limit{{Rate: 20, Window: time.Second}, hourly, perMinute}, 0, 0, 300},
		{"a limit taken away ahead of it", []Limit{{Rate: 20, Window: time.Second}, hourly, perMinute},
			[]Limit{{Rate: 20, Window: time.Second}, perMinute}, 0, 0, 300},
		{"its rate lowered", []Limit{{Rate: 20, Window: time.Second}, perMinute},
			[]Limit{{Rate: 20, Window: time.Second}, {Rate: 280, Window: time.Minute}}, 0, 0, 300},
		{"the guard widened", []Limit{{Rate: 20, Window: time.Second}, perMinute},
			[]Limit{{Rate: 20, Window: time.Second}, perMinute}, 0, 500 * time.Millisecond, 300},
		{"the guard narrowed", []Limit{{Rate: 20, Window: time.Second}, perMinute},
			[]Limit{{Rate: 20, Window: time.Second}, perMinute}, 500 * time.Millisecond, 0, 300},
	} {
		t.Run(c.name, func(t *testing.T) {
			g := NewGate(redistest.Client(t), Config{KeyPrefix: redistest.Prefix(t)})
			clk := fakeRedisTime(g, testEpoch)
			b, err := g.Bucket("crm", Policy{Limits: c.before, Guard: c.was})
			if err != nil {
				t.Fatal(err)
			}
			first := simulate(t, b, clk, 250, one)
			edited, err := g.Bucket("crm", Policy{Limits: c.after, Guard: c.guard})
			if err != nil {
				t.Fatal(err)
			}
			second := simulate(t, edited, clk, 100, one)
			all := append(first, second...)
			if n := maxUnits(all, time.Minute); n > c.most {
				t.Errorf("%d calls in a minute across the edit, the quota allows %d", n, c.most)
			}
			if n := maxUnits(all, time.Second); n > 20 {
				t.Errorf("%d calls in a second, limit 20", n)
			}
		})
	}
}

// TestQuotaOfThePreviousReleaseCountsOn leaves a half-spent quota as the
// previous release kept it (its counters named by the limit's place in
// the list, without the width of their slots), and asks on with this
// one: the quota takes the counter over on first touch, slot by slot, and
// no minute holds more than the quota.
func TestQuotaOfThePreviousReleaseCountsOn(t *testing.T) {
	rdb := redistest.Client(t)
	g := NewGate(rdb, Config{KeyPrefix: redistest.Prefix(t)})
	clk := fakeRedisTime(g, testEpoch)
	p := Policy{Limits: []Limit{{Rate: 20, Window: time.Second}, {Rate: 300, Window: time.Minute}}}
	b, err := g.Bucket("crm", p)
	if err != nil {
		t.Fatal(err)
	}
	first := simulate(t, b, clk, 250, one)
	ctx := context.Background()
	fields, err := rdb.HGetAll(ctx, b.keys.counts).Result()
	if err != nil {
		t.Fatal(err)
	}
	old := map[string]any{}
	for f, v := range fields {
		if strings.HasSuffix(f, ":slot") {
			continue
		}
		f = strings.Replace(strings.Replace(f, "w60000000:", "2:", 1), "w1000000:", "1:", 1)
		old[f] = v
	}
	if _, ok := old["2:sum"]; !ok || len(old) < 4 {
		t.Fatalf("no minute counter to leave as the previous release did: %v", fields)
	}
	if err := rdb.Del(ctx, b.keys.counts).Err(); err != nil {
		t.Fatal(err)
	}
	if err := rdb.HSet(ctx, b.keys.counts, old).Err(); err != nil {
		t.Fatal(err)
	}
	upgraded, err := g.Bucket("crm", p)
	if err != nil {
		t.Fatal(err)
	}
	second := simulate(t, upgraded, clk, 100, one)
	if n := maxUnits(append(first, second...), time.Minute); n > 300 {
		t.Errorf("%d calls in a minute across the upgrade, the quota allows 300", n)
	}
	// The slots moved one by one: the 51st call of the second batch goes
	// when the first calls leave the minute, not a window after the last.
	at := time.Duration(second[50].at-first[0].at) * time.Microsecond
	if at < 60*time.Second || at > 62*time.Second {
		t.Errorf("the 51st call after the upgrade at %v, want when the first calls leave the minute (60-62 s)", at)
	}
	if n, _ := rdb.HExists(ctx, b.keys.counts, "2:sum").Result(); n {
		t.Error("the previous release's counter is still there after the first grant")
	}
}
