package shaper

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"fmt"
	"time"

	"github.com/redis/go-redis/v9"
)

// deferReason says why a reservation was not granted.
type deferReason int

const (
	granted       deferReason = iota // not deferred
	beyondHorizon                    // the next tick is further than the horizon: backlog or pause
	inFlightFull                     // max_in_flight slots are all taken
	stateReset                       // the state was missing (first use or lost): waiting out the horizon
)

// reservation is the answer of one round trip to the gate.
type reservation struct {
	// ok is true when a tick was granted; the call may start wait after
	// the reservation, and no later than Tolerance after that.
	ok bool
	// wait is the time until the tick when ok, else how long to wait
	// before asking again.
	wait   time.Duration
	reason deferReason
	lease  string
}

// replicaLive is how long a replica's heartbeat counts: a replica not
// heard from for longer no longer shapes the bucket.
const replicaLive = 5 * time.Second

// reserveScript reserves the next tick of one bucket.
//
// KEYS[1] gate hash, KEYS[2] control hash, KEYS[3] stats hash,
// KEYS[4] in-flight sorted set, KEYS[5] replicas hash (see keys.go).
// ARGV[1] Redis time override (µs; 0: TIME), see nowLua
// ARGV[2] tick interval (µs) of the caller's policy
// ARGV[3] burst of the caller's policy
// ARGV[4] horizon (µs): no tick is reserved further ahead than this
// ARGV[5] max in flight (0: no cap)
// ARGV[6] lease TTL (µs), counted from the tick
// ARGV[7] lease id ("" without a cap)
// ARGV[8] the primary limit's window + guard (µs), to space a lowered rate
// ARGV[9] replica liveness (µs): heartbeats older than this do not count
// Returns {granted (0|1), wait (µs), reason}: when granted, wait is the time
// from Redis now to the tick; when not, the time before asking again and
// reason says why (see deferReason).
var reserveScript = redis.NewScript(nowLua + minuteCounterLua + `
local now = now_us()
local interval = tonumber(ARGV[2])
local burst = tonumber(ARGV[3])
local horizon = tonumber(ARGV[4])
local maxif = tonumber(ARGV[5])

-- While live replicas disagree on the config (a rolling edit), the most
-- conservative tick wins.
local peers = redis.call('HGETALL', KEYS[5])
for i = 2, #peers, 2 do
  local iv, b, seen = string.match(peers[i], '^(%d+)|(%d+)|(%d+)$')
  if iv and now - tonumber(seen) < tonumber(ARGV[9]) then
    if tonumber(iv) > interval then interval = tonumber(iv) end
    if tonumber(b) < burst then burst = tonumber(b) end
  end
end

local ctl = redis.call('HMGET', KEYS[2], 'paused_until', 'rate')
local paused = tonumber(ctl[1]) or 0
local rate = tonumber(ctl[2])
if rate and rate > 0 then
  -- The primary limit lowered to rate calls per window: the same rule
  -- as tickFor in policy.go (TestLuaTickMatchesGo keeps them equal).
  local b = math.max(1, math.min(burst, math.floor(rate)))
  local k = rate / b
  if k >= 1 then k = math.floor(k) end
  local iv = math.ceil(tonumber(ARGV[8]) / k)
  if iv > interval then interval = iv end
  burst = b
end

local st = redis.call('HMGET', KEYS[1], 'last', 'n', 'defer_at')
local last = tonumber(st[1])
local n = tonumber(st[2]) or 0
local deferred = 1
if last == nil then
  -- First use, or the state was lost with ticks still reserved; those
  -- reach at most now + horizon, so the next tick comes an interval later.
  last = now + horizon
  n = burst
  deferred = 3
  redis.call('HSET', KEYS[1], 'last', string.format('%d', last), 'n', n)
  redis.call('HINCRBY', KEYS[3], 'resets', 1)
end
local tick
if last >= now and last >= paused and n < burst then
  tick = last
  n = n + 1
else
  tick = math.max(now, last + interval, paused)
  n = 1
end
if tick - now > horizon then
  -- Give each deferred caller its own moment to come back, one tick
  -- apart, so that a crowd beyond the horizon polls once per tick in
  -- the order it arrived, not all at once.
  local at = math.max(tick - horizon, (tonumber(st[3]) or 0) + math.floor(interval / burst))
  redis.call('HSET', KEYS[1], 'defer_at', string.format('%d', at))
  redis.call('HINCRBY', KEYS[3], 'deferred', 1)
  return {0, at - now, deferred}
end
if maxif > 0 then
  redis.call('ZREMRANGEBYSCORE', KEYS[4], '-inf', string.format('%d', now))
  if redis.call('ZCARD', KEYS[4]) >= maxif then
    redis.call('HINCRBY', KEYS[3], 'deferred', 1)
    return {0, math.max(interval, 5000), 2}
  end
  redis.call('ZADD', KEYS[4], string.format('%d', tick + tonumber(ARGV[6])), ARGV[7])
end
redis.call('HSET', KEYS[1], 'last', string.format('%d', tick), 'n', n)
count(KEYS[3], 'granted', now)
return {1, tick - now, 0}
`)

