package main

import (
	"context"
	"sync/atomic"
	"testing"

	"github.com/redis/go-redis/v9"

	"github.com/shaper-dev/shaper/config"
	"github.com/shaper-dev/shaper/internal/redistest"
)

// hookProbe counts the hooks added to a client after it: go-redis
// rebuilds its chain of hooks on each AddHook, asking every hook for
// its DialHook again.
type hookProbe struct{ rebuilt atomic.Int64 }

func (h *hookProbe) DialHook(next redis.DialHook) redis.DialHook {
	h.rebuilt.Add(1)
	return next
}
func (h *hookProbe) ProcessHook(next redis.ProcessHook) redis.ProcessHook { return next }
func (h *hookProbe) ProcessPipelineHook(next redis.ProcessPipelineHook) redis.ProcessPipelineHook {
	return next
}

// TestPageReloadsAddNoHooks: the live page's config reloads add no hook
// to the shared Redis client (a gate per reload added one each, kept
// for the life of the process), and the page still reads the vendors.
func TestPageReloadsAddNoHooks(t *testing.T) {
	rdb := redistest.Client(t)
	vendor := "hooks-" + redistest.Prefix(t)[5:]
	cfg, err := config.Load(writeConfig(t, redistest.Addr(t), vendor, "https://api.example", 10))
	if err != nil {
		t.Fatal(err)
	}
	src := newPageSource(rdb, cfg)
	defer src.Close()
	probe := &hookProbe{}
	rdb.AddHook(probe)
	before := probe.rebuilt.Load()
	const reloads = 20
	for range reloads {
		src.SetConfig(cfg)
	}
	if added := probe.rebuilt.Load() - before; added != 0 {
		t.Errorf("%d config reloads added %d hooks to the Redis client, want 0", reloads, added)
	}
	rep, err := src.Report(context.Background())
	if err != nil || len(rep.Vendors) != 1 || rep.Vendors[0].Name != vendor {
		t.Errorf("the page after %d reloads: %+v, %v; want %s", reloads, rep.Vendors, err, vendor)
	}
}
