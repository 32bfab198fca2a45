package shaper

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"fmt"
	"strconv"
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
	// tick is the granted tick in Redis time (µs), for the ticks list.
	tick int64
	// tolerance is a learned tolerance tighter than the policy's (0: none).
	tolerance time.Duration
}

// replicaLive is how long a replica's configured tick counts: a replica
// that has not been granted a tick of the bucket for longer no longer
// shapes it.
const replicaLive = 5 * time.Second

// maxRing bounds the ring of a group total's slots (bits): totals whose
// horizon holds more ticks are a line of ticks instead.
const maxRing = 1 << 16

// maxLog bounds a bucket's log of its last ticks (see the reserve script).
const maxLog = 64

// spacingLua defines spacing(rate, burst, span): the tick interval (µs)
// and burst that release rate calls per window of span µs (window +
// guard) — the rule of tickFor in policy.go, which TestLuaTickMatchesGo
// keeps equal.
const spacingLua = `
local function spacing(rate, b, span)
  b = math.max(1, math.min(b, math.floor(rate)))
  local k = rate / b
  if k >= 1 then k = math.floor(k) end
  return math.ceil(span / k), b
end
`

// extendLua defines extend(key, until, now): key expires no sooner than
// until (µs).
const extendLua = `
local function extend(key, untilv, now)
  local ms = math.ceil((untilv - now) / 1000) + 1
  local t = redis.call('PTTL', key)
  if t == -1 or (t >= 0 and t < ms) then redis.call('PEXPIRE', key, ms) end
end
`

