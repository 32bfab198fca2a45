package shaper

import (
	"errors"
	"fmt"
	"math"
	"strconv"
	"strings"
	"time"

	"github.com/shaper-dev/shaper/internal/durations"
)

// Default values applied by Policy.withDefaults.
const (
	DefaultBurst    = 1
	DefaultGuard    = 20 * time.Millisecond
	DefaultHorizon  = time.Second
	defaultLeaseTTL = time.Minute
	minTolerance    = time.Millisecond
)

// Limit is one limit a vendor enforces: at most Rate units (calls, or
// their costs) in any Window.
//
// The primary limit (a policy's first) and every limit whose window is
// not longer than the primary's are spaced: the bucket's tick keeps each
// of them (see Policy.Tick). A longer limit is a quota, unless Spread is
// set: calls go out at the pace of the spaced limits until Rate units
// were used in the last Window, then wait until calls leave it. Spread
// makes a longer limit spaced too, its rate spread evenly over its
// window.
type Limit struct {
	Rate   int
	Window time.Duration
	Spread bool
}

func (l Limit) String() string { return fmt.Sprintf("%d per %s", l.Rate, durations.Format(l.Window)) }

// Quota reports whether limit i of p is a quota rather than spaced.
func (p Policy) Quota(i int) bool {
	return i > 0 && i < len(p.Limits) && !p.Limits[i].Spread && p.Limits[i].Window > p.Limits[0].Window
}

// spaced returns the limits the tick keeps: all but the quotas.
func (p Policy) spaced() []Limit {
	out := make([]Limit, 0, len(p.Limits))
	for i, l := range p.Limits {
		if !p.Quota(i) {
			out = append(out, l)
		}
	}
	return out
}

// maxCost is the largest cost a call of p can have: the smallest rate
// of its limits (a call above it could never start).
func (p Policy) maxCost() int {
	m := 0
	for i, l := range p.Limits {
		if i == 0 || l.Rate < m {
			m = l.Rate
		}
	}
	return m
}

// limitSlots is how many slots a limit's counter divides its window
// into: a count errs on the safe side by at most one slot, so a quota
// gives up at most 1/limitSlots of its window (under 2%).
const limitSlots = 60

// limitSpec is the limits of p as the reserve script reads them
// (parse_limits): "kind:rate:span:slot:id" for each. id names the
// limit's counter in the counts hash by what the limit is, its window
// (and its rank among the limits of that window), never by its place in
// the list: a config edit that adds or takes away another limit leaves
// every other counter counting on (TestQuotaKeepsItsCountAcrossAnEdit),
// as do replicas that read the config before and after it. A quota (kind q) counts
// over its window + guard in slots of 1/limitSlots of it, which may hold
// its oldest calls up to one slot longer than the vendor does. A spaced
// limit is counted too, so that calls of any cost keep it: with a guard
// (kind c) over window + guard less one slot, in slots no longer than the
// guard, so that the count covers every window and never holds back
// calls of one unit at the tick (TestCostsKeepEveryLimit); without a
// guard (kind s) over the window, checked for calls above one unit only.
func limitSpec(p Policy) string {
	var b strings.Builder
	same := map[time.Duration]int{} // limits of each window so far
	for i, l := range p.Limits {
		id := "w" + strconv.FormatInt(l.Window.Microseconds(), 10)
		if k := same[l.Window]; k > 0 {
			id += "." + strconv.Itoa(k)
		}
		same[l.Window]++
		span := (l.Window + p.Guard).Microseconds()
		slot := max((span+limitSlots-1)/limitSlots, 1)
		kind := 'q'
		switch {
		case p.Quota(i):
		case p.Guard > 0:
			kind = 'c'
			slot = min(slot, p.Guard.Microseconds())
			span -= slot
		default:
			kind = 's'
		}
		if i > 0 {
			b.WriteByte(',')
		}
		fmt.Fprintf(&b, "%c:%d:%d:%d:%s", kind, l.Rate, span, slot, id)
	}
	return b.String()
}

