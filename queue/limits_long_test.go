package queue

import (
	"context"
	"fmt"
	"math"
	"math/rand/v2"
	"net/http"
	"net/http/httptest"
	"slices"
	"sort"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/hibiken/asynq"

	"github.com/shaper-dev/shaper/internal/redistest"
	"github.com/shaper-dev/shaper/internal/vendorsim"
	"github.com/shaper-dev/shaper/internal/windows"
	"github.com/shaper-dev/shaper/shaper"
	"github.com/shaper-dev/shaper/vendorclients"
)

// succeeded returns the 2xx requests of v, in the order they arrived.
func succeeded(v *vendorsim.Mock) []vendorsim.Request {
	var out []vendorsim.Request
	for _, r := range v.Requests() {
		if r.Status < 300 {
			out = append(out, r)
		}
	}
	return out
}

func times(rs []vendorsim.Request) []time.Time {
	ts := make([]time.Time, len(rs))
	for i, r := range rs {
		ts[i] = r.At
	}
	return ts
}

// TestLongQuotaAtThePaceOfTheShortLimit is issue 18's quota run: a vendor
// that allows 20 calls per second and 300 per minute, both fixed windows
// at hidden phases, and two workers. 250 calls go out at the pace of the
// per-second limit; 100 more enqueued 20 s after the first: 50 go at
// once, the rest when the first calls leave the minute. It asserts
// safety (no 429, nothing lost or repeated, never more than a limit in a
// sliding window) and logs the timings, which docs/results.md reports.
func TestLongQuotaAtThePaceOfTheShortLimit(t *testing.T) {
	redistest.Long(t)
	t.Parallel() // light: a minute of waiting, beside the others
	began := time.Now()
	e := newEnv(t)
	ticks := &tickRecord{}
	e.transport = ticks
	vend := &vendorsim.Mock{Rate: 20, Window: time.Second, Phase: randomPhase(time.Second),
		More: []vendorsim.Fixed{{Rate: 300, Window: time.Minute, Phase: randomPhase(time.Minute)}}}
	name := e.vendor("quota", shaper.Policy{Limits: []shaper.Limit{{Rate: 20, Window: time.Second}, {Rate: 300, Window: time.Minute}}}, 0, vend)
	c := e.newClient()
	e.startWorker(nil)
	e.startWorker(nil)
	enqueueN(t, c, name, 250)
	waitFor(t, time.Minute, "the first 250 calls", func() bool { return vend.Summarize().DistinctKeys >= 250 })
	start := succeeded(vend)[0].At
	t.Logf("250 calls: the 250th done %.1f s after the first", succeeded(vend)[249].At.Sub(start).Seconds())
	time.Sleep(time.Until(start.Add(20 * time.Second)))
	calls := make([]Call, 100)
	for i := range calls {
		calls[i] = Call{ID: fmt.Sprintf("%s-more-%03d", name, i), Path: "/more"}
	}
	if _, err := c.EnqueueBatch(context.Background(), name, calls); err != nil {
		t.Fatal(err)
	}
	waitFor(t, 2*time.Minute, "the next 100 calls", func() bool { return vend.Summarize().DistinctKeys >= 350 })
	// The calls the host held past the guard between their tick and the
	// vendor (a stalled process: once on a loaded VM, the first call 8 s
	// late) say nothing of the gate; the windows are checked on the
	// others, and on the ticks the gate granted.
	all, late := ticks.onTime(succeeded(vend), shaper.DefaultGuard)
	for _, l := range late {
		t.Logf("call %s reached the vendor %s after its tick: the host held it past the guard; left out of the vendor-side windows", l.Key, l.lag)
	}
	start = all[0].At
	var more []vendorsim.Request
	for _, r := range all {
		if strings.HasSuffix(r.Path, "/more") {
			more = append(more, r)
		}
	}
	at := func(r vendorsim.Request) float64 { return r.At.Sub(start).Seconds() }
	if len(more) > 50 {
		t.Logf("the next 100: the 1st at %.1f s, the 50th at %.1f s, the 51st at %.1f s, the last at %.1f s after the first call",
			at(more[0]), at(more[49]), at(more[50]), at(more[len(more)-1]))
	}
	perMinute := map[int64]int{}
	for _, r := range all {
		perMinute[(r.At.UnixNano()-int64(vend.More[0].Phase))/int64(time.Minute)]++
	}
	keys := make([]int64, 0, len(perMinute))
	for k := range perMinute {
		keys = append(keys, k)
	}
	slices.Sort(keys)
	var per []string
	for _, k := range keys {
		per = append(per, strconv.Itoa(perMinute[k]))
	}
	t.Logf("calls per vendor minute: %s", strings.Join(per, ", "))
	s := vend.Summarize()
	ts := times(all)
	if d := windows.Wall(began, time.Now()) - time.Since(began); d.Abs() > 100*time.Millisecond {
		t.Logf("the host's wall clock moved %s against its monotonic clock during the run: the windows are measured on the wall clock, as the gate (Redis TIME) and vendors count", d)
	}
	granted := ticks.ticks()
	t.Logf("%d requests, %d 429s, %d calls, %d repeated; most in a sliding second %d, in a sliding minute %d (at the vendor), %d and %d (the ticks granted)",
		s.Requests, s.RateLimited, s.DistinctKeys, s.DuplicateKeys, windows.MaxSliding(ts, time.Second), windows.MaxSliding(ts, time.Minute),
		windows.MaxSliding(granted, time.Second), windows.MaxSliding(granted, time.Minute))
	if s.RateLimited != 0 || s.DistinctKeys != 350 || s.DuplicateKeys != 0 {
		t.Errorf("%d 429s, %d distinct calls (want 350), %d repeated", s.RateLimited, s.DistinctKeys, s.DuplicateKeys)
	}
	for _, w := range []struct {
		name string
		ts   []time.Time
	}{{"at the vendor", ts}, {"granted", granted}} {
		if n := windows.MaxSliding(w.ts, time.Second-shaper.DefaultGuard); n > 20 {
			t.Errorf("%d calls %s in a sliding second (less the guard), limit 20", n, w.name)
		}
		if n := windows.MaxSliding(w.ts, time.Minute-shaper.DefaultGuard); n > 300 {
			t.Errorf("%d calls %s in a sliding minute (less the guard), limit 300", n, w.name)
		}
	}
	if len(granted) != 350 {
		t.Fatalf("%d ticks recorded for 350 calls", len(granted))
	}
	if d := windows.Wall(granted[0], granted[300]); d < time.Minute-shaper.DefaultGuard {
		t.Errorf("the 301st call was granted %.1f s after the first: before the first left the minute", d.Seconds())
	}
}

