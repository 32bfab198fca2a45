package main

import (
	"context"
	"github.com/redis/go-redis/v9"
	"math/rand/v2"
	"net/http"
	"net/http/httptest"
	"sort"
	"strings"
	"testing"
	"time"

	"github.com/shaper-dev/shaper/internal/logtest"
	"github.com/shaper-dev/shaper/internal/redistest"
	"github.com/shaper-dev/shaper/internal/vendorsim"
)

// healthz returns the /healthz URL a worker logged.
func healthz(t *testing.T, log *logtest.Buffer) string {
	t.Helper()
	var url string
	waitUntil(t, 20*time.Second, "the worker to serve /healthz", func() bool {
		for _, line := range strings.Split(log.String(), "\n") {
			if strings.Contains(line, "serving metrics") {
				url = logValue(line, "healthz")
			}
		}
		return url != ""
	})
	return url
}

func healthStatus(url string) int {
	c := &http.Client{Timeout: 5 * time.Second}
	resp, err := c.Get(url)
	if err != nil {
		return 0
	}
	resp.Body.Close()
	return resp.StatusCode
}

// TestLongFaultRedisOutage stops Redis (append-only, fsync always) for
// 30 s in the middle of a run of two workers and starts it again with
// its data: the workers keep running and resume on their own, nothing is
// lost, no vendor window sees more than the limit, /healthz is 503 during
// the outage and 200 after, and each worker says that Redis is down once,
// not once per call.
func TestLongFaultRedisOutage(t *testing.T) {
	redistest.Long(t)
	t.Parallel() // waits out faults; runs beside the other fault scenarios
	rs := redistest.StartDurable(t)
	vend := &vendorsim.Mock{Rate: 50, Window: time.Second, Phase: time.Duration(rand.Int64N(int64(time.Second)))}
	srv := httptest.NewServer(vend)
	defer srv.Close()
	cfg := writeConfig(t, rs.Addr, "outage", srv.URL, 50)
	const n = 1000
	if out, err := runShaper(t, jobLines("outage", n), "enqueue", "--config", cfg, "--vendor", "outage", "--file", "-"); err != nil {
		t.Fatalf("enqueue: %v\n%s", err, out)
	}
	_, log1 := startWorker(t, cfg, "--metrics-addr", "127.0.0.1:0")
	_, log2 := startWorker(t, cfg)
	health := healthz(t, log1)
	waitUntil(t, time.Minute, "a fifth of the calls", func() bool { return vend.Summarize().DistinctKeys >= n/5 })
	if st := healthStatus(health); st != http.StatusOK {
		t.Errorf("/healthz before the outage: %d", st)
	}
	linesBefore := []int{strings.Count(log1.String(), "\n"), strings.Count(log2.String(), "\n")}
	rs.Kill()
	downAt := time.Now()
	time.Sleep(5 * time.Second)
	during := healthStatus(health)
	time.Sleep(time.Until(downAt.Add(30 * time.Second))) // the fault: Redis is down for 30 s
	if err := rs.Restart(); err != nil {
		t.Fatal(err)
	}
	upAt := time.Now()
	waitUntil(t, 3*time.Minute, "every call to succeed after the outage", func() bool { return vend.Summarize().DistinctKeys == n })
	after := healthStatus(health)
	// The calls the workers held when Redis went down lost their lease
	// (30 s) during the outage: asynq's recoverer (every minute) sends
	// them again, with the same Idempotency-Key. Wait for it.
	rdb := redis.NewClient(&redis.Options{Addr: rs.Addr})
	defer rdb.Close()
	waitUntil(t, 3*time.Minute, "asynq to recover every lease", func() bool {
		leases, err1 := rdb.ZCard(context.Background(), "asynq:{vendor:outage}:lease").Result()
		active, err2 := rdb.LLen(context.Background(), "asynq:{vendor:outage}:active").Result()
		return err1 == nil && err2 == nil && leases == 0 && active == 0
	})
	recovered := time.Now()

	ts := requestTimes(vend)
	sort.Slice(ts, func(i, j int) bool { return ts[i].Before(ts[j]) })
	resumed := backAtRate(ts, upAt, 45)
	duringCalls := 0
	for _, x := range ts {
		if x.After(downAt.Add(time.Second)) && x.Before(upAt) {
			duringCalls++
		}
	}
	t.Logf("outage: Redis down for %s; /healthz %d during, %d after; %d calls during the outage; back at >= 90%% of the rate %s after Redis returned; every lease recovered %s after",
		upAt.Sub(downAt).Round(time.Millisecond), during, after, duringCalls, resumed.Round(time.Millisecond), recovered.Sub(upAt).Round(time.Second))
	reportFault(t, vend, n)
	if s := vend.Summarize(); s.MaxPerWindow > vend.Rate {
		t.Errorf("%d calls in a vendor window, limit %d", s.MaxPerWindow, vend.Rate)
	}
	if during != http.StatusServiceUnavailable || after != http.StatusOK {
		t.Errorf("/healthz: %d during the outage, %d after; want 503 and 200", during, after)
	}
	// How soon the rate is back is logged (load moves it); that calls
	// came after Redis returned is asserted.
	if resumed < 0 {
		t.Errorf("no call after Redis returned")
	}
	for i, log := range []*logtest.Buffer{log1, log2} {
		lines := strings.Split(log.String(), "\n")[linesBefore[i]:]
		down := strings.Count(log.String(), "Redis does not answer")
		t.Logf("worker %d: %d log lines from the outage on, %d saying Redis does not answer", i+1, len(lines), down)
		if down != 1 || len(lines) > 30 {
			t.Errorf("worker %d logged the outage %d times, in %d lines; want once, in a handful:\n%s", i+1, down, len(lines), strings.Join(lines, "\n"))
		}
	}
}
