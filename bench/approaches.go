package main

import (
	"context"
	"fmt"
	"io"
	"log/slog"
	"strconv"
	"sync"
	"time"

	"github.com/go-redis/redis_rate/v10"
	"github.com/redis/go-redis/v9"
	"go.uber.org/ratelimit"

	"github.com/shaper-dev/shaper/config"
	"github.com/shaper-dev/shaper/internal/recipes"
	"github.com/shaper-dev/shaper/queue"
	"github.com/shaper-dev/shaper/shaper"
	"github.com/shaper-dev/shaper/vendorclients"
)

// runEnv is one run's world.
type runEnv struct {
	addr      string
	vendorURL string
	rate      int
	replicas  int
	calls     int
	name      string // unique per run: queue and key names
	killAt    time.Duration
	// concurrency per replica, when set (the overhead comparison gives
	// shaper plain asynq's); else the vendor's own sizing.
	concurrency int
	kill        func()
	clients     []*redis.Client
}

func (e *runEnv) client() *redis.Client {
	c := redis.NewClient(&redis.Options{Addr: e.addr, PoolSize: 200})
	e.clients = append(e.clients, c)
	return c
}

func (e *runEnv) close() {
	for _, c := range e.clients {
		c.Close()
	}
}

type approach struct {
	key, name     string
	needsReplicas int // runs only with at least this many replicas
	start         func(ctx context.Context, e *runEnv) (stop func(), err error)
	// warm, if set, readies the run before its clock starts (overhead
	// runs only).
	warm func(ctx context.Context, e *runEnv) error
}

var approaches = []approach{
	{key: "shaper", name: "shaper", start: startShaper, warm: warmShaper},
	{key: "tb", name: "token bucket per worker, burst=rate", start: func(ctx context.Context, e *runEnv) (func(), error) {
		return startAsynq(ctx, e, recipes.TokenBucket(float64(e.rate), e.rate))
	}},
	{key: "gcra", name: "shared GCRA (redis_rate), burst=rate", start: func(ctx context.Context, e *runEnv) (func(), error) {
		return startGCRA(ctx, e, e.rate)
	}},
	{key: "gcra1", name: "shared GCRA (redis_rate), burst=1", start: func(ctx context.Context, e *runEnv) (func(), error) {
		return startGCRA(ctx, e, 1)
	}},
	{key: "pacer", name: "pacer per worker, rate/replicas", start: func(ctx context.Context, e *runEnv) (func(), error) {
		return startAsynq(ctx, e, pacer(e))
	}},
	{key: "pacerdie", name: "pacer per worker, one replica dies", needsReplicas: 2, start: func(ctx context.Context, e *runEnv) (func(), error) {
		e.killAt = time.Duration(e.calls/e.rate) * time.Second / 2
		return startAsynq(ctx, e, pacer(e))
	}},
}

func pacer(e *runEnv) func() admit {
	return func() admit {
		p := ratelimit.New(e.rate, ratelimit.Per(time.Duration(e.replicas)*time.Second), ratelimit.WithoutSlack)
		return func(ctx context.Context) (bool, time.Duration) { p.Take(); return true, 0 }
	}
}

func startGCRA(ctx context.Context, e *runEnv, burst int) (func(), error) {
	lim := redis_rate.NewLimiter(e.client())
	key := e.name
	return startAsynq(ctx, e, func() admit {
		return func(ctx context.Context) (bool, time.Duration) {
			res, err := lim.Allow(ctx, key, redis_rate.Limit{Rate: e.rate, Burst: burst, Period: time.Second})
			if err != nil {
				return false, time.Second
			}
			return res.Allowed > 0, res.RetryAfter
		}
	})
}

func (e *runEnv) shaperVendor() queue.Vendor {
	return queue.Vendor{Endpoint: vendorclients.Endpoint{Name: e.name, BaseURL: e.vendorURL},
		Policy: defaultPolicy(e.rate), Concurrency: e.concurrency}
}

// defaultPolicy is the policy of a vendor configured with its rate per
// second and nothing else, as config.toml gives it.
func defaultPolicy(rate int) shaper.Policy {
	toml := fmt.Sprintf("[vendors.v]\nbase_url = \"http://127.0.0.1:1\"\nrate = %d\n", rate)
	cfg, err := config.Parse("bench.toml", []byte(toml))
	if err != nil {
		panic(err) // the text above is the bench's own
	}
	return cfg.Vendors[0].Policy()
}

// warmShaper uses the run's vendor once, as a vendor in service has been:
// the very first call of a vendor Redis has never seen waits one horizon
// (its gate cannot tell a new vendor from one whose state Redis lost).
func warmShaper(ctx context.Context, e *runEnv) error {
	v := e.shaperVendor()
	rdb := redis.NewClient(&redis.Options{Addr: e.addr})
	defer rdb.Close()
	g := shaper.NewGate(rdb, shaper.Config{KeyPrefix: e.name})
	b, err := g.Bucket(v.Name, v.Policy)
	if err != nil {
		return err
	}
	_, err = b.Acquire(ctx)
	return err
}

func startShaper(ctx context.Context, e *runEnv) (func(), error) {
	vendor := e.shaperVendor()
	qc := queue.NewClient(e.client(), queue.ClientConfig{Vendors: []queue.Vendor{vendor}, KeyPrefix: e.name})
	calls := make([]queue.Call, e.calls)
	for i := range calls {
		calls[i] = queue.Call{ID: e.name + "-" + strconv.Itoa(i), Method: "POST", Path: "/orders"}
	}
	if _, err := qc.EnqueueBatch(ctx, e.name, calls); err != nil {
		return nil, err
	}
	qc.Close()
	quiet := slog.New(slog.NewTextHandler(io.Discard, nil))
	ctx, cancel := context.WithCancel(ctx)
	var wg sync.WaitGroup
	for range e.replicas {
		w, err := queue.NewWorker(e.client(), queue.WorkerConfig{Logger: quiet, KeyPrefix: e.name, Vendors: []queue.Vendor{vendor}})
		if err != nil {
			cancel()
			return nil, err
		}
		wg.Go(func() { _ = w.Run(ctx) })
	}
	return func() { cancel(); wg.Wait(); e.close() }, nil
}

// admit says whether a call may go now, or how long to defer it.
type admit = recipes.Admit

// startAsynq runs the usual recipe (package recipes) for the run.
func startAsynq(ctx context.Context, e *runEnv, newAdmit func() admit) (func(), error) {
	servers, err := recipes.Run(ctx, e.client, e.name, e.vendorURL, e.calls, e.replicas, newAdmit)
	if err != nil {
		return nil, err
	}
	if e.killAt > 0 {
		victim := servers[0]
		e.kill = func() { victim.Stop(); go victim.Shutdown() }
	}
	return func() {
		var wg sync.WaitGroup
		for _, s := range servers {
			wg.Go(s.Shutdown)
		}
		wg.Wait()
		e.close()
	}, nil
}
