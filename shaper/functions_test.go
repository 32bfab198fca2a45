package shaper

import (
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/shaper-dev/shaper/internal/redistest"
)

// grantsOn has n ticks of a common bucket, then of one with a quota (the
// counted script's), granted on g, waiting out
// deferrals (a new group's first tick waits its horizon), and fails the
// test on an error.
func grantsOn(t *testing.T, g *Gate, n int) {
	t.Helper()
	common := Policy{Limits: []Limit{{Rate: 1000, Window: time.Second}}, Horizon: 50 * time.Millisecond}
	quota := common
	quota.Limits = append(quota.Limits, Limit{Rate: 100_000, Window: time.Hour})
	for _, p := range []Policy{common, quota} {
		b, err := g.Bucket(fmt.Sprintf("acme-%d", len(p.Limits)), p)
		if err != nil {
			t.Fatal(err)
		}
		for granted := 0; granted < n; {
			r, err := b.reserve(context.Background(), Request{})
			if err != nil {
				t.Fatalf("after %d grants: %v", granted, err)
			}
			if r.ok {
				granted++
			} else {
				time.Sleep(min(r.wait, time.Second))
			}
		}
	}
}

// TestGrantsRunAsFunctions: on a Redis with Functions the core, the
// counted and the full reserve script are loaded as libraries at their first grant (a new
// bucket's first grant is the full script's) and called with FCALL; a
// server that lost one (FUNCTION DELETE here, a restart without
// persistence or a promoted replica in production) gets it again at the
// next grant that needs it. A library that failed to load would leave the
// gate running scripts, and this test failing.
func TestGrantsRunAsFunctions(t *testing.T) {
	rdb := redistest.Client(t)
	ctx := context.Background()
	g := NewGate(rdb, Config{KeyPrefix: redistest.Prefix(t)})
	loaded := func(f *function) bool {
		t.Helper()
		libs, err := rdb.FunctionList(ctx, redis.FunctionListQuery{LibraryNamePattern: f.name}).Result()
		if err != nil {
			t.Fatal(err)
		}
		return len(libs) == 1 && len(libs[0].Functions) == 1 && libs[0].Functions[0].Name == f.name
	}
	grantsOn(t, g, 20)
	for _, f := range []*function{coreFunction, coreFoldFunction, adaptFunction, countedFunction, reserveFunction} {
		if g.noFunctions.Load() || !loaded(f) {
			t.Fatalf("after 20 grants: functions off %v, %s loaded %v; want it loaded as a function", g.noFunctions.Load(), f.name, loaded(f))
		}
	}
	if err := rdb.FunctionDelete(ctx, coreFunction.name).Err(); err != nil {
		t.Fatal(err)
	}
	grantsOn(t, g, 5)
	if g.noFunctions.Load() || !loaded(coreFunction) {
		t.Errorf("after the library was deleted: functions off %v, loaded %v; want it loaded again", g.noFunctions.Load(), loaded(coreFunction))
	}
}

// TestCoreRunsAsAScriptWithoutFunctions: the embedded Redis has no
// Functions (nor has Redis before 7): the core and the full reserve
// script run as scripts.
func TestCoreRunsAsAScriptWithoutFunctions(t *testing.T) {
	g := NewGate(embeddedClient(t), Config{KeyPrefix: "fn"})
	grantsOn(t, g, 20)
	if !g.noFunctions.Load() {
		t.Error("the gate still calls functions on a Redis without them")
	}
}

// TestScriptsLoadOnRedis: where Functions are missing (Redis before 7) a
// reserve function runs as one script, its library and body one chunk;
// Redis's Lua must compile it (a chunk holds at most 200 locals, which
// the library's steps and the body's bindings share).
func TestScriptsLoadOnRedis(t *testing.T) {
	rdb := redistest.Client(t)
	for _, f := range []*function{coreFunction, coreFoldFunction, adaptFunction, countedFunction, reserveFunction} {
		if err := f.script.Load(context.Background(), rdb).Err(); err != nil {
			t.Errorf("%s as a script: %v", f.name, err)
		}
	}
}