// TestLongCostsAgainstAUnitVendor: calls of 1 to 10 units against a
// vendor that counts 100 units a second (the cost in a header), two
// workers: no 429, nothing lost, never more than 100 units in a vendor
// second; the share of the units the vendor allows is logged. make
// test-long runs it without the race detector: under -race the vendor's
// arrival stamps lagged the starts enough to put 101 units in a sliding
// window 20 ms short of a second (CI, once; the vendor's own seconds held
// 100).
func TestLongCostsAgainstAUnitVendor(t *testing.T) {
	redistest.Long(t)
	t.Parallel()
	e := newEnv(t)
	vend := &vendorsim.Mock{Rate: 100, Window: time.Second, Phase: randomPhase(time.Second), CostHeader: "X-Cost"}
	name := e.vendor("units", shaper.Policy{Limits: []shaper.Limit{{Rate: 100, Window: time.Second}}}, 0, vend)
	c := e.newClient()
	rng := rand.New(rand.NewPCG(18, 2))
	var calls []Call
	units := 0
	for i := 0; units < 3000; i++ {
		cost := 1 + rng.IntN(10)
		units += cost
		calls = append(calls, Call{ID: fmt.Sprintf("%s-%04d", name, i), Path: "/graphql", Method: "POST", Cost: cost,
			Headers: map[string]string{"X-Cost": strconv.Itoa(cost)}})
	}
	if _, err := c.EnqueueBatch(context.Background(), name, calls); err != nil {
		t.Fatal(err)
	}
	e.startWorker(nil)
	e.startWorker(nil)
	waitFor(t, 2*time.Minute, "every call", func() bool { return vend.Summarize().DistinctKeys >= len(calls) })
	ok := succeeded(vend)
	most, sum, lo := 0, 0, 0
	for hi := range ok {
		sum += ok[hi].Units
		for windows.Wall(ok[lo].At, ok[hi].At) >= time.Second-shaper.DefaultGuard {
			sum -= ok[lo].Units
			lo++
		}
		most = max(most, sum)
	}
	perWindow := map[int64]int{}
	fixedMost := 0
	for _, r := range ok {
		k := (r.At.UnixNano() - int64(vend.Phase)) / int64(time.Second)
		perWindow[k] += r.Units
		fixedMost = max(fixedMost, perWindow[k])
	}
	span := ok[len(ok)-1].At.Sub(ok[0].At) + 10*time.Millisecond
	s := vend.Summarize()
	t.Logf("%d calls, %d units in %.2f s: %.1f%% of 100 units/s; most units in a vendor second %d, in a sliding second (less the guard) %d; %d 429s",
		len(ok), units, span.Seconds(), 100*float64(units)/(span.Seconds()*100), fixedMost, most, s.RateLimited)
	if s.RateLimited != 0 || s.DistinctKeys != len(calls) || s.DuplicateKeys != 0 {
		t.Errorf("%d 429s, %d distinct calls (want %d), %d repeated", s.RateLimited, s.DistinctKeys, len(calls), s.DuplicateKeys)
	}
	if most > 100 || fixedMost > 100 {
		t.Errorf("%d units in a sliding second, %d in a vendor second: limit 100", most, fixedMost)
	}
}

