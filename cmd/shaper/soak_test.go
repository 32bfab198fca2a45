package main

import (
	"fmt"
	"math/rand/v2"
	"net/http/httptest"
	"os"
	"sort"
	"strings"
	"testing"
	"time"

	"github.com/hibiken/asynq"
	"github.com/redis/go-redis/v9"

	"github.com/shaper-dev/shaper/internal/logtest"
	"github.com/shaper-dev/shaper/internal/redistest"
	"github.com/shaper-dev/shaper/internal/vendorsim"
	"github.com/shaper-dev/shaper/internal/windows"
	"github.com/shaper-dev/shaper/queue"
	"github.com/shaper-dev/shaper/shaper"
)

// soakFault is what the soak scenario does to Redis at 12 s: restart it
// (SIGKILL, 3 s down, started again with its append-only file) or fail it
// over (SIGKILL the Sentinel master; a sentinel promotes the replica).
type soakFault struct {
	name   string
	redis  string           // the [redis] table's lines
	strike func() time.Time // the fault; returns when Redis answers again
	master func() string    // the master's address once the fault is over
}

// TestLongFaultSoakRestart and TestLongFaultSoakFailover run the combined
// faults of a busy deployment: 3 workers, 3,000 calls at 100/s to a
// fixed-window vendor; one worker SIGKILLed at 5 s and started again 3 s
// later; Redis restarted with its data at 12 s (3 s down), or its master
// failed over to a replica; the rate edited from 100 to 60 at 20 s; the
// guard fixed at soakGuard. They assert safety: every call done and keyed, 0 429s, at most 100 calls per
// vendor window before the edit and 60 per (guard-shortened) second from
// a second after it. The time to drain and the calls per second at the
// vendor are logged (wall clock: measured, not asserted; results.md has
// them).
func TestLongFaultSoakRestart(t *testing.T) {
	redistest.Long(t)
	t.Parallel() // waits out faults; runs beside the other fault scenarios
	rs := redistest.StartDurable(t)
	soak(t, soakFault{
		name:  "Redis restart",
		redis: fmt.Sprintf("addr = %q\n", rs.Addr),
		strike: func() time.Time {
			rs.Kill()
			time.Sleep(3 * time.Second)
			if err := rs.Restart(); err != nil {
				t.Fatal(err)
			}
			return time.Now()
		},
		master: func() string { return rs.Addr },
	})
}

func TestLongFaultSoakFailover(t *testing.T) {
	redistest.Long(t)
	t.Parallel()
	s := redistest.StartSentinels(t)
	soak(t, soakFault{
		name:  "Sentinel failover",
		redis: fmt.Sprintf("addr = %q\nmaster_name = %q\n", strings.Join(s.Addrs, ","), s.MasterName),
		strike: func() time.Time {
			s.Master.Kill()
			return s.WaitFailover(t, 30*time.Second)
		},
		master: func() string {
			a, err := s.MasterAddr()
			if err != nil {
				t.Fatal(err)
			}
			return a
		},
	})
}

// soakGuard is the soak's guard; see soak.
const soakGuard = "100ms"

