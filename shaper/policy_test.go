package shaper

import (
	"errors"
	"math/rand/v2"
	"testing"
	"time"

	"github.com/shaper-dev/shaper/internal/windows"
)

func TestPolicyTick(t *testing.T) {
	ms := time.Millisecond
	tests := []struct {
		name      string
		p         Policy
		rate      float64 // withRate when > 0
		wantIv    time.Duration
		wantBurst int
	}{
		{"100/s default guard 20ms", Policy{Limits: []Limit{{Rate: 100, Window: time.Second}}}, 0, 10200 * time.Microsecond, 1},
		{"100/s burst 10", Policy{Limits: []Limit{{Rate: 100, Window: time.Second}}, Guard: 5 * ms, Burst: 10}, 0, 100500 * time.Microsecond, 10},
		{"burst not dividing rate uses floor(rate/burst) ticks", Policy{Limits: []Limit{{Rate: 10, Window: time.Second}}, Guard: 5 * ms, Burst: 3}, 0, 335 * ms, 3},
		{"no guard 2000/s", Policy{Limits: []Limit{{Rate: 2000, Window: time.Second}}, NoGuard: true}, 0, 500 * time.Microsecond, 1},
		{"rounds up to the microsecond", Policy{Limits: []Limit{{Rate: 3, Window: time.Second}}, NoGuard: true}, 0, 333334 * time.Microsecond, 1},
		{"two limits spread: widest spacing", Policy{Limits: []Limit{{Rate: 20, Window: 100 * ms}, {Rate: 50, Window: time.Second, Spread: true}}, Guard: 5 * ms}, 0, 20100 * time.Microsecond, 1},
		{"two limits spread: short one binds", Policy{Limits: []Limit{{Rate: 5, Window: 100 * ms}, {Rate: 100, Window: time.Second, Spread: true}}, Guard: 5 * ms}, 0, 21 * ms, 1},
		{"lowered rate", Policy{Limits: []Limit{{Rate: 100, Window: time.Second}}, Guard: 5 * ms}, 50, 20100 * time.Microsecond, 1},
		{"lowered below one per window", Policy{Limits: []Limit{{Rate: 100, Window: time.Second}}, Guard: 5 * ms, Burst: 5}, 0.5, 2010 * ms, 1},
		{"lowered below burst shrinks burst", Policy{Limits: []Limit{{Rate: 100, Window: time.Second}}, Guard: 5 * ms, Burst: 10}, 2.5, 1005 * ms, 2},
		{"raise is ignored", Policy{Limits: []Limit{{Rate: 100, Window: time.Second}}, Guard: 5 * ms}, 500, 10050 * time.Microsecond, 1},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			var iv time.Duration
			var burst int
			if tt.rate > 0 {
				iv, burst = tt.p.withRate(tt.rate)
			} else {
				iv, burst = tt.p.Tick()
			}
			if iv != tt.wantIv || burst != tt.wantBurst {
				t.Errorf("tick = %v x%d, want %v x%d", iv, burst, tt.wantIv, tt.wantBurst)
			}
		})
	}
}

// TestTickKeepsEveryLimit releases perfectly timed ticks for random
// policies and checks every limit over sliding windows: the arithmetic
// behind G1, without Redis or sleeps.
func TestTickKeepsEveryLimit(t *testing.T) {
	rng := rand.New(rand.NewPCG(1, 2))
	for i := 0; i < 300; i++ {
		var limits []Limit
		for range 1 + rng.IntN(3) {
			limits = append(limits, Limit{Rate: 1 + rng.IntN(200), Window: time.Duration(1+rng.IntN(2000)) * time.Millisecond, Spread: true})
		}
		minRate := limits[0].Rate
		for _, l := range limits {
			minRate = min(minRate, l.Rate)
		}
		p := Policy{Limits: limits, Burst: 1 + rng.IntN(minRate), NoGuard: rng.IntN(2) == 0}
		if err := p.Validate(); err != nil {
			continue // a guard as long as a tiny window
		}
		iv, burst := p.Tick()
		var ts []time.Time
		base := time.Unix(1_700_000_000, 0)
		for k := range 400 {
			for range burst {
				ts = append(ts, base.Add(time.Duration(k)*iv))
			}
		}
		for _, l := range limits {
			if got := windows.MaxSliding(ts, l.Window); got > l.Rate {
				t.Fatalf("policy %+v: tick %v x%d puts %d calls in %s, limit %d", p, iv, burst, got, l.Window, l.Rate)
			}
		}
	}
}

func TestPolicyValidate(t *testing.T) {
	ms := time.Millisecond
	tests := []struct {
		name string
		p    Policy
		want error
	}{
		{"ok", Policy{Limits: []Limit{{Rate: 100, Window: time.Second}}, Guard: 5 * ms, Burst: 100}, nil},
		{"no limits", Policy{}, errNoLimits},
		{"zero rate", Policy{Limits: []Limit{{Rate: 0, Window: time.Second}}, Guard: 5 * ms}, errBadLimit},
		{"zero window", Policy{Limits: []Limit{{Rate: 10, Window: 0}}, Guard: 5 * ms}, errBadLimit},
		{"burst over rate", Policy{Limits: []Limit{{Rate: 10, Window: time.Second}}, Guard: 5 * ms, Burst: 11}, errBurstOver},
		{"burst over an extra limit", Policy{Limits: []Limit{{Rate: 100, Window: time.Second}, {Rate: 5, Window: 100 * time.Millisecond}}, Guard: 5 * ms, Burst: 6}, errBurstOver},
		{"guard as long as the window", Policy{Limits: []Limit{{Rate: 10, Window: 5 * time.Millisecond}}, Guard: 5 * time.Millisecond}, errBadDuration},
		{"negative", Policy{Limits: []Limit{{Rate: 10, Window: time.Second}}, Guard: 5 * ms, Tolerance: -1}, errBadDuration},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			err := tt.p.Validate()
			if !errors.Is(err, tt.want) || (tt.want == nil) != (err == nil) {
				t.Errorf("Validate() = %v, want %v", err, tt.want)
			}
		})
	}
}