// reserveScript reserves the next tick of one bucket, and of its group's
// total when it has one.
//
// KEYS: the bucket's gate, control, group stats, in-flight and replicas
// keys, then the group's epoch, expiry, total, asking and rates keys (see
// keys.go).
// ARGV[1] Redis time override (µs; 0: TIME), see nowLua
// ARGV[2] tick interval (µs) of the caller's policy
// ARGV[3] burst of the caller's policy
// ARGV[4] horizon (µs): no tick is reserved further ahead than this
// ARGV[5] max in flight (0: no cap)
// ARGV[6] lease TTL (µs), counted from the tick
// ARGV[7] lease id ("" without a cap)
// ARGV[8] the primary limit's window + guard (µs), to space a lowered rate
// ARGV[9] replica liveness (µs): configured ticks older than this do not count
// ARGV[10] keep (µs): how long the state outlives its last tick
// ARGV[11] the bucket's name in its group ("" for a group of one)
// ARGV[12] the caller's replica id ("" for none)
// ARGV[13] the group's total interval (µs; 0: no total), ARGV[14] its
// burst, ARGV[15] its window + guard (µs), ARGV[16] its rate (calls per
// total window), ARGV[17] the bucket's own rate in calls per total window
// ARGV[18] ring size, ARGV[19] log length (see below), ARGV[20..23] the
// configured rate and adaptation (see raiseLua)
// ARGV[24] length of the ticks list (0: keep none), ARGV[25] the primary
// limit's window (µs), ARGV[26] warm-up (µs; 0: none), ARGV[27] the rate
// it starts at (calls per primary window)
// Returns {granted (0|1), wait (µs), reason, tick (µs), tolerance (µs; 0:
// the policy's)}: when granted, wait is the time from Redis now to the
// tick; when not, the time before asking again and reason says why (see
// deferReason). A tolerance is returned when a margin was learned (see
// Control.RateLimited).
var reserveScript = redis.NewScript(nowLua + minuteCounterLua + spacingLua + extendLua + raiseLua + `
local now = now_us()
local interval = tonumber(ARGV[2])
local burst = tonumber(ARGV[3])
local horizon = tonumber(ARGV[4])
local maxif = tonumber(ARGV[5])
local keep = tonumber(ARGV[10])
local member = ARGV[11]
local tiv = tonumber(ARGV[13])

-- While replicas disagree on the config (a rolling edit), the most
-- conservative tick among those granted one lately wins.
-- Each replica records the tick of every policy it grants under (a
-- reload leaves callers of the old policy waiting beside the new ones), so
-- a lowered rate applies to all of them at once.
if ARGV[12] ~= '' then
  redis.call('HSET', KEYS[5], ARGV[12] .. '|' .. ARGV[2] .. '|' .. ARGV[3], ARGV[2] .. '|' .. ARGV[3] .. '|' .. string.format('%d', now))
end
local peers = redis.call('HGETALL', KEYS[5])
for i = 2, #peers, 2 do
  local iv, b, seen = string.match(peers[i], '^(%d+)|(%d+)|(%d+)$')
  if iv and now - tonumber(seen) < tonumber(ARGV[9]) then
    if tonumber(iv) > interval then interval = tonumber(iv) end
    if tonumber(b) < burst then burst = tonumber(b) end
  elseif iv and now - tonumber(seen) > 12 * tonumber(ARGV[9]) then
    redis.call('HDEL', KEYS[5], peers[i - 1])
  end
end

local ctl = redis.call('HMGET', KEYS[2], 'paused_until', 'rate', 'rate_source', 'guard', 'tol', 'pause_from')
local paused = tonumber(ctl[1]) or 0
local rate = tonumber(ctl[2])
if rate and ctl[3] == 'learned' then
  local r = raise_rate(KEYS[2], now, tonumber(ARGV[20]), tonumber(ARGV[21]), tonumber(ARGV[22]), tonumber(ARGV[23]))
  if r == 0 then rate = nil elseif r then rate = r end
end
if rate and rate > 0 then
  local iv, b = spacing(rate, burst, tonumber(ARGV[8]))
  if iv > interval then interval = iv end
  burst = b
end
-- A guard learned from refusals at the full rate (network jitter, a
-- vendor that enforces spacing) widens the primary limit's spacing.
local lguard = tonumber(ctl[4])
if lguard and lguard > 0 then
  local iv, b = spacing(rate or tonumber(ARGV[20]), burst, tonumber(ARGV[25]) + lguard)
  if iv > interval then interval = iv end
  burst = b
end

-- The fair share of the group's total among its buckets with waiting
-- callers (max-min: water-filling), recomputed at most every 250 ms.
local tburst = tonumber(ARGV[14])
local fair = 0 -- µs per call at the bucket's fair share (0: the total does not bind)
if tiv > 0 and member ~= '' then
  redis.call('ZADD', KEYS[9], now + 2 * math.max(interval, horizon), member)
  redis.call('HSET', KEYS[10], member, ARGV[17])
  local sh = redis.call('HMGET', KEYS[8], 'share', 'share_at')
  local share = tonumber(sh[1])
  if share == nil or now - (tonumber(sh[2]) or 0) > 250000 then
    local gone = redis.call('ZRANGEBYSCORE', KEYS[9], '-inf', now, 'LIMIT', 0, 1000)
    for i = 1, #gone, 500 do
      redis.call('HDEL', KEYS[10], unpack(gone, i, math.min(i + 499, #gone)))
    end
    if #gone > 0 then redis.call('ZREM', KEYS[9], unpack(gone)) end
    local asking = redis.call('ZRANGEBYSCORE', KEYS[9], now, '+inf')
    local rates = {}
    for i = 1, #asking, 500 do
      local part = redis.call('HMGET', KEYS[10], unpack(asking, i, math.min(i + 499, #asking)))
      for _, r in ipairs(part) do rates[#rates + 1] = tonumber(r) or 0 end
    end
    table.sort(rates)
    local left = tonumber(ARGV[16])
    share = 0 -- 0: the total does not bind
    for i, r in ipairs(rates) do
      local rest = #rates - i + 1
      if r * rest > left then share = left / rest break end
      left = left - r
    end
    redis.call('HSET', KEYS[8], 'share', tostring(share), 'share_at', string.format('%d', now))
    extend(KEYS[9], now + 2000000 + keep, now)
    extend(KEYS[10], now + 2000000 + keep, now)
  end
  if share > 0 and share < tonumber(ARGV[17]) then
    fair = math.ceil(tonumber(ARGV[15]) / share)
  end
end

-- A missing state expired after idle (its ticks are all older than a
-- window) or was lost (Redis restarted empty, failed over, evicted): the
-- group's epoch and expiry set tell which. Ticks granted before a loss
-- reach at most now + horizon, so the next tick comes an interval later.
--
-- A state written by another Redis server than this one (a replica
-- promoted by a failover, a restart from a snapshot or an append-only
-- file) may be a stale copy that lacks the last ticks the old server
-- granted: it counts as lost too. The server is told by its run_id
-- (INFO server; new for every server process), kept with the epoch
-- ("run_id|switched_at") and with each state ("run"). For keep after a
-- switch, a missing state counts as lost as well (it may never have
-- reached this server). Where INFO is not allowed, runid is '' and only
-- missing states are detected.
local runid = ''
local info = redis.pcall('INFO', 'server')
if type(info) == 'string' then runid = string.match(info, 'run_id:(%w+)') or '' end
local ep = redis.call('GET', KEYS[6])
local epoch = ep ~= false
local switched = false
if runid ~= '' then
  local erun, eat = string.match(ep or '', '^(%w+)|(%d+)$')
  if not epoch then
    redis.call('SET', KEYS[6], runid .. '|0')
  elseif erun ~= runid then
    switched = true
    redis.call('SET', KEYS[6], runid .. '|' .. string.format('%d', now))
  elseif now - tonumber(eat) < keep then
    switched = true
  end
elseif not epoch then
  redis.call('SET', KEYS[6], string.format('%d', now))
end
local st = redis.call('HMGET', KEYS[1], 'last', 'n', 'defer_at', 'vt', 'log', 'plan', 'warm', 'run')
-- The log of a state reset at l (see below): its last ticks as if spaced
-- at the bucket's pace up to l, so that the next come at that pace.
local function resetLog(l)
  local kk = tonumber(ARGV[19])
  if kk <= 0 then return '' end
  local pace = math.ceil(tonumber(ARGV[8]) / kk)
  local parts = {}
  for i = 1, kk do parts[i] = string.format('%d', l - (i - 1) * pace) end
  return table.concat(parts, ',')
end
local last = tonumber(st[1])
local n = tonumber(st[2]) or 0
local reason = 1
-- Treat the state as lost: its next tick comes at l (the old one may
-- have granted ticks up to there), its log rebuilt to match.
local function reset(l)
  last = l
  n = burst
  reason = 3
  st[5] = resetLog(last)
  redis.call('HSET', KEYS[1], 'last', string.format('%d', last), 'n', n, 'run', runid, 'log', st[5])
  redis.call('HINCRBY', KEYS[3], 'resets', 1)
end
-- A state holding a plan and no tick yet (calls planned, none granted)
-- lost nothing, unless the group lost its epoch with it.
if last == nil and (st[6] == false or not epoch or switched) then
  local exp = tonumber(redis.call('ZSCORE', KEYS[7], member))
  if not epoch or switched or (exp and exp > now) then
    reset(now + horizon)
  end
elseif last ~= nil and runid ~= '' and st[8] ~= runid then
  -- A stale copy: ticks it lacks reach at most now + horizon.
  reset(math.max(last, now + horizon))
end
-- Warm-up: the rate ramps from ARGV[27] to the rate over ARGV[26] from
-- the moment the bucket starts after being idle longer than its window
-- (its state gone, or a pause that long ending).
local warmup = tonumber(ARGV[26])
if warmup > 0 then
  local warm = tonumber(st[7])
  if st[1] == false and warm == nil then
    warm = last or now -- a lost state's first tick waits the horizon
    redis.call('HSET', KEYS[1], 'warm', string.format('%d', warm))
  end
  local pfrom = tonumber(ctl[6])
  if paused > 0 and pfrom and paused - pfrom > tonumber(ARGV[25]) and (warm or 0) < paused then
    warm = paused
    redis.call('HSET', KEYS[1], 'warm', string.format('%d', warm))
  end
  if warm and now - warm < warmup then
    local top = rate or tonumber(ARGV[20])
    local from = math.min(tonumber(ARGV[27]), top)
    local r = from + (top - from) * math.max(now - warm, 0) / warmup
    local span = tonumber(ARGV[8])
    if lguard and lguard > 0 then span = math.max(span, tonumber(ARGV[25]) + lguard) end
    local iv, b = spacing(r, burst, span)
    if iv > interval then interval = iv end
    burst = math.min(burst, b)
  end
end
-- The total: ticks one total interval apart. In slot mode (ARGV[18] > 0)
-- they are slots of a ring bitmap over the horizon, so that a bucket's
-- tick can take any free slot, and ticks reserved ahead by other buckets
-- leave no unused gaps; otherwise (very high totals) a line, like a
-- bucket's own ticks.
local ring = tonumber(ARGV[18])
local tlast, tn, blocked = nil, 0, 0
if tiv > 0 then
  local ts = redis.call('HMGET', KEYS[8], 'last', 'n', 'cleared', 'blocked', 'run')
  tlast = tonumber(ts[1])
  tn = tonumber(ts[2]) or 0
  blocked = tonumber(ts[4]) or 0
  if not epoch or (runid ~= '' and (ts[5] or '') ~= runid and (tlast ~= nil or switched)) then
    -- Lost with the group, or a stale copy: the total's ticks reach at
    -- most now + horizon.
    blocked = math.max(blocked, now + horizon)
    redis.call('DEL', KEYS[11])
    redis.call('HSET', KEYS[8], 'blocked', string.format('%d', blocked), 'run', runid)
    if tlast == nil then tlast = blocked; tn = tburst end
    reason = 3
  end
  if ring > 0 then
    if redis.call('EXISTS', KEYS[11]) == 0 then redis.call('SETBIT', KEYS[11], ring - 1, 0) end
    local cur = math.floor(now / tiv)
    local cleared = tonumber(ts[3]) or (cur - 1)
    if cur - 1 - cleared >= ring then cleared = cur - 1 - ring end
    for j = cleared + 1, cur - 1 do redis.call('SETBIT', KEYS[11], j % ring, 0) end
    redis.call('HSET', KEYS[8], 'cleared', string.format('%d', cur - 1))
  end
end

-- The earliest free total slot at or after t (beyond the horizon if none).
local function freeSlot(t)
  local j = math.ceil(math.max(t, blocked + tiv) / tiv)
  local limit = math.floor((now + horizon) / tiv)
  while j <= limit do
    local pos = j % ring
    local span = math.min(ring - 1 - pos, limit - j)
    local p = redis.call('BITPOS', KEYS[11], 0, pos, pos + span, 'BIT')
    if p >= 0 and p <= pos + span then return (j + p - pos) * tiv end
    j = j + span + 1
  end
  return (limit + 1) * tiv
end

-- The earliest tick at or after t that a bucket whose last tick is l,
-- granted c times, allows.
local function earliest(l, c, iv, b, t)
  if l == nil then return t end
  if t <= l then
    if c < b then return l end
    return l + iv
  end
  if t >= l + iv then return t end
  return l + iv
end
-- In a group with a total, a bucket keeps its own pace: a virtual time vt
-- one pace apart per call (its fair share's interval, or its own), rather
-- than spacing from its actual ticks, so that a tick the total pushed
-- later does not slow it down further. Its own limit then holds by a log
-- of its last k ticks (k = ticks per window): a new tick comes at least a
-- window + guard after the k-th last one, which keeps at most k ticks in
-- any window (G1) while letting a pushed bucket catch up. The log is used
-- while nothing (a lowered rate, a slower replica) widened the tick and k
-- is small; otherwise the spacing rule holds.
local k = tonumber(ARGV[19])
local logt = {}
if k > 0 and interval == tonumber(ARGV[2]) and burst == tonumber(ARGV[3]) then
  for x in string.gmatch(st[5] or '', '%d+') do logt[#logt + 1] = tonumber(x) end
else
  k = 0
end
local function earliestOwn(t)
  if k == 0 then return earliest(last, n, interval, burst, t) end
  if last ~= nil and t <= last and n < burst then return last end
  local c = t
  if last ~= nil and c <= last then c = last + 1 end
  if #logt >= k then c = math.max(c, logt[k] + tonumber(ARGV[8])) end
  return c
end
local vt = nil
local tick = math.max(now, paused)
if tiv > 0 then
  local pace = math.floor(interval / burst)
  if fair > pace then pace = fair end
  vt = math.max(now, (tonumber(st[4]) or 0) + pace)
  tick = math.max(tick, vt)
end
for _ = 1, 8 do
  local a = earliestOwn(tick)
  local b = a
  if tiv > 0 and ring > 0 then
    b = freeSlot(a)
  elseif tiv > 0 then
    b = earliest(tlast, tn, tiv, tburst, math.max(a, blocked))
  end
  tick = b
  if b == a then break end
end

local function keepAlive(untilv)
  extend(KEYS[1], untilv, now)
  extend(KEYS[5], untilv, now)
  if redis.call('EXISTS', KEYS[2]) == 1 then extend(KEYS[2], math.max(untilv, paused + keep), now) end
  redis.call('ZADD', KEYS[7], 'GT', untilv, member)
  redis.call('ZREMRANGEBYSCORE', KEYS[7], '-inf', now)
  extend(KEYS[7], untilv, now)
end

-- A bucket held to its fair share reserves only half a horizon ahead, so
-- that buckets below their share (which keep the whole horizon) find the
-- total's slots they need before the others take them.
if fair > 0 and fair >= math.floor(interval / burst) then horizon = math.floor(horizon / 2) end
if tick - now > horizon then
  -- Give each deferred caller its own moment to come back, one tick
  -- apart, so that a crowd beyond the horizon polls once per tick in
  -- the order it arrived, not all at once.
  local at = math.max(tick - horizon, (tonumber(st[3]) or 0) + math.floor(interval / burst))
  redis.call('HSET', KEYS[1], 'defer_at', string.format('%d', at))
  keepAlive(math.max(at, last or 0) + keep)
  redis.call('HINCRBY', KEYS[3], 'deferred', 1)
  return {0, at - now, reason, 0, 0}
end
if maxif > 0 then
  redis.call('ZREMRANGEBYSCORE', KEYS[4], '-inf', string.format('%d', now))
  if redis.call('ZCARD', KEYS[4]) >= maxif then
    redis.call('HINCRBY', KEYS[3], 'deferred', 1)
    return {0, math.max(interval, 5000), 2, 0, 0}
  end
  local lease = tick + tonumber(ARGV[6])
  redis.call('ZADD', KEYS[4], string.format('%d', lease), ARGV[7])
  extend(KEYS[4], lease, now)
end
if tick == last then
  n = n + 1
else
  n = 1
  if k > 0 then
    table.insert(logt, 1, tick)
    while #logt > k do table.remove(logt) end
  end
end
local fields = {'last', string.format('%d', tick), 'n', n, 'vt', string.format('%d', vt or tick), 'run', runid}
if k > 0 then
  local parts = {}
  for i, x in ipairs(logt) do parts[i] = string.format('%d', x) end
  fields[#fields + 1] = 'log'
  fields[#fields + 1] = table.concat(parts, ',')
end
redis.call('HSET', KEYS[1], unpack(fields))
keepAlive(math.max(tick, tonumber(st[3]) or 0) + keep)
if tiv > 0 then
  if tick == tlast then tn = tn + 1 else tn = 1 end
  redis.call('HSET', KEYS[8], 'last', string.format('%d', math.max(tick, tlast or 0)), 'n', tn, 'run', runid)
  extend(KEYS[8], tick + keep, now)
  if ring > 0 then
    redis.call('SETBIT', KEYS[11], math.floor(tick / tiv) % ring, 1)
    extend(KEYS[11], tick + keep, now)
  end
end
local logn = tonumber(ARGV[24])
if logn > 0 then
  redis.call('LPUSH', KEYS[12], string.format('%d', tick))
  redis.call('LTRIM', KEYS[12], 0, logn - 1)
  extend(KEYS[12], tick + keep, now)
end
count(KEYS[3], 'granted', now)
return {1, tick - now, 0, tick, tonumber(ctl[5]) or 0}
`)