func soak(t *testing.T, f soakFault) {
	t.Helper()
	const n, rate, lowered = 3000, 100, 60
	vend := &vendorsim.Mock{Rate: rate, Window: time.Second, Phase: time.Duration(rand.Int64N(int64(time.Second)))}
	srv := httptest.NewServer(vend)
	defer srv.Close()
	vendor := "soak" + redistest.Prefix(t)[5:]
	cfg := writeConfigRedis(t, f.redis, vendor, srv.URL, rate)
	// The guard covers this machine's jitter (G1 holds while tolerance +
	// jitter <= guard): in CI the soak runs beside the race run, where a
	// process (a worker, or this one, which stamps the vendor's arrivals)
	// is now and then held off the CPU for 40-100 ms, more than the
	// default 20 ms covers; one CI run saw 64 calls in 980 ms after the
	// edit to 60/s that way.
	b, err := os.ReadFile(cfg)
	if err != nil {
		t.Fatal(err)
	}
	writeFile(t, cfg, string(b)+fmt.Sprintf("guard = %q\n", soakGuard))
	if out, err := runShaper(t, jobLines(vendor, n), "enqueue", "--config", cfg, "--vendor", vendor, "--file", "-"); err != nil {
		t.Fatalf("enqueue: %v\n%s", err, out)
	}
	victim, vlog := startWorker(t, cfg)
	_, log2 := startWorker(t, cfg)
	_, log3 := startWorker(t, cfg)
	logs := []*logtest.Buffer{vlog, log2, log3}
	start := time.Now()
	at := func(d time.Duration) { time.Sleep(time.Until(start.Add(d))) }

	at(5 * time.Second)
	if err := victim.Process.Kill(); err != nil { // SIGKILL
		t.Fatal(err)
	}
	_ = victim.Wait()
	at(8 * time.Second)
	_, log4 := startWorker(t, cfg)
	logs = append(logs, log4)
	at(12 * time.Second)
	struck := time.Now()
	back := f.strike()
	at(20 * time.Second)
	b, err = os.ReadFile(cfg)
	if err != nil {
		t.Fatal(err)
	}
	writeFile(t, cfg, strings.Replace(string(b), fmt.Sprintf("rate = %d\n", rate), fmt.Sprintf("rate = %d\n", lowered), 1))
	edited := time.Now()
	for deadline := time.Now().Add(4 * time.Minute); vend.Summarize().DistinctKeys < n; time.Sleep(200 * time.Millisecond) {
		if time.Now().After(deadline) {
			// Say where the missing calls are before failing.
			out, _ := runShaper(t, "", "stats", "--config", cfg)
			t.Fatalf("%s: timed out after 4m0s: %d of %d calls reached the vendor; %s; shaper stats:\n%s",
				f.name, vend.Summarize().DistinctKeys, n, queueReport(f, vendor), out)
		}
	}
	done := time.Now()

	ts := requestTimes(vend)
	sort.Slice(ts, func(i, j int) bool { return ts[i].Before(ts[j]) })
	t.Logf("%s: calls per second at the vendor from the start (worker killed at 5 s, started at 8 s; Redis struck at %.1fs, answering at %.1fs; rate %d -> %d at %.1fs; done at %.1fs): %v",
		f.name, struck.Sub(start).Seconds(), back.Sub(start).Seconds(), rate, lowered, edited.Sub(start).Seconds(), done.Sub(start).Seconds(), perSecond(ts, start))
	first := time.Duration(-1)
	for _, x := range ts {
		if x.After(back) {
			first = x.Sub(back)
			break
		}
	}
	t.Logf("%s: all %d calls done %.1fs after the start; first call %s after Redis answered again, back at >= 90 calls/s %s after it; longest gap between calls %s (at %.1fs)",
		f.name, n, done.Sub(start).Seconds(), first.Round(time.Millisecond), backAtRate(ts, back, 90).Round(time.Millisecond),
		longestGap(ts).gap.Round(time.Millisecond), longestGap(ts).at.Sub(start).Seconds())
	s := vend.Summarize()
	if s.DistinctKeys != n || s.RateLimited != 0 {
		t.Errorf("%d of %d calls reached the vendor, %d 429s; want all, none", s.DistinctKeys, n, s.RateLimited)
	}
	var before, after []time.Time
	for _, x := range ts {
		switch {
		case x.Before(edited):
			before = append(before, x)
		case x.After(edited.Add(time.Second)):
			after = append(after, x)
		}
	}
	short := time.Second - shaper.DefaultGuard
	mb, ma := windows.MaxSliding(before, short), windows.MaxSliding(after, short)
	t.Logf("%s: %d duplicate successes (same Idempotency-Key); most %d per vendor window, %d per sliding %s before the edit and %d from a second after it",
		f.name, s.DuplicateKeys, s.MaxPerWindow, mb, short, ma)
	if s.MaxPerWindow > rate || mb > rate || ma > lowered {
		t.Errorf("G1: %d per vendor window, %d per sliding %s before the edit (limit %d), %d after (limit %d)", s.MaxPerWindow, mb, short, rate, ma, lowered)
		logBusiestSpan(t, vend.Requests(), start, edited.Add(time.Second), short)
	}
	// What the workers said of the faults.
	for i, l := range logs {
		for _, line := range strings.Split(l.String(), "\n") {
			for _, k := range []string{"went silent", "stalled", "Redis does not answer", "Redis answers again", "lease"} {
				if strings.Contains(line, k) {
					t.Logf("%s: worker %d: %s", f.name, i+1, line)
					break
				}
			}
		}
	}
	// What is still held once every call reached the vendor: calls whose
	// end asynq has yet to record.
	t.Logf("%s: %s", f.name, queueReport(f, vendor))
}

// queueReport says where the vendor's calls are in its queue, and when
// the first of those waiting to be retried runs again.
func queueReport(f soakFault, vendor string) string {
	rdb := redis.NewClient(&redis.Options{Addr: f.master()})
	defer rdb.Close()
	insp := asynq.NewInspectorFromRedisClient(rdb)
	qi, err := insp.GetQueueInfo(queue.QueueName(vendor))
	if err != nil {
		return fmt.Sprintf("queue info: %v", err)
	}
	msg := fmt.Sprintf("queue at the end: %d active, %d pending, %d retry, %d scheduled, %d archived, %d completed",
		qi.Active, qi.Pending, qi.Retry, qi.Scheduled, qi.Archived, qi.Completed)
	if tasks, err := insp.ListRetryTasks(queue.QueueName(vendor), asynq.PageSize(1)); err == nil && len(tasks) > 0 {
		msg += fmt.Sprintf("; first retry in %s (retried %d times, last error %q)",
			time.Until(tasks[0].NextProcessAt).Round(time.Second), tasks[0].Retried, tasks[0].LastErr)
	}
	return msg
}

// gapAt is the longest gap between calls and when it began.
type gapAt struct {
	gap time.Duration
	at  time.Time
}

func longestGap(ts []time.Time) gapAt {
	var g gapAt
	for i := 1; i < len(ts); i++ {
		if d := ts[i].Sub(ts[i-1]); d > g.gap {
			g = gapAt{d, ts[i-1]}
		}
	}
	return g
}

// logBusiestSpan logs the requests of the busiest span w long from from
// on: each one's time from start, its key and how many times the vendor
// saw that key, to tell a burst of the gate from calls sent twice.
func logBusiestSpan(t *testing.T, reqs []vendorsim.Request, start, from time.Time, w time.Duration) {
	t.Helper()
	seen := map[string]int{}
	var rs []vendorsim.Request
	for _, r := range reqs {
		seen[r.Key]++
		if !r.At.Before(from) {
			rs = append(rs, r)
		}
	}
	sort.Slice(rs, func(i, j int) bool { return rs[i].At.Before(rs[j].At) })
	best, bi, j := 0, 0, 0
	for i := range rs {
		for windows.Wall(rs[j].At, rs[i].At) >= w {
			j++
		}
		if i-j+1 > best {
			best, bi = i-j+1, j
		}
	}
	var b strings.Builder
	for _, r := range rs[bi : bi+best] {
		fmt.Fprintf(&b, " %.3fs %s(x%d)", r.At.Sub(start).Seconds(), r.Key, seen[r.Key])
	}
	t.Logf("the busiest %s after %.1fs: %d calls:%s", w, from.Sub(start).Seconds(), best, b.String())
}
