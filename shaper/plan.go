package shaper

import (
	"context"
	"fmt"
	"time"

	"github.com/redis/go-redis/v9"
)

// planScript plans n calls of a bucket: the moments, from Redis now, at
// which they can expect their ticks, one pace apart after the calls
// planned before. It reserves no tick: callers still Acquire theirs; the
// plan only says when to come and ask, so that a long backlog waits in
// the job queue's schedule rather than in front of other buckets' calls.
//
// KEYS[1] gate hash, KEYS[2] control hash, KEYS[3] the group's total hash,
// KEYS[4] the group's expiry set.
// ARGV[1] Redis time override (µs; 0: TIME), ARGV[2] n, ARGV[3] pace
// (µs per call at the configured rate), ARGV[4] the primary limit's
// window + guard (µs), ARGV[5] burst, ARGV[6] keep (µs), ARGV[7] the
// bucket's name in its group, ARGV[8] total window + guard (µs; 0: no
// total), ARGV[9] the bucket's own rate per total window.
// Returns {first (µs from now), pace (µs)}.
var planScript = redis.NewScript(nowLua + spacingLua + `
local now = now_us()
local n = tonumber(ARGV[2])
local pace = tonumber(ARGV[3])
local rate = tonumber(redis.call('HGET', KEYS[2], 'rate'))
if rate and rate > 0 then
  local iv, b = spacing(rate, tonumber(ARGV[5]), tonumber(ARGV[4]))
  pace = math.max(pace, math.floor(iv / b))
end
if tonumber(ARGV[8]) > 0 then
  local share = tonumber(redis.call('HGET', KEYS[3], 'share'))
  if share and share > 0 and share < tonumber(ARGV[9]) then
    pace = math.max(pace, math.ceil(tonumber(ARGV[8]) / share))
  end
end
local st = redis.call('HMGET', KEYS[1], 'plan', 'last')
local first = math.max(now, tonumber(st[1]) or 0, (tonumber(st[2]) or 0) + pace)
local untilv = first + n * pace
redis.call('HSET', KEYS[1], 'plan', string.format('%d', untilv))
extend(KEYS[1], untilv + tonumber(ARGV[6]), now)
redis.call('ZADD', KEYS[4], 'GT', untilv + tonumber(ARGV[6]), ARGV[7])
extend(KEYS[4], untilv + tonumber(ARGV[6]), now)
return {first - now, pace}
`)

// Plan says when n calls of the bucket, queued now behind those planned
// before, can expect their ticks: the first after first, then one every
// pace (the bucket's effective rate, or its fair share of its group's
// total). A queue uses it to hold a backlog in its schedule; the calls
// still Acquire their ticks, which is what keeps the limits.
func (b *Bucket) Plan(ctx context.Context, n int) (first, pace time.Duration, err error) {
	if n < 1 {
		return 0, 0, nil
	}
	var tspan int64
	var own float64
	if t := b.total; t != nil {
		tspan = t.span.Microseconds()
		own = EffectiveRate(b.interval, b.burst, t.window)
	}
	res, err := planScript.Run(ctx, b.gate.rdb, []string{b.keys.gate, b.keys.control, b.keys.total, b.keys.expiry},
		b.gate.redisNow(), n, (b.interval / time.Duration(b.burst)).Microseconds(),
		(b.policy.Limits[0].Window + b.policy.Guard).Microseconds(), b.burst, b.keep.Microseconds(), b.member, tspan, own).Int64Slice()
	if err != nil {
		return 0, 0, fmt.Errorf("shaper: plan %d calls of %q: %w", n, b.name, err)
	}
	if len(res) != 2 {
		return 0, 0, fmt.Errorf("shaper: plan calls of %q: unexpected reply %v", b.name, res)
	}
	return time.Duration(res[0]) * time.Microsecond, time.Duration(res[1]) * time.Microsecond, nil
}
