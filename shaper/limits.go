package shaper

import (
	"context"
	"fmt"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/shaper-dev/shaper/internal/redisonce"
)

// LimitUse is what one limit of a bucket has used of its window, read
// off its counter (see countersLua).
type LimitUse struct {
	Limit Limit
	// Quota is true for a quota (Policy.Quota), false for a spaced limit.
	Quota bool
	// Used is the units counted in the last window (on the safe side: up
	// to one slot, 1/60 of the window, longer), Left what else fits.
	Used, Left int64
	// NextIn is how long until a call of one unit fits (0: now).
	NextIn time.Duration
}

// limitsScript reads a bucket's counters.
//
// KEYS[1] the counters hash. ARGV[1] Redis time override (µs; 0: TIME),
// ARGV[2] the limits (limitSpec).
// Returns {used, next (µs from now), used, next, ...}, one pair a limit.
var limitsScript = redis.NewScript(fmtLua + nowLua + extendLua + countersLua + counterAdoptLua + `
local k_counts = KEYS[1]
local a_now = tonumber(ARGV[1])
local a_limits = ARGV[2]
local now = now_from(a_now)
local out = {}
for _, c in ipairs(parse_limits(a_limits)) do
  counter_load(k_counts, c, now, false)
  out[#out + 1] = c.sum
  out[#out + 1] = math.max(counter_free_at(k_counts, c, 1, now) - now, 0)
end
return out
`)

// limitUse reads what each limit of the bucket has used, in the order of
// its policy's Limits, in one round trip.
func (b *Bucket) limitUse(ctx context.Context) ([]LimitUse, error) {
	return readLimits(ctx, b.gate, b.name, b.keys.counts, b.policy, b.limits)
}

// totalLimitUse reads what each limit of the bucket's group total has used
// (nil without a total).
func (b *Bucket) totalLimitUse(ctx context.Context) ([]LimitUse, error) {
	if b.total == nil {
		return nil, nil
	}
	return readLimits(ctx, b.gate, b.name, b.keys.totalCounts, b.total.policy, b.total.limits)
}

// readLimits reads the counters in key of policy p, whose limitSpec is
// spec.
func readLimits(ctx context.Context, g *Gate, name, key string, p Policy, spec string) ([]LimitUse, error) {
	res, err := limitsScript.Run(ctx, g.rdb, []string{key}, g.redisNow(), spec).Int64Slice()
	if err != nil {
		return nil, fmt.Errorf("shaper: read the limits of %q: %w", name, err)
	}
	if len(res) != 2*len(p.Limits) {
		return nil, fmt.Errorf("shaper: read the limits of %q: unexpected reply %v", name, res)
	}
	out := make([]LimitUse, len(p.Limits))
	for i, l := range p.Limits {
		used := min(res[2*i], int64(l.Rate))
		out[i] = LimitUse{Limit: l, Quota: p.Quota(i), Used: used, Left: int64(l.Rate) - used,
			NextIn: time.Duration(res[2*i+1]) * time.Microsecond}
	}
	return out, nil
}

// countUsedScript raises a counter to what the vendor says was used.
//
// KEYS[1] the counters hash. ARGV[1] Redis time override (µs; 0: TIME),
// ARGV[2] the limits (limitSpec), ARGV[3] the limit (1-based), ARGV[4]
// the units the vendor says were used in its window, ARGV[5] keep (µs).
// Returns the units added (0: the gate's own count was as high). A fill
// (c.fill: what a lost state may have granted, see counter_fill) was a
// guess: the vendor's count replaces it.
var countUsedScript = redis.NewScript(fmtLua + nowLua + extendLua + countersLua + counterAdoptLua + `
local k_counts = KEYS[1]
local a_now = tonumber(ARGV[1])
local a_limits = ARGV[2]
local a_limit = tonumber(ARGV[3])
local a_used = tonumber(ARGV[4])
local a_keep = tonumber(ARGV[5])
local now = now_from(a_now)
local c = parse_limits(a_limits)[a_limit]
if c == nil then return 0 end
counter_load(k_counts, c, now, true)
c.fill = tonumber(redis.call('HGET', k_counts, c.id .. ':fill')) or 0
if c.fill > 0 then
  local j = tonumber(redis.call('HGET', k_counts, c.id .. ':fill_j'))
  if j then
    local left = redis.call('HINCRBY', k_counts, c.id .. ':' .. fmt(j), -c.fill)
    if left <= 0 then redis.call('HDEL', k_counts, c.id .. ':' .. fmt(j)) end
    if j >= c.low then c.sum = c.sum - c.fill end
  end
  redis.call('HDEL', k_counts, c.id .. ':fill', c.id .. ':fill_j')
  redis.call('HSET', k_counts, c.id .. ':sum', c.sum)
end
local add = math.min(a_used, c.rate) - c.sum
if add <= 0 then return 0 end
counter_add(k_counts, c, now, add, a_keep, now)
return add
`)

// CountUsed tells the gate that the vendor says used units of limit i
// of the bucket's policy were spent in its window (its rate less the
// remaining it announced): when that is more than the gate counted, the
// difference (calls made by another app with the same credential) is
// counted now. The gate never counts less than it granted; a count
// assumed after a lost state is replaced by the vendor's. It reports the
// units added.
func (c *Control) CountUsed(ctx context.Context, i, used int) (int, error) {
	b := c.b
	if i < 0 || i >= len(b.policy.Limits) {
		return 0, fmt.Errorf("shaper: count used units of %q: no limit %d", b.name, i)
	}
	n, err := redisonce.Run(ctx, b.gate.rdb, countUsedScript, []string{b.keys.counts}, b.gate.redisNow(), b.limits, i+1, used,
		b.keep.Microseconds()).Int()
	if err != nil {
		return 0, fmt.Errorf("shaper: count used units of %q: %w", b.name, unavailable(ctx, err))
	}
	return n, nil
}
