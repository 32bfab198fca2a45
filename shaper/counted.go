package shaper

// The counted script serves the buckets the core script cannot: those
// with quotas (counted limits) or in a group with a total (a per-account
// vendor), as long as nothing unusual is going on. groupLua holds the
// steps it shares with the full reserve script, so that the two space
// calls by the same code.

// groupLua defines the steps of a grant that involve a bucket's group
// or its counted limits: the fair share of the total, the total's ring
// of slots, the earliest tick a line admits, and fitting a tick to both
// the bucket's line and the total's.
const groupLua = `
-- fair_pace(k, g, interval, now): the fair share of the group's total
-- among its buckets with waiting callers (max-min: water-filling),
-- recomputed at most every 250 ms, as µs per call (0: the total does not
-- bind). k holds the keys (gate, total, asking, rates); g the bucket in
-- its group: member, own (its rate per total window, as the gate passes
-- it), rate and span (the total's calls per window, and window + guard),
-- horizon, keep, and what the hashes said: asked_at and asked_rate (when
-- and at what rate the bucket last said it was asking, gate hash), share
-- and share_at (total hash).
local function fair_pace(k, g, interval, now)
  -- The bucket says it is asking (and at what rate) once per half of what
  -- it is counted for, not on every call: its gate hash keeps when.
  local span = math.max(interval, g.horizon)
  if g.asked_rate ~= g.own or now - (tonumber(g.asked_at) or 0) >= span / 2 then
    redis.call('ZADD', k.asking, now + 2 * span, g.member)
    redis.call('HSET', k.rates, g.member, g.own)
    redis.call('HSET', k.gate, 'asked_at', fmt(now), 'asked_rate', g.own)
  end
  local share = tonumber(g.share)
  if share == nil or now - (tonumber(g.share_at) or 0) > 250000 then
    local gone = redis.call('ZRANGEBYSCORE', k.asking, '-inf', now, 'LIMIT', 0, 1000)
    for i = 1, #gone, 500 do
      redis.call('HDEL', k.rates, unpack(gone, i, math.min(i + 499, #gone)))
    end
    if #gone > 0 then redis.call('ZREM', k.asking, unpack(gone)) end
    local asking = redis.call('ZRANGEBYSCORE', k.asking, now, '+inf')
    local rates = {}
    for i = 1, #asking, 500 do
      local part = redis.call('HMGET', k.rates, unpack(asking, i, math.min(i + 499, #asking)))
      for _, r in ipairs(part) do rates[#rates + 1] = tonumber(r) or 0 end
    end
    table.sort(rates)
    local left = g.rate
    share = 0
    for i, r in ipairs(rates) do
      local rest = #rates - i + 1
      if r * rest > left then share = left / rest break end
      left = left - r
    end
    redis.call('HSET', k.total, 'share', tostring(share), 'share_at', fmt(now))
    extend(k.asking, now + 2000000 + g.keep, now)
    extend(k.rates, now + 2000000 + g.keep, now)
  end
  if share > 0 and share < tonumber(g.own) then return math.ceil(g.span / share) end
  return 0
end

-- earliest(l, u, iv, b, t, cost): the earliest tick at or after t for a
-- call of cost units on a line of ticks iv apart, each carrying at most b
-- units, whose last tick l carries u units. A tick is followed by one
-- interval per b units it carried, unless charge is false (the counters
-- keep the units). A respace marks a tick spent (u of SPENT, see
-- respaceScript): one interval follows it.
local function earliest(l, u, iv, b, t, cost, charge)
  if l == nil then return t end
  if t <= l and u + cost <= b then return l end
  local e = l + iv
  if charge and u < SPENT then e = l + iv * math.max(1, math.ceil(u / b)) end
  return math.max(t, e)
end

-- logged(l, u, b, kth, span, t, cost): earliest for a bucket that
-- keeps the log of its last k ticks (in a group with a total), whose
-- k-th last tick is kth (nil: fewer): a new tick comes at least span
-- after it, which keeps at most k ticks in any window while letting a
-- bucket the total pushed later catch up.
local function logged(l, u, b, kth, span, t, cost)
  if l ~= nil and t <= l and u + cost <= b then return l end
  local c = t
  if l ~= nil and c <= l then c = l + 1 end
  if kth then c = math.max(c, kth + span) end
  return c
end

-- log_cut(log, k): the k-th tick of a log of ticks (newest first, comma
-- separated; nil when it holds fewer), and its first k - 1 ticks as they
-- are written: what the next tick's log keeps after it. Only the k-th
-- tick is read as a number.
local function log_cut(log, k)
  local from = 1
  for _ = 1, k - 1 do
    local c = string.find(log, ',', from, true)
    if not c then return nil, log end
    from = c + 1
  end
  local c = string.find(log, ',', from, true)
  return tonumber(string.sub(log, from, (c or 0) - 1)), string.sub(log, 1, math.max(from - 2, 0))
end

-- first_clear(key, from, to): the first clear bit of the bitmap at key
-- in bits from..to, or -1. BITPOS's BIT unit is Redis 7's: on a Redis
-- without it (the embedded one) the bytes are read and scanned here, a
-- full byte at a time.
local function first_clear(key, from, to)
  local p = redis.pcall('BITPOS', key, 0, from, to, 'BIT')
  if type(p) == 'number' then
    if p > to then return -1 end
    return p
  end
  local first = math.floor(from / 8)
  local bytes = redis.call('GETRANGE', key, first, math.floor(to / 8))
  local q = from
  while q <= to do
    local b = string.byte(bytes, math.floor(q / 8) - first + 1)
    if not b then return q end
    if b == 255 and q % 8 == 0 then
      q = q + 8
    else
      if math.floor(b / 2 ^ (7 - q % 8)) % 2 == 0 then return q end
      q = q + 1
    end
  end
  return -1
end

-- free_slot: the earliest free slot of the total's ring bitmap at or
-- after t (beyond the horizon if none).
local function free_slot(k_slots, ring, t, blocked, tiv, horizon, now)
  local j = math.ceil(math.max(t, blocked + tiv) / tiv)
  local limit = math.floor((now + horizon) / tiv)
  while j <= limit do
    local pos = j % ring
    local span = math.min(ring - 1 - pos, limit - j)
    local p = first_clear(k_slots, pos, pos + span)
    if p >= 0 then return (j + p - pos) * tiv end
    j = j + span + 1
  end
  return (limit + 1) * tiv
end

-- ring_cleared(k_slots, ring, tiv, cleared, kept, keep, now): the ring's
-- slots that passed since the last grant (cleared: the last slot
-- cleared, nil for none) are cleared for the next round; a ring made
-- anew expires as the total does (kept: what the total's keys were last
-- extended to). Returns the last slot cleared now, for the total's
-- 'cleared'.
local function ring_cleared(k_slots, ring, tiv, cleared, kept, keep, now)
  if redis.call('EXISTS', k_slots) == 0 then
    -- At once, since grants extend it only as their ticks pass kept.
    redis.call('SETBIT', k_slots, ring - 1, 0)
    extend(k_slots, math.max(kept, now + keep), now)
  end
  local cur = math.floor(now / tiv)
  cleared = cleared or (cur - 1)
  if cur - 1 - cleared >= ring then cleared = cur - 1 - ring end
  for j = cleared + 1, cur - 1 do redis.call('SETBIT', k_slots, j % ring, 0) end
  return cur - 1
end

-- FIT_ROUNDS bounds fit's rounds: a tick both lines admit is found in
-- two (the bucket's line admits any tick past its next one).
local FIT_ROUNDS = 8

-- fit(s, t, tick): the earliest tick at or after tick that both the
-- bucket's line and the total's admit. s is the bucket's line: last, n,
-- interval, burst, cost, charge (see earliest), and k, kth, span for a
-- bucket that keeps its log (k > 0, see logged). t is the total's: iv
-- (0: none), burst, last, n, blocked (no tick before it), and for a ring
-- (ring > 0) its key slots, horizon and now (see free_slot).
local function fit(s, t, tick)
  for _ = 1, FIT_ROUNDS do
    local a
    if s.k > 0 then a = logged(s.last, s.n, s.burst, s.kth, s.span, tick, s.cost)
    else a = earliest(s.last, s.n, s.interval, s.burst, tick, s.cost, s.charge) end
    local b = a
    if t.iv > 0 and t.ring > 0 then
      b = free_slot(t.slots, t.ring, a, t.blocked, t.iv, t.horizon, t.now)
    elseif t.iv > 0 then
      b = earliest(t.last, t.n, t.iv, t.burst, math.max(a, t.blocked), 1, true)
    end
    tick = b
    if b == a then break end
  end
  return tick
end

-- total_granted(k, t, tick, cost, keep, now, fields): the total's state
-- after a grant at tick (k: the keys total, slots, counts; t: iv, ring,
-- last, n, kept, the total's counters in use, costly_until (nil: not
-- written) and fields, more of the total hash to write).
local function total_granted(k, t, tick, cost, keep, now)
  local tn = 1
  if tick == t.last then tn = t.n + 1 end
  local tset = t.fields
  put(tset, 'last', fmt(math.max(tick, t.last or 0)), 'n', tn)
  -- The total's keys outlive the tick by keep: extended a little further
  -- (a quarter of keep, at most a second) once the tick passes what they
  -- were last extended to (its 'kept'), as the bucket's keys are.
  local tkept = t.kept
  if tick + keep > tkept then
    tkept = tick + keep + math.min(1000000, math.floor(keep / 4))
    put(tset, 'kept', fmt(tkept))
  end
  if t.costly_until then put(tset, 'costly_until', fmt(t.costly_until)) end
  redis.call('HSET', k.total, unpack(tset))
  if t.ring > 0 then redis.call('SETBIT', k.slots, math.floor(tick / t.iv) % t.ring, 1) end
  if tkept ~= t.kept then
    extend(k.total, tkept, now)
    if t.ring > 0 then extend(k.slots, tkept, now) end
  end
  for _, c in ipairs(t.counters) do counter_add(k.counts, c, tick, cost, keep, now) end
end
`
