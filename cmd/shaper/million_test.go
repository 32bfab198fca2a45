package main

import (
	"context"
	"encoding/json"
	"fmt"
	"net/http/httptest"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/hibiken/asynq"
	"github.com/redis/go-redis/v9"

	"github.com/shaper-dev/shaper/internal/redistest"
	"github.com/shaper-dev/shaper/internal/vendorsim"
	"github.com/shaper-dev/shaper/queue"
	"github.com/shaper-dev/shaper/shaper"
	"github.com/shaper-dev/shaper/vendorclients"
)

// usedMemory is Redis's used_memory (INFO memory).
func usedMemory(t *testing.T, rdb *redis.Client) int64 {
	t.Helper()
	info, err := rdb.Info(context.Background(), "memory").Result()
	if err != nil {
		t.Fatal(err)
	}
	for _, line := range strings.Split(info, "\r\n") {
		if v, ok := strings.CutPrefix(line, "used_memory:"); ok {
			n, _ := strconv.ParseInt(v, 10, 64)
			return n
		}
	}
	t.Fatal("no used_memory in INFO memory")
	return 0
}

// rssKB is a process's resident set (VmRSS, kB). A process whose RSS
// cannot be read fails the test: a flat line of zeros would pass.
func rssKB(t *testing.T, pid int) int64 {
	t.Helper()
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/status", pid))
	if err != nil {
		t.Fatalf("read the worker's RSS: %v", err)
	}
	for _, line := range strings.Split(string(b), "\n") {
		if v, ok := strings.CutPrefix(line, "VmRSS:"); ok {
			if f := strings.Fields(v); len(f) > 0 {
				if n, err := strconv.ParseInt(f[0], 10, 64); err == nil && n > 0 {
					return n
				}
			}
		}
	}
	t.Fatalf("no VmRSS in /proc/%d/status", pid)
	return 0
}

// inParallel runs f(i) for i in [0, n) on k goroutines.
func inParallel(n, k int, f func(i int) error) error {
	var wg sync.WaitGroup
	errs := make(chan error, k)
	for g := range k {
		wg.Go(func() {
			for i := g; i < n; i += k {
				if err := f(i); err != nil {
					errs <- err
					return
				}
			}
		})
	}
	wg.Wait()
	close(errs)
	return <-errs
}

