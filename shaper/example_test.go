package shaper_test

import (
	"context"
	"errors"
	"fmt"
	"log"
	"os"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/shaper-dev/shaper/shaper"
)

// The examples need a Redis at REDIS_ADDR: CI and `make test` set it, and
// the package's TestMain (redistest.Main) sets it to the Redis the tests
// use. A fresh key prefix per run keeps them repeatable; production uses
// the default prefix.

// A vendor allows 10 calls per second. Every process on the same Redis
// shares the bucket's ticks, and a call starts within the policy's
// tolerance of its tick or not at all. (The first call of a new bucket
// waits out the horizon, 1s by default: ticks granted before a loss of the
// bucket's state may still be to come.)
func Example() {
	ctx := context.Background()
	rdb := redis.NewClient(&redis.Options{Addr: os.Getenv("REDIS_ADDR")})
	defer rdb.Close()
	gate := shaper.NewGate(rdb, shaper.Config{KeyPrefix: fmt.Sprintf("example-%d", time.Now().UnixNano())})
	acme, err := gate.Bucket("acme", shaper.Policy{Limits: []shaper.Limit{{Rate: 10, Window: time.Second}}})
	if err != nil {
		log.Fatal(err)
	}
	tick, _ := acme.Policy().Tick()
	tolerance := acme.Policy().Tolerance
	fmt.Printf("acme: a tick every %v, calls start within %v of it\n", tick, tolerance)

	var starts []time.Time
	for range 3 {
		permit, err := acme.Acquire(ctx) // waits for acme's next tick
		if err != nil {
			log.Fatal(err)
		}
		starts = append(starts, time.Now())
		// Call the vendor here, then free the permit.
		if err := permit.Release(ctx); err != nil {
			log.Fatal(err)
		}
	}
	apart := true
	for i := 1; i < len(starts); i++ {
		apart = apart && starts[i].Sub(starts[i-1]) >= tick-tolerance
	}
	fmt.Printf("%d calls, at least %v apart: %v\n", len(starts), tick-tolerance, apart)
	// Output:
	// acme: a tick every 102ms, calls start within 15ms of it
	// 3 calls, at least 87ms apart: true
}

// The vendor answered 429 with Retry-After: 30. The pause holds for every
// process on the same Redis. A worker that must not hold a goroutine through
// it asks with a MaxWait and comes back later: Acquire returns no permit and
// a *shaper.Wait saying when (a tick may be granted up to the horizon, 1s,
// ahead of it).
func ExampleControl_Pause() {
	ctx := context.Background()
	rdb := redis.NewClient(&redis.Options{Addr: os.Getenv("REDIS_ADDR")})
	defer rdb.Close()
	gate := shaper.NewGate(rdb, shaper.Config{KeyPrefix: fmt.Sprintf("example-%d", time.Now().UnixNano())})
	acme, err := gate.Bucket("acme", shaper.Policy{Limits: []shaper.Limit{{Rate: 100, Window: time.Second}}})
	if err != nil {
		log.Fatal(err)
	}
	ctl := acme.Control()
	if _, err := ctl.Pause(ctx, 30*time.Second, "429 Retry-After: 30"); err != nil {
		log.Fatal(err)
	}
	if err := ctl.CountRateLimited(ctx); err != nil {
		log.Fatal(err)
	}
	st, err := acme.Stats(ctx)
	if err != nil {
		log.Fatal(err)
	}
	fmt.Printf("paused for %v: %s\n", st.PausedFor.Round(time.Second), st.PauseReason)
	fmt.Println("rate-limited answers:", st.RateLimited)

	permit, err := acme.Acquire(ctx, shaper.Request{MaxWait: time.Second})
	var wait *shaper.Wait
	if !errors.As(err, &wait) {
		log.Fatal(err)
	}
	fmt.Printf("permit: %v, ask again in %v\n", permit != nil, wait.For.Round(time.Second))
	// Output:
	// paused for 30s: 429 Retry-After: 30
	// rate-limited answers: 1
	// permit: false, ask again in 29s
}

// The vendor's headers announce a lower limit than configured: every process
// spaces the bucket's ticks by it, until an announcement at or above the
// configured rate clears it. (The configured 100 per second is 98 after the
// default 20ms guard.)
func ExampleControl_Announce() {
	ctx := context.Background()
	rdb := redis.NewClient(&redis.Options{Addr: os.Getenv("REDIS_ADDR")})
	defer rdb.Close()
	gate := shaper.NewGate(rdb, shaper.Config{KeyPrefix: fmt.Sprintf("example-%d", time.Now().UnixNano())})
	acme, err := gate.Bucket("acme", shaper.Policy{Limits: []shaper.Limit{{Rate: 100, Window: time.Second}}})
	if err != nil {
		log.Fatal(err)
	}
	show := func() {
		st, err := acme.Stats(ctx)
		if err != nil {
			log.Fatal(err)
		}
		fmt.Printf("%.1f of %.1f calls per %v", st.EffectiveRate, st.ConfiguredRate, st.Window)
		if st.RateSource != "" {
			fmt.Printf(" (%s: %s)", st.RateSource, st.RateReason)
		}
		fmt.Println()
	}
	if err := acme.Control().Announce(ctx, 50, "X-RateLimit-Limit: 50"); err != nil {
		log.Fatal(err)
	}
	show()
	if err := acme.Control().Announce(ctx, 100, "X-RateLimit-Limit: 100"); err != nil {
		log.Fatal(err)
	}
	show()
	// Output:
	// 49.0 of 98.0 calls per 1s (announced: X-RateLimit-Limit: 50)
	// 98.0 of 98.0 calls per 1s
}