// Policy says how one bucket is shaped. The zero values of the optional
// fields select the documented defaults.
type Policy struct {
	// Limits are the limits the vendor enforces; every one of them holds.
	// Limits[0] is the primary limit, the one adaptation lowers.
	Limits []Limit
	// Burst is how many calls start together on one tick,
	// 1 <= Burst <= every limit's Rate. Default 1.
	Burst int
	// Guard widens every window when the spacing is computed, so that a
	// call that starts late or meets network jitter still lands in the
	// right vendor window. Unset (0, without NoGuard), the guard follows
	// what this process measures (MeasureGuard, from DefaultGuard until
	// enough calls were seen); set, it is fixed. 429s may widen either.
	// Set NoGuard to use no margin at all.
	Guard   time.Duration
	NoGuard bool
	// MeasureGuard makes the guard follow what this process measures: how
	// late calls start after their tick and the spread of round trips to
	// the vendor (see Adapt), so a quiet host gets close to the full rate
	// and a jittery network widens the spacing before the vendor has to
	// refuse a call. Its tolerance is the one that costs the fewest calls:
	// a call that wakes later than it gives its tick up and takes the next
	// tick its process holds (the newest caller asks again), so a host
	// that turns busy costs ticks, not the order of a lane. It is what an
	// unset Guard selects; Guard, when set, is the guard until enough
	// calls were measured.
	MeasureGuard bool
	// Tolerance is how late a caller may start after its tick; a caller
	// that wakes later gives the tick up and asks again. It must leave room
	// for network jitter inside Guard. Default max(3/4 of Guard, 1ms).
	Tolerance time.Duration
	// Horizon is how far ahead of Redis time a tick may be reserved. It
	// bounds the silence that follows a loss of the gate's state in Redis
	// (Horizon plus one interval), and callers beyond it poll. Default 1s.
	Horizon time.Duration
	// MaxInFlight caps concurrent calls across all replicas; 0 means no cap.
	MaxInFlight int
	// LeaseTTL is how long an in-flight slot is held after its tick when
	// its holder never releases it (a crash). Default 1m.
	LeaseTTL time.Duration
	// Adapt tunes learning from 429s that carry no limit.
	Adapt Adapt
	// StrictSpacing says the vendor refuses a call that comes closer to
	// the one before than its spacing (window / rate), as nginx
	// limit_req without burst does. Calls are then spaced by their actual
	// starts (a late start moves the next one; see startLua), the guard
	// unless set is Adapt.MaxMargin of the window and the tolerance
	// Adapt.Tolerance, and refusals widen the margin to its cap before
	// they lower the rate.
	StrictSpacing bool
	// Warmup, when set, ramps the primary limit's rate from WarmupFrom to
	// Rate over Warmup whenever the bucket starts after being idle for
	// longer than its window (a first call, a worker start after a
	// stop, the end of a pause longer than the window), for vendors and
	// downstream systems that punish cold bursts. The ramp only widens
	// the spacing: every limit holds throughout.
	Warmup time.Duration
	// WarmupFrom is the rate the ramp starts at, in calls per primary
	// window; default a quarter of Rate.
	WarmupFrom float64
}

// Errors Policy.Validate wraps, with what to fix.
var (
	errNoLimits    = errors.New("shaper: a policy needs at least one limit")
	errBadLimit    = errors.New("shaper: invalid limit")
	errBurstOver   = errors.New("shaper: burst exceeds a limit's rate")
	errBadDuration = errors.New("shaper: invalid duration")
)

// Validate reports the first reason the policy cannot be enforced.
func (p Policy) Validate() error {
	if p.Burst < 0 || p.Guard < 0 || p.Tolerance < 0 || p.Horizon < 0 || p.LeaseTTL < 0 || p.MaxInFlight < 0 || p.Warmup < 0 || p.WarmupFrom < 0 {
		return fmt.Errorf("%w: burst, guard, tolerance, horizon, lease TTL, max in flight, warmup and warmup_from must not be negative", errBadDuration)
	}
	if len(p.Limits) == 0 {
		return errNoLimits
	}
	if r := p.Limits[0].Rate; p.WarmupFrom > float64(r) {
		return fmt.Errorf("%w: warmup_from %v is above the rate %d: a warm-up ramps up to the rate", errBadLimit, p.WarmupFrom, r)
	}
	p = p.withDefaults()
	for i, l := range p.Limits {
		if l.Rate < 1 {
			return fmt.Errorf("%w: limit %d rate %d: a rate must be at least 1", errBadLimit, i, l.Rate)
		}
		if l.Window <= 0 {
			return fmt.Errorf("%w: limit %d window %s: a window must be positive", errBadLimit, i, l.Window)
		}
		if p.Burst > l.Rate {
			return fmt.Errorf("%w: burst %d > rate %d per %s: releasing %d calls at once would overrun the vendor's fixed window; use burst <= %d",
				errBurstOver, p.Burst, l.Rate, l.Window, p.Burst, l.Rate)
		}
		if p.Guard >= l.Window {
			return fmt.Errorf("%w: guard %s must be shorter than the window %s", errBadDuration, p.Guard, l.Window)
		}
	}
	return nil
}

