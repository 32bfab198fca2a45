package main

import (
	"context"
	"os/exec"
	"strings"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/shaper-dev/shaper/internal/redistest"
)

// TestOwnRedisWorkerRefusesAnEvictingRedis: a Redis whose maxmemory-policy may
// evict queued calls (allkeys-*) stops the worker at start with a message
// that names the policy and the fix; --allow-eviction runs it with a
// warning; a volatile-* policy runs with a warning; noeviction runs
// quietly.
func TestOwnRedisWorkerRefusesAnEvictingRedis(t *testing.T) {
	t.Parallel()
	rs := redistest.Start(t)
	rdb := redis.NewClient(&redis.Options{Addr: rs.Addr})
	defer rdb.Close()
	cfg := writeConfig(t, rs.Addr, "evict", "http://127.0.0.1:1", 10)
	ctx := context.Background()

	if err := rdb.ConfigSet(ctx, "maxmemory-policy", "allkeys-lru").Err(); err != nil {
		t.Fatal(err)
	}
	cmd := exec.Command(shaperBin(t), "worker", "--config", cfg)
	done := make(chan struct{})
	var out []byte
	var err error
	go func() { out, err = cmd.CombinedOutput(); close(done) }()
	select {
	case <-done:
	case <-time.After(20 * time.Second):
		_ = cmd.Process.Kill()
		<-done
		t.Fatalf("the worker ran on an allkeys-lru Redis:\n%s", out)
	}
	if err == nil || !strings.Contains(string(out), "maxmemory-policy allkeys-lru") || !strings.Contains(string(out), "noeviction") || !strings.Contains(string(out), "--allow-eviction") {
		t.Errorf("allkeys-lru: %v\n%s", err, out)
	}

	for _, sc := range []struct {
		policy string
		args   []string
		warn   string
	}{
		{"allkeys-lru", []string{"--allow-eviction"}, "may evict queued calls"},
		{"volatile-ttl", nil, "may evict keys with an expiry"},
		{"noeviction", nil, ""},
	} {
		if err := rdb.ConfigSet(ctx, "maxmemory-policy", sc.policy).Err(); err != nil {
			t.Fatal(err)
		}
		cmd, log := startWorker(t, cfg, sc.args...)
		waitUntil(t, 20*time.Second, sc.policy+": the worker to start", func() bool { return strings.Contains(log.String(), "worker started") })
		_ = cmd.Process.Kill()
		_ = cmd.Wait()
		warned := strings.Contains(log.String(), "maxmemory_policy="+sc.policy)
		if sc.warn != "" && (!warned || !strings.Contains(log.String(), sc.warn)) || sc.warn == "" && warned {
			t.Errorf("%s %v: want warning %q, log:\n%s", sc.policy, sc.args, sc.warn, log.String())
		}
	}
}