// reserve asks for the next tick in one Redis round trip. Being deferred
// is not an error: errors mean Redis failed.
func (b *Bucket) reserve(ctx context.Context) (reservation, error) {
	var lease string
	if b.policy.MaxInFlight > 0 {
		lease = newLeaseID()
	}
	a := b.policy.Adapt.withDefaults()
	cfg := float64(b.policy.Limits[0].Rate)
	var tiv, tburst, tspan, ring, k int64
	var trate, own float64
	if t := b.total; t != nil {
		tiv, tburst, tspan, trate = t.interval.Microseconds(), int64(t.burst), t.span.Microseconds(), t.rate
		own = EffectiveRate(b.interval, b.burst, t.window)
		if n := (b.policy.Horizon+t.interval-1)/t.interval + 4; t.burst == 1 && n <= maxRing {
			ring = int64(n)
		}
		if per := int64(b.policy.Limits[0].Rate / b.burst); len(b.policy.Limits) == 1 && per <= maxLog {
			k = per
		}
	}
	res, err := reserveScript.Run(ctx, b.gate.rdb, b.keys.all(), b.gate.redisNow(),
		b.interval.Microseconds(), b.burst, b.policy.Horizon.Microseconds(),
		b.policy.MaxInFlight, b.policy.LeaseTTL.Microseconds(), lease,
		(b.policy.Limits[0].Window + b.policy.Guard).Microseconds(), replicaLive.Microseconds(),
		b.keep.Microseconds(), b.member, b.gate.replica, tiv, tburst, tspan, trate, own, ring, k,
		cfg, cfg*a.Increase, a.Quiet.Microseconds(), a.Probe.Microseconds(), b.tickLog(), b.policy.Limits[0].Window.Microseconds(),
		b.policy.Warmup.Microseconds(), b.policy.WarmupFrom).Int64Slice()
	if err != nil {
		return reservation{}, fmt.Errorf("shaper: reserve a tick for %q: %w", b.name, unavailable(ctx, err))
	}
	if len(res) != 5 {
		return reservation{}, fmt.Errorf("shaper: reserve a tick for %q: unexpected reply %v", b.name, res)
	}
	r := reservation{ok: res[0] == 1, wait: time.Duration(res[1]) * time.Microsecond, reason: deferReason(res[2]),
		tick: res[3], tolerance: time.Duration(res[4]) * time.Microsecond}
	if r.ok {
		r.lease = lease
	}
	return r, nil
}