// TestHighLaneGoesFirstThroughWorkers: 2,000 normal calls queued for a vendor at
// 20 per second, then 10 high calls, 2 s apart: each high call reaches the
// vendor within about a second and a tick of its enqueue (logged, p50 and
// max, not asserted: load moves them; behind the normal calls they would
// wait over 90 s, past the 30 s the test waits for them), no 429, and the
// normal calls stay in order. Then the same for one account of a
// per-account vendor, whose normal calls wait planned in asynq's
// schedule.
func TestHighLaneGoesFirstThroughWorkers(t *testing.T) {
	t.Parallel()
	for _, perAccount := range []bool{false, true} {
		t.Run(fmt.Sprintf("per_account=%v", perAccount), func(t *testing.T) {
			t.Parallel() // two workers at 20/s each: light beside each other
			e := newEnv(t)
			vend := &vendorsim.Mock{Rate: 20, Window: time.Second, Phase: randomPhase(time.Second)}
			p := shaper.Policy{Limits: []shaper.Limit{{Rate: 20, Window: time.Second}}}
			var name, account string
			if perAccount {
				srv := httptest.NewServer(vend)
				t.Cleanup(srv.Close)
				name = "lanes-" + e.prefix[5:]
				account = "store-1"
				e.vendors = append(e.vendors, Vendor{Endpoint: vendorclients.Endpoint{Name: name, BaseURL: srv.URL + "/{account}", Timeout: 5 * time.Second},
					Policy: p, PerAccount: true})
			} else {
				name = e.vendor("lanes", p, 0, vend)
			}
			c := e.newClient()
			normal := make([]Call, 2000)
			for i := range normal {
				normal[i] = Call{ID: fmt.Sprintf("n-%05d", i), Account: account, Path: "/orders"}
			}
			if _, err := c.EnqueueBatch(context.Background(), name, normal); err != nil {
				t.Fatal(err)
			}
			e.startWorker(nil) // two workers, as the issue measures
			e.startWorker(nil)
			time.Sleep(5 * time.Second)
			enqueued := map[string]time.Time{}
			for i := range 10 {
				id := fmt.Sprintf("h-%02d", i)
				enqueued[id] = time.Now()
				if _, err := c.Enqueue(context.Background(), Call{Vendor: name, ID: id, Account: account, Path: "/now", Priority: "high"}); err != nil {
					t.Fatal(err)
				}
				time.Sleep(2 * time.Second)
			}
			waitFor(t, 30*time.Second, "the high calls", func() bool {
				n := 0
				for _, r := range succeeded(vend) {
					if strings.HasPrefix(r.Key, "h-") {
						n++
					}
				}
				return n == 10
			})
			var waits []time.Duration
			var order []int
			for _, r := range succeeded(vend) {
				if at, ok := enqueued[r.Key]; ok {
					waits = append(waits, r.At.Sub(at))
				} else if n, err := strconv.Atoi(strings.TrimPrefix(r.Key, "n-")); err == nil {
					order = append(order, n)
				}
			}
			sort.Slice(waits, func(i, j int) bool { return waits[i] < waits[j] })
			s := vend.Summarize()
			// A per-account vendor's planned calls come back from asynq's
			// schedule a second's worth at a time (its schedule is in whole
			// seconds) and race to the gate: they may move within that
			// second's batch, as before lanes.
			far := 5
			if perAccount {
				far = p.Limits[0].Rate + 5
			}
			moved, most := 0, 0
			for i, n := range order {
				if abs(n-i) > far {
					moved++
				}
				most = max(most, abs(n-i))
			}
			t.Logf("high calls behind %d normal ones: start p50 %v, max %v after their enqueue; %d normal calls done, %d moved more than %d places (most %d); %d 429s",
				len(normal), waits[len(waits)/2].Round(time.Millisecond), waits[len(waits)-1].Round(time.Millisecond), len(order), moved, far, most, s.RateLimited)
			if s.RateLimited != 0 || s.DuplicateKeys != 0 {
				t.Errorf("%d 429s, %d repeated", s.RateLimited, s.DuplicateKeys)
			}
			// The gate keeps the lane's order exactly (TestHighLaneGoesFirst,
			// in simulated time); here goroutines and asynq's schedule race
			// to it, and how many calls move a few places depends on the
			// machine's load: logged above, not asserted. What is asserted
			// is that the lane kept its order as a whole (a lost order,
			// say the calls that stepped aside sent to the back, scores
			// far below).
			if rho := rankCorrelation(order); rho < 0.95 {
				t.Errorf("the normal lane's release order correlates %.3f with its enqueue order (%d of %d moved more than %d places), want at least 0.95", rho, moved, len(order), far)
			}
		})
	}
}

