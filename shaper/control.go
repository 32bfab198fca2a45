package shaper

import (
	"context"
	"fmt"
	"math"
	"strconv"

	"github.com/redis/go-redis/v9"

	"github.com/shaper-dev/shaper/internal/redisonce"
)

// Control is the adaptation side of a bucket: what the vendor says (429s,
// Retry-After, rate-limit headers) pauses the bucket or changes its
// effective rate for every replica, and replicas tell each other their
// configured tick. Workers use it; callers need only Acquire.
type Control struct{ b *Bucket }

// Control returns the bucket's adaptation side.
func (b *Bucket) Control() *Control { return &Control{b: b} }

// configured is the primary limit's configured rate.
func (c *Control) configured() float64 { return float64(c.b.policy.Limits[0].Rate) }

// overrideRate lowers the bucket's effective rate to rate calls per window
// of its primary limit, for every replica, and records why (source
// "set"). A rate above the configured one is capped to it. Fractions below
// 1 are allowed (0.5 is one call every two windows). Rates set here are
// not changed by raiseRate. Tests use it to stand for what adaptation sets.
func (c *Control) overrideRate(ctx context.Context, rate float64, reason string) error {
	return c.setRate(ctx, rate, reason, "set")
}

func (c *Control) setRate(ctx context.Context, rate float64, reason, source string) error {
	b := c.b
	if !(rate > 0) || math.IsInf(rate, 0) {
		return fmt.Errorf("shaper: set the rate of %q to %v: the rate must be positive", b.name, rate)
	}
	rate = min(rate, c.configured())
	err := redisonce.Run(ctx, b.gate.rdb, setRateScript, []string{b.keys.control, b.keys.gate}, b.gate.redisNow(),
		strconv.FormatFloat(rate, 'f', -1, 64), reason, source, b.keep.Microseconds()).Err()
	if err != nil {
		return fmt.Errorf("shaper: set the rate of %q: %w", b.name, err)
	}
	return nil
}

// setRateScript sets the effective rate.
//
// KEYS[1] control hash, KEYS[2] gate hash.
// ARGV[1] Redis time override (µs; 0: TIME), ARGV[2] rate, ARGV[3]
// reason, ARGV[4] source, ARGV[5] keep (µs): the hash lives at least this
// long, and as long as the gate hash (see gate_kept). Returns 0.
var setRateScript = redis.NewScript(nowLua + extendLua + adaptedLua + `
local now = now_us()
adapted(KEYS[2])
redis.call('HSET', KEYS[1], 'rate', ARGV[2], 'rate_reason', ARGV[3], 'rate_source', ARGV[4])
extend(KEYS[1], math.max(now + tonumber(ARGV[5]), gate_kept(KEYS[2], now)), now)
return 0
`)

// clearRate restores the configured rate.
func (c *Control) clearRate(ctx context.Context) error {
	b := c.b
	if err := b.gate.rdb.HDel(ctx, b.keys.control, "rate", "rate_reason", "rate_source", "hi", "lo").Err(); err != nil {
		return fmt.Errorf("shaper: clear the rate of %q: %w", b.name, err)
	}
	return nil
}

// Announce applies a limit the vendor announced (rate-limit headers), as
// calls per window of the primary limit: below the configured rate it
// becomes the effective rate; at or above it, an earlier announcement is
// cleared. Learned rates are replaced.
func (c *Control) Announce(ctx context.Context, rate float64, reason string) error {
	if rate < c.configured() {
		return c.setRate(ctx, rate, reason, "announced")
	}
	src, err := c.b.gate.rdb.HGet(ctx, c.b.keys.control, "rate_source").Result()
	if err != nil && err != redis.Nil {
		return fmt.Errorf("shaper: announce a rate for %q: %w", c.b.name, err)
	}
	if src == "announced" {
		return c.clearRate(ctx)
	}
	return nil
}

