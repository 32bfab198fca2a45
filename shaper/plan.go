package shaper

import (
	"context"
	"fmt"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/shaper-dev/shaper/internal/gatehook"
	"github.com/shaper-dev/shaper/internal/redisonce"
)

// planScript plans n calls of a bucket: the moments, from Redis now, at
// which they can expect their ticks, one pace apart after the calls
// planned before. It reserves no tick: callers still Acquire theirs; the
// plan only says when to come and ask, so that a long backlog waits in
// the job queue's schedule rather than in front of other buckets' calls.
//
// KEYS[1] gate hash, KEYS[2] control hash, KEYS[3] the group's total hash,
// KEYS[4] the group's expiry set, KEYS[5] the group's plans set.
// ARGV[1] Redis time override (µs; 0: TIME), ARGV[2] n, ARGV[3] pace
// (µs per call at the configured rate), ARGV[4] the primary limit's
// window + guard (µs), ARGV[5] burst, ARGV[6] keep (µs), ARGV[7] the
// bucket's name in its group, ARGV[8] total window + guard (µs; 0: no
// total), ARGV[9] the bucket's own rate per total window.
// Returns {first (µs from now), pace (µs)}.
var planScript = redis.NewScript(nowLua + spacingLua + extendLua + lineFieldLua + totalStateLua + `
local now = now_us()
local n = tonumber(ARGV[2])
local pace = tonumber(ARGV[3])
local rate = tonumber(redis.call('HGET', KEYS[2], 'rate'))
if rate and rate > 0 then
  local iv, b = spacing(rate, tonumber(ARGV[5]), tonumber(ARGV[4]))
  pace = math.max(pace, math.floor(iv / b))
end
if tonumber(ARGV[8]) > 0 then
  local ts = {}
  read_total(redis.call('HGET', KEYS[3], 'tl'), ts)
  local share = ts.share
  if share and share > 0 and share < tonumber(ARGV[9]) then
    pace = math.max(pace, math.ceil(tonumber(ARGV[8]) / share))
  end
end
local plan, line = unpack(redis.call('HMGET', KEYS[1], 'plan', 'line'))
local last = read_line(line)
local first = math.max(now, tonumber(plan) or 0, (last or 0) + pace)
local untilv = first + n * pace
redis.call('HSET', KEYS[1], 'plan', string.format('%d', untilv))
extend(KEYS[1], untilv + tonumber(ARGV[6]), now)
redis.call('ZADD', KEYS[4], 'GT', untilv + tonumber(ARGV[6]), ARGV[7])
extend(KEYS[4], untilv + tonumber(ARGV[6]), now)
redis.call('ZREMRANGEBYSCORE', KEYS[5], '-inf', now)
redis.call('ZADD', KEYS[5], 'GT', untilv, ARGV[7])
extend(KEYS[5], untilv, now)
return {first - now, pace}
`)

// plan says when n calls of the bucket, queued now behind those planned
// before, can expect their ticks: the first after first, then one every
// pace (the bucket's effective rate, or its fair share of its group's
// total). A queue uses it to hold a backlog in its schedule; the calls
// still Acquire their ticks, which is what keeps the limits.
func (b *Bucket) plan(ctx context.Context, n int) (first, pace time.Duration, err error) {
	if n < 1 {
		return 0, 0, nil
	}
	var tspan int64
	var own float64
	if t := b.total; t != nil {
		tspan = t.span.Microseconds()
		own = EffectiveRate(b.interval, b.burst, t.window)
	}
	res, err := redisonce.Run(ctx, b.gate.rdb, planScript, []string{b.keys.gate, b.keys.control, b.keys.total, b.keys.expiry, b.keys.plans},
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

// backlogs returns the group's n buckets whose planned calls reach
// furthest ahead, longest first, and how many of its buckets have calls
// planned ahead: the accounts with a backlog, read in one round trip.
func (grp *Group) backlogs(ctx context.Context, n int) ([]gatehook.Backlog, int64, error) {
	keys := keysOf(grp.gate.prefix, grp.name, "")
	res, err := backlogsScript.Run(ctx, grp.gate.rdb, []string{keys.plans}, grp.gate.redisNow(), n).Slice()
	if err != nil {
		return nil, 0, fmt.Errorf("shaper: backlogs of %q: %w", grp.name, err)
	}
	if len(res) < 1 {
		return nil, 0, fmt.Errorf("shaper: backlogs of %q: unexpected reply %v", grp.name, res)
	}
	count, _ := res[0].(int64)
	var out []gatehook.Backlog
	for i := 1; i+1 < len(res); i += 2 {
		name, _ := res[i].(string)
		ahead, _ := res[i+1].(int64)
		out = append(out, gatehook.Backlog{Bucket: name, Ahead: time.Duration(ahead) * time.Microsecond})
	}
	return out, count, nil
}

// backlogsScript reads a group's plans set.
//
// KEYS[1] plans set. ARGV[1] Redis time override (µs; 0: TIME), ARGV[2] n.
// Returns {count, bucket, µs ahead, bucket, µs ahead, ...}: the number of
// buckets with calls planned ahead, then the n furthest ahead.
var backlogsScript = redis.NewScript(nowLua + `
local now = now_us()
local out = {redis.call('ZCOUNT', KEYS[1], '(' .. string.format('%d', now), '+inf')}
local n = tonumber(ARGV[2])
if n > 0 then
  local top = redis.call('ZREVRANGEBYSCORE', KEYS[1], '+inf', '(' .. string.format('%d', now), 'WITHSCORES', 'LIMIT', 0, n)
  for i = 1, #top, 2 do
    out[#out + 1] = top[i]
    out[#out + 1] = tonumber(top[i + 1]) - now
  end
end
return out
`)