// withDefaults returns p with every unset optional field at its default.
func (p Policy) withDefaults() Policy {
	if p.Burst == 0 {
		p.Burst = DefaultBurst
	}
	switch {
	case p.Guard == 0 && !p.NoGuard && p.StrictSpacing && len(p.Limits) > 0:
		// A vendor that enforces spacing refuses a call that reaches it
		// less than window/rate after the one before: the margin its
		// calls need is per call, and the learned margin's cap is where
		// its refusals would take it.
		p.Guard = strictGuard(p)
	case p.Guard == 0 && !p.NoGuard:
		p.Guard, p.MeasureGuard = DefaultGuard, true
	}
	switch {
	case p.Tolerance == 0 && p.StrictSpacing:
		p.Tolerance = p.Adapt.withDefaults().Tolerance // what a margin lesson sets
	case p.Tolerance == 0:
		p.Tolerance = max(p.Guard*3/4, minTolerance)
	}
	if p.Horizon == 0 {
		p.Horizon = DefaultHorizon
	}
	if p.LeaseTTL == 0 {
		p.LeaseTTL = defaultLeaseTTL
	}
	if p.Warmup > 0 && p.WarmupFrom == 0 && len(p.Limits) > 0 {
		p.WarmupFrom = float64(p.Limits[0].Rate) / 4
	}
	return p
}

// strictGuard is the guard of a policy with StrictSpacing and no guard
// set: Adapt.MaxMargin of the primary window, rounded up to a
// millisecond.
func strictGuard(p Policy) time.Duration {
	g := time.Duration(p.Adapt.withDefaults().MaxMargin * float64(p.Limits[0].Window))
	return (g + time.Millisecond - 1).Truncate(time.Millisecond)
}

// Tick returns the schedule that keeps every limit of p: one tick
// every interval, up to burst calls per tick. See tickFor for the rule.
func (p Policy) Tick() (interval time.Duration, burst int) {
	p = p.withDefaults()
	return tickFor(p.spaced(), p.Burst, p.Guard, 0)
}

// withRate returns the schedule of p with its primary limit lowered to rate
// calls per primary window (never raised above the configured rate).
//
// A lowered rate only ever widens the configured tick: the reserve script
// spaces by the configured tick of every live replica (it is what their
// heartbeats carry) and by the lowered primary limit, so the result is the
// wider of the two. TestLuaTickMatchesGo keeps this and the script equal.
func (p Policy) withRate(rate float64) (interval time.Duration, burst int) {
	p = p.withDefaults()
	configured, _ := tickFor(p.spaced(), p.Burst, p.Guard, 0)
	interval, burst = tickFor(p.spaced(), p.Burst, p.Guard, rate)
	return max(interval, configured), burst
}

// tickFor computes the tick for limits with the given burst and guard. If
// primary > 0 it replaces the rate of limits[0] when it is lower.
//
// For a limit of r calls per w, a burst of b calls per tick may use
// k = floor(r/b) ticks per window, spaced (w+guard)/k apart: any half-open
// interval of length w then holds at most k ticks, so at most k*b <= r
// calls. A rate below one call per window (adaptation only) spaces single
// calls (w+guard)/r apart. The tick is the widest spacing over all limits,
// rounded up to the microsecond, and the burst the smallest allowed.
func tickFor(limits []Limit, burst int, guard time.Duration, primary float64) (time.Duration, int) {
	if burst < 1 {
		burst = 1
	}
	rates := make([]float64, len(limits))
	for i, l := range limits {
		rates[i] = float64(l.Rate)
	}
	if primary > 0 && len(rates) > 0 && primary < rates[0] {
		rates[0] = primary
	}
	for _, r := range rates {
		if r >= 1 && float64(burst) > math.Floor(r) {
			burst = int(math.Floor(r))
		} else if r < 1 {
			burst = 1
		}
	}
	var widest float64 // microseconds
	for i, l := range limits {
		k := rates[i] / float64(burst)
		if k >= 1 {
			k = math.Floor(k)
		}
		span := float64((l.Window + guard).Microseconds())
		if iv := span / k; iv > widest {
			widest = iv
		}
	}
	return time.Duration(math.Ceil(widest)) * time.Microsecond, burst
}

// EffectiveRate is the number of calls per window of the primary limit
// that a tick of interval with burst calls starts.
func EffectiveRate(interval time.Duration, burst int, window time.Duration) float64 {
	if interval <= 0 {
		return 0
	}
	return float64(burst) * float64(window) / float64(interval)
}
