package main

import (
	"context"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/redis/go-redis/v9"

	"github.com/shaper-dev/shaper/internal/redistest"
)

// TestEnqueueSaysWhatItQueued: a call file whose second line's id another
// enqueue is queueing right now (its claim, fresh, in Redis) queues the
// other lines, and the command fails saying how many were queued and
// which line was not.
func TestEnqueueSaysWhatItQueued(t *testing.T) {
	t.Parallel()
	vendor := "part-" + redistest.Prefix(t)[5:]
	cfg := filepath.Join(t.TempDir(), "config.toml")
	err := os.WriteFile(cfg, []byte(`[redis]
addr = "`+redistest.Addr(t)+`"

[vendors.`+vendor+`]
base_url = "https://api.vendor.example"
rate = 5
`), 0o600)
	if err != nil {
		t.Fatal(err)
	}
	rdb := redistest.Client(t)
	ctx := context.Background()
	now, err := rdb.Time(ctx).Result()
	if err != nil {
		t.Fatal(err)
	}
	if err := rdb.ZAdd(ctx, "shaper:{"+vendor+"}:ids", redis.Z{Score: float64(now.UnixMilli() * 2), Member: vendor + "-2"}).Err(); err != nil {
		t.Fatal(err)
	}
	defer rdb.Del(ctx, "shaper:{"+vendor+"}:ids")
	lines := `{"id":"` + vendor + `-1","path":"/a"}
{"id":"` + vendor + `-2","path":"/b"}
{"id":"` + vendor + `-3","path":"/c"}
`
	out, err := runShaper(t, lines, "enqueue", "--config", cfg, "--vendor", vendor, "--file", "-")
	if err == nil || !strings.Contains(out, "enqueued 2, already queued 0") || !strings.Contains(out, "stdin:2: not queued: queue: another request is queueing") || strings.Contains(out, "stdin:1: not queued") {
		t.Fatalf("enqueue: %v\n%s\nwant a failure saying 2 were queued and line 2 was not", err, out)
	}
}
