package shaper

import (
	"context"
	"fmt"
	"sync/atomic"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/shaper-dev/shaper/internal/redistest"
)

// countHook counts the round trips a client makes (a pipeline is one).
type countHook struct{ n atomic.Int64 }

func (h *countHook) DialHook(next redis.DialHook) redis.DialHook { return next }
func (h *countHook) ProcessHook(next redis.ProcessHook) redis.ProcessHook {
	return func(ctx context.Context, cmd redis.Cmder) error {
		h.n.Add(1)
		return next(ctx, cmd)
	}
}
func (h *countHook) ProcessPipelineHook(next redis.ProcessPipelineHook) redis.ProcessPipelineHook {
	return func(ctx context.Context, cmds []redis.Cmder) error {
		h.n.Add(1)
		return next(ctx, cmds)
	}
}

// BenchmarkReserve measures the gate itself: grants per second for one
// bucket with 1, 8 and 64 concurrent callers, and Redis round trips per
// grant. The rate is set so high that no caller is ever deferred.
func BenchmarkReserve(b *testing.B) {
	for _, callers := range []int{1, 8, 64} {
		b.Run(fmt.Sprintf("callers=%d", callers), func(b *testing.B) {
			rdb := redis.NewClient(&redis.Options{Addr: redistest.Addr(b), PoolSize: callers})
			defer rdb.Close()
			hook := &countHook{}
			rdb.AddHook(hook)
			g := NewGate(rdb, Config{KeyPrefix: redistest.Prefix(b)})
			bucket, err := g.Bucket("bench", Policy{Limits: []Limit{{Rate: 1_000_000, Window: time.Second}}, NoGuard: true, Horizon: time.Hour})
			if err != nil {
				b.Fatal(err)
			}
			ctx := context.Background()
			if _, err := bucket.reserve(ctx, Request{}); err != nil { // first use: state reset
				b.Fatal(err)
			}
			var granted atomic.Int64
			hook.n.Store(0)
			b.ReportAllocs()
			b.SetParallelism((callers + 1) / 2) // GOMAXPROCS is 2 on the reference machine
			b.ResetTimer()
			b.RunParallel(func(pb *testing.PB) {
				for pb.Next() {
					r, err := bucket.reserve(ctx, Request{})
					if err != nil {
						b.Error(err)
						return
					}
					if r.ok {
						granted.Add(1)
					}
				}
			})
			b.StopTimer()
			if granted.Load() == 0 {
				b.Fatal("nothing granted")
			}
			b.ReportMetric(float64(granted.Load())/b.Elapsed().Seconds(), "grants/s")
			b.ReportMetric(float64(hook.n.Load())/float64(granted.Load()), "roundtrips/grant")
		})
	}
}