// lowerScript records a rate-limited answer and lowers the effective rate
// multiplicatively, at most once per cooldown, never below the last rate
// that stayed quiet (lo) when the failure came above it.
//
// KEYS[1] control hash, KEYS[2] gate hash.
// ARGV[1] Redis time override (µs; 0: TIME), ARGV[2] configured rate,
// ARGV[3] decrease factor (0..1), ARGV[4] floor rate, ARGV[5] cooldown
// (µs), ARGV[6] reason, ARGV[7] keep (µs): the hash lives at least this
// long.
// Returns the effective rate after the call, as a string. A failure at or
// below the old safe rate (lo) means the limit moved: lo is cleared.
var lowerScript = redis.NewScript(nowLua + extendLua + adaptedLua + `
local now = now_us()
extend(KEYS[1], math.max(now + tonumber(ARGV[7]), gate_kept(KEYS[2], now)), now)
local rate, last_decrease, lo = unpack(redis.call('HMGET', KEYS[1], 'rate', 'last_decrease', 'lo'))
redis.call('HSET', KEYS[1], 'last_throttle', string.format('%d', now))
local cur = tonumber(rate) or tonumber(ARGV[2])
if now - (tonumber(last_decrease) or 0) < tonumber(ARGV[5]) then
  return tostring(cur)
end
local new = math.max(cur * tonumber(ARGV[3]), tonumber(ARGV[4]))
adapted(KEYS[2])
lo = tonumber(lo)
if lo and lo < cur and lo > new then
  new = lo
elseif lo then
  redis.call('HDEL', KEYS[1], 'lo')
end
redis.call('HSET', KEYS[1], 'rate', tostring(new), 'hi', tostring(cur), 'last_change', string.format('%d', now),
  'last_decrease', string.format('%d', now), 'rate_reason', ARGV[6], 'rate_source', 'learned')
return tostring(new)
`)

// lowerRate records that the vendor answered rate-limited without saying
// its limit, and lowers the effective rate for every replica (at most once
// per window), multiplicatively: the rule Refused applies as a rate
// lesson. It returns the effective rate now in force.
func (c *Control) lowerRate(ctx context.Context, reason string) (float64, error) {
	b := c.b
	a := b.policy.Adapt.withDefaults()
	cooldown := b.policy.Limits[0].Window + b.policy.Guard
	s, err := redisonce.Run(ctx, b.gate.rdb, lowerScript, []string{b.keys.control, b.keys.gate}, b.gate.redisNow(), c.configured(), a.Decrease,
		c.configured()*a.Floor, cooldown.Microseconds(), reason, b.keep.Microseconds()).Text()
	if err != nil {
		return 0, fmt.Errorf("shaper: lower the rate of %q: %w", b.name, err)
	}
	return strconv.ParseFloat(s, 64)
}

// raiseScript raises a learned effective rate one step after a quiet
// period (see raiseLua).
//
// KEYS[1] control hash. ARGV[1] Redis time override (µs; 0: TIME), then
// the fields of raiseArgs. Returns "" when nothing changed, else the new
// rate ("0" when cleared).
var raiseScript = redis.NewScript(nowLua + raiseLua + `
local r = raise_rate(KEYS[1], now_us(), {cfg = tonumber(ARGV[2]), step = tonumber(ARGV[3]), quiet = tonumber(ARGV[4]),
  probe = tonumber(ARGV[5]), recheck = tonumber(ARGV[6]), ceiling = tonumber(ARGV[7])})
if r == nil then return '' end
return tostring(r)
`)

// raiseArgs is how a learned rate recovers (see raiseLua), from Adapt.
type raiseArgs struct {
	Cfg     float64 // the configured rate (calls per primary window)
	Step    float64 // the additive step (Adapt.Increase of the configured rate)
	Quiet   int64   // µs without a refusal before a step (Adapt.Quiet)
	Probe   int64   // µs after which the rate that failed is forgotten (Adapt.Probe)
	Recheck int64   // µs without a refusal before a step toward est_hi (Adapt.Recheck windows)
	Ceiling float64 // the share of the rate that failed that the steps stay below (Adapt.Ceiling)
}

func (b *Bucket) raiseArgs() raiseArgs {
	a := b.policy.Adapt.withDefaults()
	cfg := float64(b.policy.Limits[0].Rate)
	return raiseArgs{Cfg: cfg, Step: cfg * a.Increase, Quiet: a.Quiet.Microseconds(), Probe: a.Probe.Microseconds(),
		Recheck: int64(a.Recheck) * b.policy.Limits[0].Window.Microseconds(), Ceiling: a.Ceiling}
}

