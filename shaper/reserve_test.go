package shaper

import (
	"context"
	"fmt"
	"math"
	"math/rand/v2"
	"testing"
	"time"

	"github.com/shaper-dev/shaper/internal/redistest"
)

// randomPolicy returns a valid policy with 1 to 3 limits of rates 1..100000
// per windows of 1ms..24h (log-uniform), a burst, a guard (none, the
// default or random) and a horizon of 1ms..1000 days.
func randomPolicy(rng *rand.Rand) Policy {
	logUniform := func(lo, hi float64) float64 { return lo * math.Pow(hi/lo, rng.Float64()) }
	for {
		var p Policy
		minRate, minWindow := math.MaxInt, time.Duration(math.MaxInt64)
		for range 1 + rng.IntN(3) {
			l := Limit{Rate: int(logUniform(1, 100_001)), Window: time.Duration(logUniform(float64(time.Millisecond), float64(24*time.Hour))), Spread: true} // the tick keeps spaced limits; quotas are counted (TestQuota...)
			p.Limits = append(p.Limits, l)
			minRate, minWindow = min(minRate, l.Rate), min(minWindow, l.Window)
		}
		p.Burst = 1 + rng.IntN(min(minRate, 12))
		switch rng.IntN(3) {
		case 0:
			p.NoGuard = true
		case 1:
			p.Guard = time.Duration(rng.Int64N(int64(minWindow)))
		}
		p.Horizon = time.Duration(logUniform(float64(time.Millisecond), float64(1000*24*time.Hour)))
		if p.Validate() == nil {
			return p
		}
	}
}

// loweredRates returns rates to set on p's primary limit: below one call
// per window, between one and the configured rate (whole and not), just
// below the burst, the configured rate, above it, and 0 (none set).
func loweredRates(rng *rand.Rand, p Policy) []float64 {
	r0 := float64(p.Limits[0].Rate)
	rates := []float64{
		0,
		0.01 * math.Pow(100, rng.Float64()),
		1 + rng.Float64()*(r0-1),
		float64(1 + rng.IntN(p.Limits[0].Rate)),
		r0,
		r0 * (1 + 9*rng.Float64()),
	}
	if p.Burst > 1 {
		rates = append(rates, float64(p.Burst)-0.5)
	}
	return rates
}

// TestLuaTickMatchesGo checks the reserve script's tick against tickFor:
// for random policies and effective rates, the interval and burst the script
// grants must be exactly Policy.withRate (Policy.Tick with no rate set),
// to the microsecond. The schedule is read off the grants: with the Redis
// time standing still, consecutive grants share a tick until the burst is
// used, and the next tick is one interval later.
func TestLuaTickMatchesGo(t *testing.T) {
	rdb := redistest.Client(t)
	g := NewGate(rdb, Config{KeyPrefix: redistest.Prefix(t)})
	clk := fakeRedisTime(g, testEpoch)
	ctx := context.Background()
	rng := rand.New(rand.NewPCG(1, 9))
	// First the corners: one limit; a lowered rate that shrinks the burst
	// while a second limit with a long window binds; a rate below one call
	// per window with a second limit; then random policies.
	type tc struct {
		p     Policy
		rates []float64
	}
	tcs := []tc{
		{Policy{Limits: []Limit{{Rate: 100, Window: time.Second}}, Burst: 10}, []float64{0, 0.5, 2.5, 40, 100, 500}},
		{Policy{Limits: []Limit{{Rate: 100, Window: time.Second}, {Rate: 10, Window: time.Hour, Spread: true}}, Burst: 10, NoGuard: true}, []float64{5, 0.5}},
		{Policy{Limits: []Limit{{Rate: 100, Window: time.Second}, {Rate: 200, Window: time.Minute, Spread: true}}, Burst: 4, Guard: time.Millisecond}, []float64{3, 0.25}},
	}
	for range 150 {
		p := randomPolicy(rng)
		tcs = append(tcs, tc{p, loweredRates(rng, p)})
	}
	cases, mismatches := 0, 0
	for i, tc := range tcs {
		p := tc.p
		for j, rate := range tc.rates {
			b, err := g.Bucket(fmt.Sprintf("p%d-r%d", i, j), p)
			if err != nil {
				t.Fatal(err)
			}
			wantIv, wantBurst := p.Tick()
			if rate > 0 {
				if err := b.Control().overrideRate(ctx, rate, "test"); err != nil {
					t.Fatal(err)
				}
				wantIv, wantBurst = p.withRate(rate)
			}
			// Every bucket is new: the time can start over, which keeps it far
			// from 2^53 µs (exact in Lua) whatever the intervals.
			clk.set(testEpoch)
			ticks := grantTicks(t, b, clk, wantBurst+1)
			burst := 0
			for burst < len(ticks) && ticks[burst] == ticks[0] {
				burst++
			}
			var iv time.Duration
			if burst < len(ticks) {
				iv = time.Duration(ticks[burst]-ticks[0]) * time.Microsecond
			}
			cases++
			if iv != wantIv || burst != wantBurst {
				mismatches++
				if mismatches <= 10 {
					t.Errorf("limits %v burst %d guard %v (no guard %v), rate %v: Lua grants %v x%d, Go says %v x%d",
						p.Limits, p.Burst, p.Guard, p.NoGuard, rate, iv, burst, wantIv, wantBurst)
				}
			}
		}
	}
	t.Logf("%d policies and rates, %d mismatches", cases, mismatches)
	if cases == 0 {
		t.Fatal("no case ran")
	}
}
