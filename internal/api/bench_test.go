package api

import (
	"bytes"
	"context"
	"fmt"
	"net/http"
	"net/http/httptest"
	"strconv"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/hibiken/asynq"
	"github.com/redis/go-redis/v9"

	"github.com/shaper-dev/shaper/internal/redistest"
	"github.com/shaper-dev/shaper/queue"
	"github.com/shaper-dev/shaper/shaper"
	"github.com/shaper-dev/shaper/vendorclients"
)

// benchBatch is the calls of one POST, and of one EnqueueBatch.
const benchBatch = 100

// BenchmarkEnqueue queues batches of 100 calls with ids on one vendor
// (queue_limit 100,000, no worker), from 8 goroutines: through the API
// (one NDJSON POST each, over HTTP on loopback) and through
// queue.Client.EnqueueBatch on the same Redis. The bodies and call
// slices are made before the clock starts. It reports calls/s and the
// Redis commands each call cost (INFO commandstats, exact on a Redis of
// the benchmark's own).
func BenchmarkEnqueue(b *testing.B) {
	b.Run("via=EnqueueBatch", func(b *testing.B) {
		c, vendor := benchClient(b)
		benchCalls(b, func(ids []string) []queue.Call {
			calls := make([]queue.Call, len(ids))
			for i, id := range ids {
				calls[i] = queue.Call{ID: id, Method: "POST", Path: "/orders/" + id, Body: []byte(`{"sku":"X-1","qty":2}`)}
			}
			return calls
		}, func(ctx context.Context, calls []queue.Call) error {
			res, err := c.EnqueueBatch(ctx, vendor, calls)
			if err == nil && res.Enqueued != len(calls) {
				err = fmt.Errorf("%d of %d queued", res.Enqueued, len(calls))
			}
			return err
		})
	})
	b.Run("via=API", func(b *testing.B) {
		c, vendor := benchClient(b)
		srv := httptest.NewServer(New(Options{Client: c}))
		defer srv.Close()
		hc := &http.Client{Transport: &http.Transport{MaxIdleConnsPerHost: 64}}
		defer hc.CloseIdleConnections()
		want := []byte(`"enqueued":` + strconv.Itoa(benchBatch) + ",")
		benchCalls(b, func(ids []string) []byte {
			var body bytes.Buffer
			for _, id := range ids {
				fmt.Fprintf(&body, `{"vendor":%q,"id":%q,"method":"POST","path":"/orders/%s","body":{"sku":"X-1","qty":2}}`+"\n", vendor, id, id)
			}
			return body.Bytes()
		}, func(ctx context.Context, body []byte) error {
			resp, err := hc.Post(srv.URL+"/v1/calls", "application/x-ndjson", bytes.NewReader(body))
			if err != nil {
				return err
			}
			defer resp.Body.Close()
			var out bytes.Buffer
			_, _ = out.ReadFrom(resp.Body)
			if resp.StatusCode != http.StatusAccepted || !bytes.Contains(out.Bytes(), want) {
				return fmt.Errorf("POST: %d %s", resp.StatusCode, out.Bytes())
			}
			return nil
		})
	})
}

// benchClient is a client of one fresh vendor, whose queues are deleted
// when the benchmark ends.
func benchClient(b *testing.B) (*queue.Client, string) {
	rdb := redis.NewClient(&redis.Options{Addr: redistest.Addr(b), PoolSize: 64})
	b.Cleanup(func() { _ = rdb.Close() })
	prefix := redistest.Prefix(b)
	name := "bench-" + prefix[5:]
	v := queue.Vendor{Endpoint: vendorclients.Endpoint{Name: name, BaseURL: "https://api.vendor.example"},
		Policy: shaper.Policy{Limits: []shaper.Limit{{Rate: 100, Window: time.Second}}}, QueueLimit: 100_000}
	c := queue.NewClient(rdb, queue.ClientConfig{Vendors: []queue.Vendor{v}, KeyPrefix: prefix})
	b.Cleanup(func() {
		_ = c.Close()
		insp := asynq.NewInspectorFromRedisClient(rdb)
		for _, q := range []string{queue.QueueName(name), queue.HighQueueName(name)} {
			_ = insp.DeleteQueue(q, true)
		}
	})
	return c, name
}

// benchCalls makes b.N batches of new ids, then runs enqueue on each
// from 8 goroutines, and reports calls/s and Redis commands per call.
func benchCalls[T any](b *testing.B, batch func(ids []string) T, enqueue func(context.Context, T) error) {
	rdb := redis.NewClient(&redis.Options{Addr: redistest.Addr(b)})
	defer rdb.Close()
	ctx := context.Background()
	batches := make([]T, b.N)
	for n := range batches {
		ids := make([]string, benchBatch)
		for i := range ids {
			ids[i] = fmt.Sprintf("b%d-%d", n, i)
		}
		batches[n] = batch(ids)
	}
	var next atomic.Int64
	b.ReportAllocs()
	b.SetParallelism(4)
	before := redisCommands(b, rdb)
	b.ResetTimer()
	b.RunParallel(func(pb *testing.PB) {
		for pb.Next() {
			if err := enqueue(ctx, batches[next.Add(1)-1]); err != nil {
				b.Error(err)
				return
			}
		}
	})
	b.StopTimer()
	calls := float64(b.N * benchBatch)
	b.ReportMetric(calls/b.Elapsed().Seconds(), "calls/s")
	b.ReportMetric(float64(redisCommands(b, rdb)-before-1)/calls, "redis-cmds/call")
}

// redisCommands is the number of commands Redis has run (INFO
// commandstats), this INFO included.
func redisCommands(b *testing.B, rdb *redis.Client) int64 {
	info, err := rdb.Info(context.Background(), "commandstats").Result()
	if err != nil {
		b.Fatal(err)
	}
	var total int64
	for _, line := range strings.Split(info, "\n") {
		if !strings.HasPrefix(line, "cmdstat_") {
			continue
		}
		_, rest, _ := strings.Cut(line, ":calls=")
		n, _ := strconv.ParseInt(strings.SplitN(rest, ",", 2)[0], 10, 64)
		total += n
	}
	return total
}
