package shaper

import (
	"context"
	"sync/atomic"
	"testing"

	"github.com/redis/go-redis/v9"

	"github.com/shaper-dev/shaper/internal/redistest"
)

// hookProbe is a go-redis hook that counts how often the client's hook
// chain is built: once when it is added, once more per hook added after
// it.
type hookProbe struct{ builds atomic.Int64 }

func (p *hookProbe) DialHook(next redis.DialHook) redis.DialHook {
	p.builds.Add(1)
	return next
}
func (p *hookProbe) ProcessHook(next redis.ProcessHook) redis.ProcessHook { return next }
func (p *hookProbe) ProcessPipelineHook(next redis.ProcessPipelineHook) redis.ProcessPipelineHook {
	return next
}

// TestGatesShareOneDialHook: the gates made on one client (a page makes
// one per config reload) add one dial hook to it between them, not one
// each, and each of them sees a dial once.
func TestGatesShareOneDialHook(t *testing.T) {
	t.Parallel()
	rdb := redis.NewClient(&redis.Options{Addr: redistest.Addr(t)})
	t.Cleanup(func() { _ = rdb.Close() })
	probe := &hookProbe{}
	rdb.AddHook(probe)
	const n = 50
	gates := make([]*Gate, n)
	for i := range gates {
		gates[i] = NewGate(rdb, Config{KeyPrefix: redistest.Prefix(t)})
	}
	if added := probe.builds.Load() - 1; added != 1 {
		t.Errorf("%d gates on one client added %d hooks to it, want 1", n, added)
	}
	before := make([]uint64, n)
	for i, g := range gates {
		before[i] = g.srv.dials.Load()
	}
	if err := rdb.Ping(context.Background()).Err(); err != nil { // the client's first connection
		t.Fatal(err)
	}
	for i, g := range gates {
		if !g.srv.hooked {
			t.Fatalf("gate %d does not count dials", i)
		}
		if d := g.srv.dials.Load() - before[i]; d != 1 {
			t.Errorf("gate %d counted %d dials for one", i, d)
		}
	}
}
