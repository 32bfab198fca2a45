package shaper

import (
	"context"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/go-redis/redis_rate/v10"
	"github.com/redis/go-redis/v9"

	"github.com/shaper-dev/shaper/internal/redistest"
)

// BenchmarkRedisCPU measures what one grant costs Redis: the
// usec_per_call of EVALSHA in INFO commandstats while only the gate runs
// (one caller, a rate so high that nothing is deferred), beside
// redis_rate's GCRA script (Allow) on the same Redis, and the Redis
// commands the scripts run per grant (cmds/grant, every command but
// EVALSHA in commandstats). This, not the client's round trip, bounds how
// many calls one Redis can shape. The cases:
//
//   - common: one limit, no total, one lane (the core script);
//   - common-held: the same with a holder recorded, as the queue's calls
//     do;
//   - accounts: a per-account vendor with a total, and a quota on each of
//     100 accounts taken in turn (the full script);
//   - gcra: redis_rate's Allow.
func BenchmarkRedisCPU(b *testing.B) {
	ctx := context.Background()
	// A server of its own: commandstats are server-wide, and other
	// packages' tests may share the default one.
	srv := redistest.Start(b)
	rdb := redis.NewClient(&redis.Options{Addr: srv.Addr})
	defer rdb.Close()
	measure := func(b *testing.B, run func(i int) error) {
		for i := range 200 { // loads the script, and the state of every bucket
			if err := run(i); err != nil {
				b.Fatal(err)
			}
		}
		if err := rdb.ConfigResetStat(ctx).Err(); err != nil {
			b.Fatal(err)
		}
		b.ResetTimer()
		for i := 0; i < b.N; i++ {
			if err := run(i); err != nil {
				b.Fatal(err)
			}
		}
		b.StopTimer()
		st := commandStats(b, rdb)
		ev := st["evalsha"]
		if ev.calls < int64(b.N) {
			b.Fatalf("commandstats counted %d evalsha calls for %d grants", ev.calls, b.N)
		}
		var cmds int64
		for name, c := range st {
			if name != "evalsha" && name != "config|resetstat" && name != "info" {
				cmds += c.calls
			}
		}
		b.ReportMetric(ev.usecPerCall*float64(ev.calls)/float64(b.N), "redis-µs/grant")
		b.ReportMetric(float64(cmds)/float64(b.N), "cmds/grant")
	}
	grant := func(b *testing.B, bucket *Bucket, req Request) error {
		r, err := bucket.reserve(ctx, req)
		if err == nil && !r.ok && r.reason != stateReset {
			b.Fatalf("deferred: %+v", r)
		}
		return err
	}
	fast := Policy{Limits: []Limit{{Rate: 1_000_000, Window: time.Second}}, NoGuard: true, Horizon: time.Hour}
	for _, held := range []bool{false, true} {
		name := "common"
		if held {
			name = "common-held"
		}
		b.Run(name, func(b *testing.B) {
			g := NewGate(rdb, Config{KeyPrefix: redistest.Prefix(b)})
			bucket, err := g.Bucket("cpu", fast)
			if err != nil {
				b.Fatal(err)
			}
			measure(b, func(i int) error {
				req := Request{}
				if held {
					req.Holder = "vendor:cpu|task-" + strconv.Itoa(i)
				}
				return grant(b, bucket, req)
			})
		})
	}
	b.Run("accounts", func(b *testing.B) {
		g := NewGate(rdb, Config{KeyPrefix: redistest.Prefix(b)})
		grp, err := g.Group("cpu", &Policy{Limits: []Limit{{Rate: 1_000_000, Window: time.Second}}, NoGuard: true})
		if err != nil {
			b.Fatal(err)
		}
		p := fast
		p.Horizon = time.Second // a new group waits out one horizon (its epoch is new)
		p.Limits = append(p.Limits, Limit{Rate: 1_000_000_000, Window: time.Hour})
		var buckets []*Bucket
		for a := range 100 {
			bucket, err := grp.Bucket("store-"+strconv.Itoa(a), p)
			if err != nil {
				b.Fatal(err)
			}
			buckets = append(buckets, bucket)
		}
		if err := grant(b, buckets[0], Request{}); err != nil {
			b.Fatal(err)
		}
		time.Sleep(p.Horizon + 100*time.Millisecond)
		measure(b, func(i int) error { return grant(b, buckets[i%len(buckets)], Request{}) })
	})
	b.Run("gcra", func(b *testing.B) {
		lim := redis_rate.NewLimiter(rdb)
		key := redistest.Prefix(b) + ":gcra"
		measure(b, func(int) error {
			_, err := lim.Allow(ctx, key, redis_rate.PerSecond(1_000_000))
			return err
		})
	})
}

// commandStat is one command's line of INFO commandstats.
type commandStat struct {
	calls       int64
	usecPerCall float64
}

// commandStats reads INFO commandstats, by command name.
func commandStats(b *testing.B, rdb *redis.Client) map[string]commandStat {
	info, err := rdb.Info(context.Background(), "commandstats").Result()
	if err != nil {
		b.Fatal(err)
	}
	out := map[string]commandStat{}
	for _, line := range strings.Split(info, "\n") {
		rest, ok := strings.CutPrefix(strings.TrimSpace(line), "cmdstat_")
		if !ok {
			continue
		}
		name, fields, _ := strings.Cut(rest, ":")
		var st commandStat
		for _, f := range strings.Split(fields, ",") {
			k, v, _ := strings.Cut(f, "=")
			switch k {
			case "usec_per_call":
				st.usecPerCall, _ = strconv.ParseFloat(v, 64)
			case "calls":
				st.calls, _ = strconv.ParseInt(v, 10, 64)
			}
		}
		out[name] = st
	}
	if _, ok := out["evalsha"]; !ok {
		b.Fatalf("no evalsha in INFO commandstats:\n%s", info)
	}
	return out
}