// raiseLua defines raise_rate(key, now, r): one step up of a learned rate
// in control hash key, with r the fields of raiseArgs (cfg, step, quiet,
// probe, recheck, ceiling), returning the new rate (0: back to the
// configured rate) or nil when nothing changed. Below the largest limit
// consistent with what the vendor did ('est_hi', written by a rate
// lesson), the step goes halfway to it after recheck without a refusal (a
// refusal there narrows the range: see Adapt.judge); above it, one
// additive step after each quiet period, at most ceiling of the rate that
// failed ('hi') until that failure is probe old, and none at all after.
// The reserve script runs it too, so a learned rate recovers with the
// bucket's own traffic, without a process polling it.
const raiseLua = `
local function raise_rate(key, now, r)
  local rate, last_change, last_throttle, hi, rate_source, est_hi = unpack(redis.call('HMGET', key,
    'rate', 'last_change', 'last_throttle', 'hi', 'rate_source', 'est_hi'))
  local cur = tonumber(rate)
  if not cur or rate_source ~= 'learned' then return nil end
  local sinceThrottle = now - (tonumber(last_throttle) or 0)
  local est = tonumber(est_hi)
  if est and est > cur then
    if now - (tonumber(last_change) or 0) < r.recheck or sinceThrottle < r.recheck then return nil end
    local new = math.min(math.max(cur + r.step, (cur + est) / 2), est)
    if est - new < 1 then new = est end
    if new >= est then redis.call('HDEL', key, 'est_hi') end
    redis.call('HSET', key, 'rate', tostring(new), 'lo', tostring(cur), 'last_change', string.format('%d', now),
      'probe_at', string.format('%d', now),
      'rate_reason', string.format('probing toward %.4g, the largest limit consistent with what the vendor did', est))
    return new
  end
  if now - (tonumber(last_change) or 0) < r.quiet or sinceThrottle < r.quiet then return nil end
  local new = cur + r.step
  if sinceThrottle < r.probe then new = math.min(new, (tonumber(hi) or r.cfg) * r.ceiling) end
  if new <= cur then
    redis.call('HSET', key, 'lo', tostring(cur), 'last_change', string.format('%d', now))
    return nil
  end
  if new >= r.cfg then
    redis.call('HDEL', key, 'rate', 'rate_reason', 'rate_source', 'hi', 'lo')
    redis.call('HSET', key, 'last_change', string.format('%d', now))
    return 0
  end
  redis.call('HSET', key, 'rate', tostring(new), 'lo', tostring(cur), 'last_change', string.format('%d', now),
    'rate_reason', 'recovering after a quiet period')
  return new
end
`

// raiseRate raises a learned effective rate by one step when the vendor
// has been quiet for a quiet period, as the reserve script does with the
// bucket's own traffic. Replicas may all call it: a step happens once per
// period. It reports the new rate (0: back to the configured one) and
// whether anything changed.
func (c *Control) raiseRate(ctx context.Context) (float64, bool, error) {
	b := c.b
	ra := b.raiseArgs()
	s, err := redisonce.Run(ctx, b.gate.rdb, raiseScript, []string{b.keys.control}, b.gate.redisNow(), ra.Cfg, ra.Step, ra.Quiet, ra.Probe, ra.Recheck, ra.Ceiling).Text()
	if err != nil {
		return 0, false, fmt.Errorf("shaper: raise the rate of %q: %w", b.name, err)
	}
	if s == "" {
		return 0, false, nil
	}
	r, err := strconv.ParseFloat(s, 64)
	if err != nil {
		return 0, false, fmt.Errorf("shaper: raise the rate of %q: unexpected reply %q", b.name, s)
	}
	return r, true, nil
}

// countScript counts a rate-limited answer.
//
// KEYS[1] stats hash. ARGV[1] Redis time override (µs; 0: TIME).
// Returns 0.
var countScript = redis.NewScript(nowLua + minuteCounterLua + `
count(KEYS[1], 'rate_limited', now_us())
return 0
`)

// CountRateLimited counts one rate-limited answer for the stats.
func (c *Control) CountRateLimited(ctx context.Context) error {
	b := c.b
	if err := redisonce.Run(ctx, b.gate.rdb, countScript, []string{b.keys.stats}, b.gate.redisNow()).Err(); err != nil {
		return fmt.Errorf("shaper: count a rate-limited answer for %q: %w", b.name, err)
	}
	return nil
}