// TestSpentQuotaWaitsInTheQueue: a quota of 5 calls a minute at 50 a
// second, 8 calls. 5 go at once; the other 3 wait beyond max_wait, so
// they go back to the queue without using a retry and the vendor's asynq
// queue is paused until the quota frees. (It does not wait the minute
// out.)
func TestSpentQuotaWaitsInTheQueue(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	vend := &vendorsim.Mock{Rate: 50, Window: time.Second}
	name := e.vendor("spent", shaper.Policy{Limits: []shaper.Limit{{Rate: 50, Window: time.Second}, {Rate: 5, Window: time.Minute}}}, 0, vend)
	c := e.newClient()
	enqueueN(t, c, name, 8)
	e.startWorker(nil)
	waitFor(t, 20*time.Second, "5 calls", func() bool { return vend.Summarize().DistinctKeys == 5 })
	insp := asynq.NewInspectorFromRedisClient(e.rdb())
	waitFor(t, 20*time.Second, "the vendor's queue to be paused", func() bool {
		qi, err := insp.GetQueueInfo(QueueName(name))
		return err == nil && qi.Paused
	})
	// The queue is paused at the first call that meets the spent quota;
	// the other two may still be with a worker, on their way back.
	var tasks []*asynq.TaskInfo
	waitFor(t, 20*time.Second, "the 3 calls past the quota to wait in the queue", func() bool {
		retry, err := insp.ListRetryTasks(QueueName(name))
		if err != nil {
			return false
		}
		pending, err := insp.ListPendingTasks(QueueName(name))
		if err != nil {
			return false
		}
		tasks = append(retry, pending...)
		return len(tasks) >= 3
	})
	if len(tasks) != 3 {
		t.Errorf("%d calls waiting in the queue, want 3", len(tasks))
	}
	for _, ti := range tasks {
		if ti.Retried != 0 {
			t.Errorf("call %s used %d retries waiting for the quota", ti.ID, ti.Retried)
		}
	}
	st, err := e.newClient().QueueStats(context.Background(), name)
	if err != nil {
		t.Fatal(err)
	}
	if s := vend.Summarize(); s.Requests != 5 || s.RateLimited != 0 {
		t.Errorf("the vendor saw %d requests (%d 429s), want the 5 the quota allows (queue: %+v)", s.Requests, s.RateLimited, st)
	}
}