// TestLongMillionQueuedCalls queues 1,000,000 calls for one vendor: the
// Redis memory per queued call beside plain asynq's task record for the
// same payloads, `shaper stats` with the million queued, and a worker's
// RSS while it drains at 1,000 calls/s (the calls it sent in 40 s are
// logged; that it sent calls is asserted).
func TestLongMillionQueuedCalls(t *testing.T) {
	redistest.Long(t)
	srv := redistest.Start(t)
	rdb := redis.NewClient(&redis.Options{Addr: srv.Addr, PoolSize: 16})
	defer rdb.Close()
	ctx := context.Background()
	const n = 1_000_000
	call := func(vendor string, i int) queue.Call {
		return queue.Call{Vendor: vendor, ID: fmt.Sprintf("order-%07d", i), Method: "POST", Path: "/orders",
			Body: json.RawMessage(fmt.Sprintf(`{"order":%d}`, i))}
	}

	// Plain asynq: the same payloads and ids in a queue of its own.
	aq := asynq.NewClientFromRedisClient(rdb)
	base := usedMemory(t, rdb)
	begin := time.Now()
	if err := inParallel(n, 32, func(i int) error {
		payload, _ := json.Marshal(call("plain", i))
		_, err := aq.EnqueueContext(ctx, asynq.NewTask(queue.TypeCall, payload), asynq.Queue(queue.QueueName("plain")), asynq.TaskID(fmt.Sprintf("order-%07d", i)))
		return err
	}); err != nil {
		t.Fatal(err)
	}
	plainTook := time.Since(begin)
	plain := float64(usedMemory(t, rdb)-base) / n
	plainKey, _ := rdb.MemoryUsage(ctx, "asynq:{"+queue.QueueName("plain")+"}:t:order-0000042").Result()
	_ = aq.Close()
	if err := rdb.FlushAll(ctx).Err(); err != nil {
		t.Fatal(err)
	}

	vend := &vendorsim.Mock{Rate: 1000, Window: time.Second}
	hs := httptest.NewServer(vend)
	defer hs.Close()
	v := queue.Vendor{Endpoint: vendorclients.Endpoint{Name: "million", BaseURL: hs.URL},
		Policy: shaper.Policy{Limits: []shaper.Limit{{Rate: 1000, Window: time.Second}}}}
	c := queue.NewClient(rdb, queue.ClientConfig{Vendors: []queue.Vendor{v}})
	defer c.Close()
	base = usedMemory(t, rdb)
	begin = time.Now()
	// In batches, as the CLI and the HTTP API queue a file: one round
	// trip per batch, where plain asynq has one per call.
	const batch = 1000
	if err := inParallel(n/batch, 8, func(i int) error {
		calls := make([]queue.Call, batch)
		for k := range calls {
			calls[k] = call("million", i*batch+k)
		}
		_, err := c.EnqueueBatch(ctx, "million", calls)
		return err
	}); err != nil {
		t.Fatal(err)
	}
	shapedTook := time.Since(begin)
	shaped := float64(usedMemory(t, rdb)-base) / n
	shapedKey, _ := rdb.MemoryUsage(ctx, "asynq:{"+queue.QueueName("million")+"}:t:order-0000042").Result()
	t.Logf("1,000,000 queued calls: %.0f bytes each in Redis with shaper (task record %d B), %.0f with plain asynq (task record %d B); enqueued at %.0f/s in batches of 1,000 on 8 goroutines (plain asynq %.0f/s, one at a time on 32)",
		shaped, shapedKey, plain, plainKey, n/shapedTook.Seconds(), n/plainTook.Seconds())
	if shaped > plain+64 {
		t.Errorf("a queued call costs %.0f bytes, plain asynq's %.0f: more than 64 bytes above", shaped, plain)
	}

	cfg := filepath.Join(t.TempDir(), "config.toml")
	if err := os.WriteFile(cfg, []byte(fmt.Sprintf("[redis]\naddr = %q\n\n[vendors.million]\nbase_url = %q\nrate = 1000\nqueue_limit = 0\n", srv.Addr, hs.URL)), 0o600); err != nil {
		t.Fatal(err)
	}
	shaperBin(t) // built before the timing
	var statsTook []time.Duration
	for range 3 {
		begin := time.Now()
		out, err := runShaper(t, "", "stats", "--config", cfg, "--json")
		statsTook = append(statsTook, time.Since(begin))
		if err != nil || !strings.Contains(out, `"queued": 1000000`) {
			t.Fatalf("stats with a million queued: %v\n%.2000s", err, out)
		}
	}
	t.Logf("shaper stats with 1,000,000 queued: %v (the whole command: process start, connect, read)", statsTook)

	w, _ := startWorker(t, cfg)
	var rss []int64
	for range 40 {
		time.Sleep(time.Second)
		rss = append(rss, rssKB(t, w.Process.Pid))
	}
	sent := vend.Summarize().DistinctKeys
	lo, hi := rss[10], rss[10]
	for _, r := range rss[10:] {
		lo, hi = min(lo, r), max(hi, r)
	}
	t.Logf("worker draining: %d calls in 40 s; RSS (MB) each second: %v; from 10 s on between %.1f and %.1f MB",
		sent, mb(rss), float64(lo)/1024, float64(hi)/1024)
	if sent == 0 {
		t.Errorf("the worker sent no call in 40 s")
	}
	if hi-lo > 32*1024 {
		t.Errorf("worker RSS grew from %.1f to %.1f MB while draining: not flat", float64(lo)/1024, float64(hi)/1024)
	}
}

func mb(kb []int64) []string {
	out := make([]string, len(kb))
	for i, k := range kb {
		out[i] = fmt.Sprintf("%.0f", float64(k)/1024)
	}
	return out
}