// reserve asks for the next tick in one Redis round trip. Being deferred
// is not an error: errors mean Redis failed.
func (b *Bucket) reserve(ctx context.Context) (reservation, error) {
	var lease string
	if b.policy.MaxInFlight > 0 {
		lease = newLeaseID()
	}
	res, err := reserveScript.Run(ctx, b.gate.rdb, b.keys.all(), b.gate.redisNow(),
		b.interval.Microseconds(), b.burst, b.policy.Horizon.Microseconds(),
		b.policy.MaxInFlight, b.policy.LeaseTTL.Microseconds(), lease,
		(b.policy.Limits[0].Window + b.policy.Guard).Microseconds(), replicaLive.Microseconds()).Int64Slice()
	if err != nil {
		return reservation{}, fmt.Errorf("shaper: reserve a tick for %q: %w", b.name, err)
	}
	if len(res) != 3 {
		return reservation{}, fmt.Errorf("shaper: reserve a tick for %q: unexpected reply %v", b.name, res)
	}
	r := reservation{ok: res[0] == 1, wait: time.Duration(res[1]) * time.Microsecond, reason: deferReason(res[2])}
	if r.ok {
		r.lease = lease
	}
	return r, nil
}

// giveUpScript frees an in-flight lease and counts a tick given up.
//
// KEYS[1] in-flight sorted set, KEYS[2] stats hash.
// ARGV[1] Redis time override (unused), ARGV[2] lease id ("" for none),
// ARGV[3] the counter to add one to ("late", "dropped") or "".
// Returns 0.
var giveUpScript = redis.NewScript(`
if ARGV[2] ~= '' then redis.call('ZREM', KEYS[1], ARGV[2]) end
if ARGV[3] ~= '' then redis.call('HINCRBY', KEYS[2], ARGV[3], 1) end
return 0
`)

// Why a tick was given up, for the stats.
const (
	gaveUpLate    = "late"
	gaveUpDropped = "dropped"
)

// giveUp frees lease (if any) and counts why its tick went unused (if
// counter is set).
func (b *Bucket) giveUp(ctx context.Context, lease string, counter string) error {
	if lease == "" && counter == "" {
		return nil
	}
	if err := giveUpScript.Run(ctx, b.gate.rdb, []string{b.keys.inFlight, b.keys.stats}, 0, lease, counter).Err(); err != nil {
		return fmt.Errorf("shaper: free a lease of %q: %w", b.name, err)
	}
	return nil
}

func newLeaseID() string {
	var buf [12]byte
	_, _ = rand.Read(buf[:])
	return hex.EncodeToString(buf[:])
}
