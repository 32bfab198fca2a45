package main

import (
	"context"
	"encoding/json"
	"fmt"
	"net/http/httptest"
	"os"
	"path/filepath"
	"regexp"
	"slices"
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

// infoInt is the integer field of an INFO section of Redis
// (used_memory of memory, connected_clients of clients).
func infoInt(t *testing.T, rdb *redis.Client, section, field string) int64 {
	t.Helper()
	info, err := rdb.Info(context.Background(), section).Result()
	if err != nil {
		t.Fatal(err)
	}
	for _, line := range strings.Split(info, "\r\n") {
		if v, ok := strings.CutPrefix(line, field+":"); ok {
			n, _ := strconv.ParseInt(v, 10, 64)
			return n
		}
	}
	t.Fatalf("no %s in INFO %s", field, section)
	return 0
}

// usedMemory is Redis's used_memory (INFO memory).
func usedMemory(t *testing.T, rdb *redis.Client) int64 {
	t.Helper()
	return infoInt(t, rdb, "memory", "used_memory")
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
// live heap while it drains at 1,000 calls/s (asserted flat; its RSS and
// the calls it sent in 40 s are logged; that it sent calls is asserted).
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

	// gctrace prints the live heap after each collection: the measure of
	// state kept per call. The worker's Redis pools open connections
	// under load (up to 256 each, 64 KiB of buffers a connection), which
	// the heap holds too: bounded, but not flat (a CI run's RSS went
	// from 45 MB at 10 s to 91 MB at 40 s). So the worker's connections
	// are counted each second, from Redis's side, and their buffers
	// taken out of the live heap before it is compared.
	w, out := startWorkerEnv(t, []string{"GODEBUG=gctrace=1"}, cfg)
	var rss, conns []int64
	for range 40 {
		time.Sleep(time.Second)
		rss = append(rss, rssKB(t, w.Process.Pid))
		conns = append(conns, connectedClients(t, rdb)-int64(rdb.PoolStats().TotalConns))
	}
	sent := vend.Summarize().DistinctKeys
	t.Logf("worker draining: %d calls in 40 s; RSS (MB) each second: %v; its Redis connections: %v", sent, mb(rss), conns)
	if sent == 0 {
		t.Errorf("the worker sent no call in 40 s")
	}
	early, late := liveHeap(out.String(), 10, 20), liveHeap(out.String(), 30, 40)
	t.Logf("live heap after each collection (MB), 10-20 s: %v; 30-40 s: %v", early, late)
	if len(early) == 0 || len(late) == 0 {
		t.Fatalf("no gctrace line from the worker between 10 and 20 s or 30 and 40 s")
	}
	// Medians: a leak moves every collection's live heap, a burst of
	// calls in flight at one collection moves that one.
	const connBuffers = 64.0 / 1024 // MB a connection
	lo := medianMB(early) - float64(slices.Max(conns[10:20]))*connBuffers
	hi := medianMB(late) - float64(slices.Max(conns[30:40]))*connBuffers
	t.Logf("median live heap less the connections' buffers: %.1f MB at 10-20 s, %.1f MB at 30-40 s", lo, hi)
	// A leak of 400 bytes a call over the 20 s between (about 20,000
	// calls) would add 8 MB.
	if hi > lo+8 {
		t.Errorf("the worker's live heap, less its Redis connections' buffers, grew from %.1f MB to %.1f MB while draining: state kept per call", lo, hi)
	}
}

// medianMB is the median of live heaps in MB.
func medianMB(mb []int) float64 {
	s := slices.Clone(mb)
	slices.Sort(s)
	return float64(s[len(s)/2])
}

// connectedClients is Redis's connected_clients (INFO clients).
func connectedClients(t *testing.T, rdb *redis.Client) int64 {
	t.Helper()
	return infoInt(t, rdb, "clients", "connected_clients")
}

// gcLine is one line of GODEBUG=gctrace=1: its time since the process
// started and its heap sizes (start -> end -> live, MB).
var gcLine = regexp.MustCompile(`gc \d+ @([0-9.]+)s .* (\d+)->(\d+)->(\d+) MB`)

// liveHeap is the live heap (MB) each collection in a gctrace found
// between from and to seconds after the process started.
func liveHeap(trace string, from, to float64) []int {
	var live []int
	for _, m := range gcLine.FindAllStringSubmatch(trace, -1) {
		at, _ := strconv.ParseFloat(m[1], 64)
		mb, _ := strconv.Atoi(m[4])
		if at >= from && at < to {
			live = append(live, mb)
		}
	}
	return live
}

func mb(kb []int64) []string {
	out := make([]string, len(kb))
	for i, k := range kb {
		out[i] = fmt.Sprintf("%.0f", float64(k)/1024)
	}
	return out
}
