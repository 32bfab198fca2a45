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
// redis_rate's GCRA script (Allow) on the same Redis. This, not the
// client's round trip, bounds how many calls one Redis can shape.
func BenchmarkRedisCPU(b *testing.B) {
	ctx := context.Background()
	// A server of its own: commandstats are server-wide, and other
	// packages' tests may share the default one.
	srv := redistest.Start(b)
	rdb := redis.NewClient(&redis.Options{Addr: srv.Addr})
	defer rdb.Close()
	measure := func(b *testing.B, run func() error) {
		if err := run(); err != nil { // loads the script
			b.Fatal(err)
		}
		if err := rdb.ConfigResetStat(ctx).Err(); err != nil {
			b.Fatal(err)
		}
		b.ResetTimer()
		for i := 0; i < b.N; i++ {
			if err := run(); err != nil {
				b.Fatal(err)
			}
		}
		b.StopTimer()
		usec, calls := evalshaStats(b, rdb)
		if calls < int64(b.N) {
			b.Fatalf("commandstats counted %d evalsha calls for %d grants", calls, b.N)
		}
		b.ReportMetric(usec, "redis-µs/grant")
	}
	b.Run("gate", func(b *testing.B) {
		g := NewGate(rdb, Config{KeyPrefix: redistest.Prefix(b)})
		bucket, err := g.Bucket("cpu", Policy{Limits: []Limit{{Rate: 1_000_000, Window: time.Second}}, NoGuard: true, Horizon: time.Hour})
		if err != nil {
			b.Fatal(err)
		}
		measure(b, func() error {
			r, err := bucket.reserve(ctx, Request{})
			if err == nil && !r.ok && r.reason != stateReset {
				b.Fatalf("deferred: %+v", r)
			}
			return err
		})
	})
	b.Run("gcra", func(b *testing.B) {
		lim := redis_rate.NewLimiter(rdb)
		key := redistest.Prefix(b) + ":gcra"
		measure(b, func() error {
			_, err := lim.Allow(ctx, key, redis_rate.PerSecond(1_000_000))
			return err
		})
	})
}

// evalshaStats reads usec_per_call and calls of EVALSHA from INFO
// commandstats.
func evalshaStats(b *testing.B, rdb *redis.Client) (usec float64, calls int64) {
	info, err := rdb.Info(context.Background(), "commandstats").Result()
	if err != nil {
		b.Fatal(err)
	}
	for _, line := range strings.Split(info, "\n") {
		rest, ok := strings.CutPrefix(strings.TrimSpace(line), "cmdstat_evalsha:")
		if !ok {
			continue
		}
		for _, f := range strings.Split(rest, ",") {
			k, v, _ := strings.Cut(f, "=")
			switch k {
			case "usec_per_call":
				usec, _ = strconv.ParseFloat(v, 64)
			case "calls":
				calls, _ = strconv.ParseInt(v, 10, 64)
			}
		}
		return usec, calls
	}
	b.Fatalf("no evalsha in INFO commandstats:\n%s", info)
	return 0, 0
}
