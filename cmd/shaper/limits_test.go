package main

import (
	"context"
	"encoding/json"
	"os"
	"strings"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/shaper-dev/shaper/config"
	"github.com/shaper-dev/shaper/internal/redistest"
	"github.com/shaper-dev/shaper/shaper"
)

// TestQuotaInStatsAndCostAtEnqueue: a vendor with a daily quota of 5.
// After 3 calls, shaper stats (text and --json) shows 3 used and 2 left;
// enqueue refuses a cost above the quota and an unknown priority, and
// queues a high call of cost 2.
func TestQuotaInStatsAndCostAtEnqueue(t *testing.T) {
	t.Parallel() // functional, not timed
	addr := redistest.Addr(t)
	vendor := "quota-" + redistest.Prefix(t)[5:]
	cfg := writeConfig(t, addr, vendor, "http://127.0.0.1:1", 10)
	f, err := os.OpenFile(cfg, os.O_APPEND|os.O_WRONLY, 0)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := f.WriteString("limits = [ { rate = 5, window = \"24h\" } ]\n"); err != nil {
		t.Fatal(err)
	}
	f.Close()
	c, err := config.Load(cfg)
	if err != nil {
		t.Fatal(err)
	}
	v, _ := c.Vendor(vendor)
	rdb := redis.NewClient(&redis.Options{Addr: addr})
	defer rdb.Close()
	b, err := shaper.NewGate(rdb, shaper.Config{}).Bucket(vendor, v.Policy())
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	for range 3 {
		if _, err := b.Acquire(ctx); err != nil {
			t.Fatal(err)
		}
	}
	out, err := runShaper(t, "", "stats", "--config", cfg, "--json")
	if err != nil {
		t.Fatalf("stats --json: %v\n%s", err, out)
	}
	var rep StatsReport
	if err := json.Unmarshal([]byte(out), &rep); err != nil {
		t.Fatal(err)
	}
	if q := rep.Vendors[0].Quotas; len(q) != 1 || q[0].Limit != "5 per 24h" || q[0].Used != 3 || q[0].Left != 2 || q[0].NextCallSeconds != 0 {
		t.Errorf("quotas in stats --json: %+v", q)
	}
	out, err = runShaper(t, "", "stats", "--config", cfg)
	if err != nil || !strings.Contains(out, "quota 5 per 24h: 3 used, 2 left, next call now") {
		t.Errorf("stats: %v\n%s", err, out)
	}
	out, err = runShaper(t, "", "enqueue", "--config", cfg, "--vendor", vendor, "--path", "/x", "--cost", "6")
	if err == nil || !strings.Contains(out, "cost 6 is above") || !strings.Contains(out, "5 per 24h") {
		t.Errorf("--cost 6 against a quota of 5: %v\n%s", err, out)
	}
	out, err = runShaper(t, `{"path":"/a"}`+"\n"+`{"path":"/b","cost":7}`+"\n", "enqueue", "--config", cfg, "--vendor", vendor, "--file", "-")
	if err == nil || !strings.Contains(out, "stdin:2:") || !strings.Contains(out, "nothing was enqueued") {
		t.Errorf("a file with a cost of 7 on line 2: %v\n%s", err, out)
	}
	out, err = runShaper(t, "", "enqueue", "--config", cfg, "--vendor", vendor, "--path", "/x", "--priority", "urgent")
	if err == nil || !strings.Contains(out, `priority "urgent"`) {
		t.Errorf("--priority urgent: %v\n%s", err, out)
	}
	if out, err = runShaper(t, "", "enqueue", "--config", cfg, "--vendor", vendor, "--path", "/x", "--priority", "high", "--cost", "2"); err != nil {
		t.Errorf("a high call of cost 2: %v\n%s", err, out)
	}
	out, _ = runShaper(t, "", "stats", "--config", cfg, "--json")
	if err := json.Unmarshal([]byte(out), &rep); err != nil || rep.Vendors[0].QueuedHigh != 1 || rep.Vendors[0].Queued != 1 {
		t.Errorf("after a high call: %v %+v", err, rep.Vendors)
	}
}