// rankCorrelation is Spearman's rank correlation between the positions
// of order and the values at them (distinct ints): 1 when order is
// sorted, near 0 when shuffled, -1 when reversed.
func rankCorrelation(order []int) float64 {
	n := len(order)
	if n < 2 {
		return 1
	}
	ranks := make([]int, n)
	idx := make([]int, n)
	for i := range idx {
		idx[i] = i
	}
	sort.Slice(idx, func(a, b int) bool { return order[idx[a]] < order[idx[b]] })
	for r, i := range idx {
		ranks[i] = r
	}
	var d2 float64
	for i, r := range ranks {
		d := float64(i - r)
		d2 += d * d
	}
	nf := float64(n)
	return 1 - 6*d2/(nf*(nf*nf-1))
}

func TestRankCorrelation(t *testing.T) {
	for _, c := range []struct {
		order []int
		want  float64
	}{
		{[]int{0, 1, 2, 3, 4}, 1},
		{[]int{4, 3, 2, 1, 0}, -1},
		{[]int{1, 0, 2, 3, 4}, 0.9},
	} {
		if got := rankCorrelation(c.order); math.Abs(got-c.want) > 1e-9 {
			t.Errorf("rankCorrelation(%v) = %v, want %v", c.order, got, c.want)
		}
	}
}

// tickRecord is a transport that records, by Idempotency-Key, the tick
// each call was granted (the gate's decision, which G1 is about; the
// vendor's stamp adds the host's and the network's delays).
type tickRecord struct {
	mu sync.Mutex
	at map[string]time.Time
}

func (r *tickRecord) RoundTrip(req *http.Request) (*http.Response, error) {
	if p := vendorclients.PermitFrom(req.Context()); p != nil {
		r.mu.Lock()
		if r.at == nil {
			r.at = map[string]time.Time{}
		}
		r.at[req.Header.Get("Idempotency-Key")] = p.Tick
		r.mu.Unlock()
	}
	return http.DefaultTransport.RoundTrip(req)
}

// ticks returns the ticks recorded, in order.
func (r *tickRecord) ticks() []time.Time {
	r.mu.Lock()
	defer r.mu.Unlock()
	out := make([]time.Time, 0, len(r.at))
	for _, t := range r.at {
		out = append(out, t)
	}
	slices.SortFunc(out, time.Time.Compare)
	return out
}

// lateCall is a call that reached the vendor lag after its tick.
type lateCall struct {
	Key string
	lag time.Duration
}

// onTime splits rs into the requests that reached the vendor within
// slack of their ticks (or whose tick was not recorded: a test's
// mistake shows as a window over its limit, not as a skipped call) and
// the others.
func (r *tickRecord) onTime(rs []vendorsim.Request, slack time.Duration) ([]vendorsim.Request, []lateCall) {
	r.mu.Lock()
	defer r.mu.Unlock()
	var ok []vendorsim.Request
	var late []lateCall
	for _, q := range rs {
		if tick, found := r.at[q.Key]; found && q.At.Sub(tick) > slack {
			late = append(late, lateCall{q.Key, q.At.Sub(tick)})
			continue
		}
		ok = append(ok, q)
	}
	return ok, late
}