// giveUpScript frees an in-flight lease, counts a tick given up and takes
// it out of the ticks list.
//
// KEYS[1] in-flight sorted set, KEYS[2] stats hash, KEYS[3] ticks list.
// ARGV[1] Redis time override (unused), ARGV[2] lease id ("" for none),
// ARGV[3] the counter to add one to ("late", "dropped") or "", ARGV[4]
// the tick given up (µs; 0: none).
// Returns 0.
var giveUpScript = redis.NewScript(`
if ARGV[2] ~= '' then redis.call('ZREM', KEYS[1], ARGV[2]) end
if ARGV[3] ~= '' then redis.call('HINCRBY', KEYS[2], ARGV[3], 1) end
if ARGV[4] ~= '0' then redis.call('LREM', KEYS[3], 1, ARGV[4]) end
return 0
`)

// Why a tick was given up, for the stats.
const (
	gaveUpLate    = "late"
	gaveUpDropped = "dropped"
)

// giveUp frees lease (if any), counts why its tick went unused (if
// counter is set) and takes the tick out of the ticks list (if tick > 0:
// a tick granted and never used).
func (b *Bucket) giveUp(ctx context.Context, lease string, counter string, tick int64) error {
	if lease == "" && counter == "" && tick == 0 {
		return nil
	}
	if err := giveUpScript.Run(ctx, b.gate.rdb, []string{b.keys.inFlight, b.keys.stats, b.keys.ticks}, 0, lease, counter,
		strconv.FormatInt(tick, 10)).Err(); err != nil {
		return fmt.Errorf("shaper: free a lease of %q: %w", b.name, unavailable(ctx, err))
	}
	return nil
}

// maxTickLog bounds a bucket's ticks list.
const maxTickLog = 1000

// tickLog is how many granted ticks the bucket's ticks list keeps: three
// windows of the primary limit at the configured rate, what judging a
// rate-limited answer looks at.
func (b *Bucket) tickLog() int {
	return min(3*b.policy.Limits[0].Rate+1, maxTickLog)
}

func newLeaseID() string {
	var buf [12]byte
	_, _ = rand.Read(buf[:])
	return hex.EncodeToString(buf[:])
}
