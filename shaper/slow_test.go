package shaper

import (
	"context"
	"sort"
	"testing"
	"time"

	"github.com/shaper-dev/shaper/internal/redistest"
)

// TestLongFaultSlowRedis stalls the gate's Redis mid-run — CLIENT PAUSE for
// 2 s, then DEBUG SLEEP for 1 s (the server itself blocked) — under three
// replicas at 100/s. Grants answered late are given up (a call starts
// within Tolerance of its tick or not at all), so no window sees more
// than the limit; callers carry on without errors, and calls go on after
// each stall. How soon the rate is back (the calls per second around each
// stall) is logged, as load moves it.
func TestLongFaultSlowRedis(t *testing.T) {
	redistest.Long(t)
	srv := redistest.Start(t, "--enable-debug-command", "local")
	admin := newReplica(t, srv.Addr, "admin", nil).rdb
	prefix := redistest.Prefix(t)
	p := Policy{Limits: []Limit{{Rate: 100, Window: time.Second}}}
	var reps []*replica
	for range 3 {
		reps = append(reps, newReplica(t, srv.Addr, prefix, nil))
	}
	rec := &recorder{}
	start := time.Now()
	errs, wait := callUntil(t, reps, "acme", p, 16, start.Add(11*time.Second), rec)
	ctx := context.Background()
	time.Sleep(2 * time.Second)
	pausedAt := time.Now()
	if err := admin.Do(ctx, "CLIENT", "PAUSE", 2000, "ALL").Err(); err != nil {
		t.Fatal(err)
	}
	time.Sleep(time.Until(pausedAt.Add(5 * time.Second)))
	sleptAt := time.Now()
	if err := admin.Do(ctx, "DEBUG", "SLEEP", 1).Err(); err != nil {
		t.Fatal(err)
	}
	wait()
	ts := rec.times()
	sort.Slice(ts, func(i, j int) bool { return ts[i].Before(ts[j]) })

	b, _ := reps[0].gate.Bucket("acme", p)
	st, err := b.Stats(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	count := func(from, to time.Time) int {
		n := 0
		for _, x := range ts {
			if !x.Before(from) && x.Before(to) {
				n++
			}
		}
		return n
	}
	t.Logf("%d calls, %d failed acquisitions, %d ticks given up late", len(ts), errs.Load(), st.Late)
	perSecond := func(from time.Time, n int) []int {
		var out []int
		for i := range n {
			out = append(out, count(from.Add(time.Duration(i)*time.Second), from.Add(time.Duration(i+1)*time.Second)))
		}
		return out
	}
	t.Logf("calls per second from 1 s before the 2 s CLIENT PAUSE: %v; from 1 s before the 1 s DEBUG SLEEP: %v",
		perSecond(pausedAt.Add(-time.Second), 5), perSecond(sleptAt.Add(-time.Second), 4))
	checkWindows(t, ts, p, 60)
	if errs.Load() > 0 {
		t.Errorf("%d acquisitions failed: a slow Redis is a wait, not an error", errs.Load())
	}
	// Recovery: calls after each stall ended (the pause at 2 s, the sleep
	// at 1 s), up to the next stall and to the end of the run.
	if n := count(pausedAt.Add(2*time.Second), sleptAt); n == 0 {
		t.Errorf("no call between the end of the CLIENT PAUSE and the DEBUG SLEEP")
	}
	if n := count(sleptAt.Add(time.Second), start.Add(11*time.Second)); n == 0 {
		t.Errorf("no call after the DEBUG SLEEP ended")
	}
}
