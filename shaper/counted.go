package shaper

import (
	"strconv"
	"strings"
)

// The counted script serves the buckets the core script cannot: those
// with quotas (counted limits) or in a group with a total (a per-account
// vendor), as long as nothing unusual is going on. groupLua holds the
// steps it shares with the full reserve script, so that the two space
// calls by the same code.

// fairShareLua defines share_of(k, g, now), the total's fair share
// recomputed (see fair_pace): the askers whose claim has lapsed leave,
// and the total is shared max-min among the rest's rates. It is the full
// grant's: where it is left out (the counted grant), a share older than
// 250 ms hands the call over. It saves the share in g.ts, the total's
// numbers (see totalStateLua).
const fairShareLua = `
share_of = function(k, g, now)
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
  local share = 0
  for i, r in ipairs(rates) do
    local rest = #rates - i + 1
    if r * rest > left then share = left / rest break end
    left = left - r
  end
  g.ts.share, g.ts.share_at = share, now
  save_total(k.total, g.ts)
  extend(k.asking, now + 2000000 + g.keep, now)
  extend(k.rates, now + 2000000 + g.keep, now)
  return share
end
`

// totalStateLua defines how a group total's hash keeps its numbers
// (layout 5): all of them in one field, tl, beside run (the run_of of
// the server whose grants they count). A grant reads the two in one
// HMGET: a field read costs Redis about as much as a command's argument
// and a tonumber of its text (see docs/limits.md), and a total's grant
// read eight of them.
//
// tl holds, in order: last (the total's last tick), n (the calls on it),
// kept (what its keys were last extended to), blocked (no tick before
// it: a reset's), costly_until (see counted_spaced), share and share_at
// (the fair share and when it was computed, see fair_pace), cleared (the
// ring's last slot cleared, see ring_cleared). TOTAL_NONE stands where
// nil means something: no tick yet (last), no share computed (share), no
// slot cleared (cleared). As doubles where Lua has struct, else as text.
//
// read_total(tl, ts): tl's numbers into ts (ts.last nil: no total), by
// total_from(ts, last, ...), which total_adopt uses too.
//
// save_total(k_total, ts, run) (totalSaveLua, the grants' only): ts's
// numbers into tl, and run when given; returns tl.
//
// total_adopt(k_total, old_run): a total of layout 4 (its numbers in
// fields of their own, run untagged) moved into tl and tagged with the
// layout (run_of of the run it had), so that a worker of layout 4 waits
// for it from then on (newer_layout) and none reads it half moved.
const totalStateLua = `
local TOTAL_NONE = -1
local function or_none(v) if v ~= TOTAL_NONE then return v end end
local function total_from(ts, last, n, kept, blocked, costly, share, share_at, cleared)
  ts.last, ts.n, ts.kept, ts.blocked = or_none(tonumber(last)), tonumber(n) or 0, tonumber(kept) or 0, tonumber(blocked) or 0
  ts.costly_until, ts.share, ts.share_at, ts.cleared = tonumber(costly) or 0, or_none(tonumber(share)), tonumber(share_at) or 0,
    or_none(tonumber(cleared))
end
local function read_total(tl, ts)
  if form() and tl and #tl == 64 then return total_from(ts, packer.unpack('<dddddddd', tl)) end
  if not packer and tl then
    return total_from(ts, string.match(tl, '^(%-?%d+)|(%d+)|(%d+)|(%d+)|(%d+)|([^|]+)|(%d+)|(%-?%d+)$'))
  end
  total_from(ts)
end
`

// totalSaveLua defines save_total (see totalStateLua): the grants'.
const totalSaveLua = `
local function save_total(k_total, ts, run)
  local last, share, cleared = ts.last or TOTAL_NONE, ts.share or TOTAL_NONE, ts.cleared or TOTAL_NONE
  local tl = form() and packer.pack('<dddddddd', last, ts.n, ts.kept, ts.blocked, ts.costly_until, share, ts.share_at, cleared)
    or string.format('%d|%d|%d|%d|%d|%.17g|%d|%d', last, ts.n, ts.kept, ts.blocked, ts.costly_until, share, ts.share_at, cleared)
  if run then redis.call('HSET', k_total, 'tl', tl, 'run', run) else redis.call('HSET', k_total, 'tl', tl) end
  return tl
end
`

// totalAdoptLua defines total_adopt (see totalStateLua): the full
// grant's, where a total of the previous layout is converted.
const totalAdoptLua = `
local function total_adopt(k_total, old_run)
  local names = {'last', 'n', 'kept', 'blocked', 'costly_until', 'share', 'share_at', 'cleared'}
  local ts = {}
  total_from(ts, unpack(redis.call('HMGET', k_total, unpack(names))))
  local tl = save_total(k_total, ts, run_of(old_run))
  redis.call('HDEL', k_total, unpack(names))
  return tl
end
`

// spentLua defines SPENT, the units of a tick a respace marked spent
// (and the n of its line): more than any burst, so that the next tick
// comes one interval after it (see earliest and respaceScript).
const spentLua = `
local SPENT = 1000000000
`

// groupLua defines the steps of a grant that involve a bucket's group
// or its counted limits: the fair share of the total, the earliest tick
// a line admits, fitting a tick to both the bucket's line and the
// total's (a line, or a ring of slots: see ringLua), the total's grant.
//
// log_grant(k_ticks, k_tags, tick, tag, len, keep, tag_keep, now): one
// call's tick into the ticks list (log_ticks, at most len of them), and
// its holder's tag where the bucket keeps it: in the same item when the
// ticks list is the tags key (a vendor's bucket, held_item), else in the
// group's sorted set of tags. The item goes to log_ticks in one_item, a
// list made once per library.
//
// fair_pace(k, g, interval, now): the fair share of the group's total
// among its buckets with waiting callers (max-min: water-filling),
// recomputed at most every 250 ms, as µs per call (0: the total does not
// bind), and whether the bucket said it was asking now: then the caller
// writes asked_at (now) and asked_rate (own) with the rest of the gate
// hash, in the command it sends anyway. k holds the keys (total, asking,
// rates); g the bucket in
// its group: member, own (its rate per total window, as the gate passes
// it), rate and span (the total's calls per window, and window + guard),
// horizon, keep, and what the hashes said: asked_at and asked_rate (when
// and at what rate the bucket last said it was asking, gate hash), share
// and share_at (the total's, see totalStateLua), own_n (own as a number,
// or nil) and ts (the total's numbers, where share_of saves a share it
// computes). The bucket says it is asking (and at what
// rate) once per half of what it is counted for (the local span), not on
// every call: its gate hash keeps when.
//
// earliest(l, u, iv, b, t, cost, charge): the earliest tick at or after
// t for a call of cost units on a line of ticks iv apart, each carrying
// at most b units, whose last tick l carries u units. A tick is followed
// by one interval per b units it carried, unless charge is false (the
// counters keep the units). A respace marks a tick spent (u of SPENT, see
// respaceScript, more than any burst): one interval follows it.
//
// logged(l, u, b, kth, span, t, cost): earliest for a bucket that keeps
// the log of its last k ticks (in a group with a total), whose k-th last
// tick is kth (nil: fewer): a new tick comes at least span after it,
// which keeps at most k ticks in any window while letting a bucket the
// total pushed later catch up.
//
// log_cut(log, k): the k-th tick of a log of ticks (newest first, comma
// separated; nil when it holds fewer), and its first k - 1 ticks as they
// are written: what the next tick's log keeps after it. Only the k-th
// tick is read as a number.
//
// FIT_ROUNDS bounds fit's rounds: a tick both lines admit is found in
// two (the bucket's line admits any tick past its next one).
//
// fit(s, t, tick): the earliest tick at or after tick that both the
// bucket's line and the total's admit. A tick the total's line gave in
// the round before (free) is not looked up again when the bucket's line
// admits it: one BITPOS of the ring a grant, not two. s is the bucket's
// line: last, n, interval, burst, cost, charge (see earliest), and k, kth, span for a
// bucket that keeps its log (k > 0, see logged). t is the total's: iv
// (0: none), burst, last, n, blocked (no tick before it), and for a ring
// (ring > 0) its key slots, horizon and now (see free_slot).
//
// total_granted(k, t, tick, cost, keep, now): the total's state
// after a grant at tick (k: the keys total, slots, counts; t: iv, ring,
// ts, the total's numbers as read_total left them (last and n as the
// grant fitted the tick to), the total's counters in use, costly_until
// (nil: not written) and run (nil: not written), saved with save_total).
// The total's keys outlive the tick by keep: extended further (reachLua)
// once the tick passes what they were last extended to (its kept), as
// the bucket's keys are.
const groupLua = spentLua + `
local one_item = {}
local function log_grant(k_ticks, k_tags, tick, tag, len, keep, tag_keep, now)
  if k_ticks == k_tags then
    one_item[1] = held_item(tick, tag)
    return log_ticks(k_ticks, one_item, tick, len, keep, now, tag_keep)
  end
  if len > 0 then
    one_item[1] = tick_item(tick)
    log_ticks(k_ticks, one_item, tick, len, keep, now)
  end
  if tag ~= '' then redis.call('ZADD', k_tags, fmt(tick), tag) end
end

local share_of = nil
local function fair_pace(k, g, interval, now)
  local span = math.max(interval, g.horizon)
  local asked = false
  if g.asked_rate ~= g.own or now - (tonumber(g.asked_at) or 0) >= span / 2 then
    redis.call('ZADD', k.asking, now + 2 * span, g.member)
    redis.call('HSET', k.rates, g.member, g.own)
    asked = true
  end
  local share = tonumber(g.share)
  if share == nil or now - (tonumber(g.share_at) or 0) > 250000 then
    if not share_of then return nil, asked end
    share = share_of(k, g, now)
  end
  if share > 0 and share < (g.own_n or tonumber(g.own)) then return math.ceil(g.span / share), asked end
  return 0, asked
end

local function earliest(l, u, iv, b, t, cost, charge)
  if l == nil then return t end
  if t <= l and u + cost <= b then return l end
  local e = l + iv
  if charge and u < SPENT then e = l + iv * math.max(1, math.ceil(u / b)) end
  return math.max(t, e)
end

local function logged(l, u, b, kth, span, t, cost)
  if l ~= nil and t <= l and u + cost <= b then return l end
  local c = t
  if l ~= nil and c <= l then c = l + 1 end
  if kth then c = math.max(c, kth + span) end
  return c
end

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

local FIT_ROUNDS = 8

local function fit(s, t, tick)
  local free = nil
  for _ = 1, FIT_ROUNDS do
    local a
    if s.k > 0 then a = logged(s.last, s.n, s.burst, s.kth, s.span, tick, s.cost)
    else a = earliest(s.last, s.n, s.interval, s.burst, tick, s.cost, s.charge) end
    if a == free then return a end
    local b = a
    if t.iv > 0 and t.ring > 0 then
      b = free_slot(t.slots, t.ring, a, t.blocked, t.iv, t.horizon, t.now)
    elseif t.iv > 0 then
      b = earliest(t.last, t.n, t.iv, t.burst, math.max(a, t.blocked), 1, true)
    end
    tick, free = b, b
    if b == a then break end
  end
  return tick
end

local function total_granted(k, t, tick, cost, keep, now)
  local ts, kept = t.ts, t.ts.kept
  if tick == ts.last then ts.n = ts.n + 1 else ts.n = 1 end
  ts.last = math.max(tick, ts.last or 0)
  if tick + keep > kept then ts.kept = tick + keep + ` + reachLua + ` end
  if t.costly_until then ts.costly_until = t.costly_until end
  save_total(k.total, ts, t.run)
  if t.ring > 0 then redis.call('SETBIT', k.slots, math.floor(tick / t.iv) % t.ring, 1) end
  if ts.kept ~= kept then
    extend(k.total, ts.kept, now)
    if t.ring > 0 then extend(k.slots, ts.kept, now) end
  end
  for _, c in ipairs(t.counters) do counter_add(k.counts, c, tick, cost, keep, now) end
end
`

// ringLua defines how a group's total keeps its ticks as a ring of slots
// over the horizon (a bitmap): the first free slot, and clearing the
// slots that passed.
//
// first_clear(key, from, to): the first clear bit of the bitmap at key
// in bits from..to, or -1. BITPOS's BIT unit is Redis 7's: on a Redis
// without it (the embedded one) the bytes are read and scanned here, a
// full byte at a time.
//
// free_slot(k_slots, ring, t, blocked, tiv, horizon, now): the earliest
// free slot of the total's ring bitmap at or after t (beyond the horizon
// if none).
//
// ring_cleared(k_slots, ring, tiv, cleared, kept, keep, now): the ring's
// slots that passed since the last grant (cleared: the last slot
// cleared, nil for none) are cleared for the next round; a ring made
// anew expires as the total does (kept: what the total's keys were last
// extended to), and at once (when the total clears none yet and k_slots
// does not exist), since grants extend it only as their ticks pass
// kept. A ring that went while its total stayed (the two are extended
// together) is made again by its next SETBIT, and given an expiry at the
// total's next extension. Returns the last slot cleared
// now, for the total's 'cleared'.
const ringLua = `
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

local function ring_cleared(k_slots, ring, tiv, cleared, kept, keep, now)
  if cleared == nil and redis.call('EXISTS', k_slots) == 0 then
    redis.call('SETBIT', k_slots, ring - 1, 0)
    extend(k_slots, math.max(kept, now + keep), now)
  end
  local cur = math.floor(now / tiv)
  cleared = cleared or (cur - 1)
  if cur - 1 - cleared >= ring then cleared = cur - 1 - ring end
  for j = cleared + 1, cur - 1 do redis.call('SETBIT', k_slots, j % ring, 0) end
  return cur - 1
end
`

// countedKeyNames names the counted script's KEYS, in order
// (TestScriptBindings).
var countedKeyNames = []string{"gate", "control", "stats", "ticks", "expiry", "tags", "total", "asking", "rates", "slots",
	"counts", "total_counts"}

// counted lists the counted script's keys, in the order of
// countedKeyNames.
func (k bucketKeys) counted() []string {
	return []string{k.gate, k.control, k.stats, k.ticks, k.expiry, k.tags, k.total, k.asking, k.rates, k.slots,
		k.counts, k.totalCounts}
}

// countedArgs are the counted script's ARGV, in order
// (TestScriptBindings). What a bucket's policy and its group's total
// say comes in two strings (see policyLua), the same for every call of
// the policy: a Redis function parses each once and keeps it.
type countedArgs struct {
	Now    int64  `lua:"now"`    // Redis time override (µs; 0: TIME)
	Server string `lua:"server"` // the server's run_id ("": unknown, the full script finds it; noServer: INFO refused)
	Tag    string `lua:"tag"`    // the call's tag (Request.Tag; "": none)
	Member string `lua:"member"` // the bucket's name in its group ("" for a group of one)
	Mine   string `lua:"mine"`   // the caller's tick as widest keeps it: "interval|burst|replica|gen" (Bucket.mine)
	Policy string `lua:"policy"` // the bucket's: "interval|burst|horizon|keep|live|tick_log|tag_keep|span|log_len|own_rate|limits" (limits: limitSpec)
	Total  string `lua:"total"`  // the group's total: "interval|burst|span|rate|ring|limits" ("": none)
}

// argv returns the arguments in the order of the struct's fields.
func (a countedArgs) argv() []any {
	return []any{a.Now, a.Server, a.Tag, a.Member, a.Mine, a.Policy, a.Total}
}

// counted builds the counted script's arguments for one call from the
// full script's (the fields of the same names).
func (a reserveArgs) counted(mine string) countedArgs {
	num := func(v int64) string { return strconv.FormatInt(v, 10) }
	rate := redisFloat
	p := strings.Join([]string{num(a.Interval), strconv.Itoa(a.Burst), num(a.Horizon), num(a.Keep), num(a.ReplicaLive),
		strconv.Itoa(a.TickLog), num(a.TagKeep), num(a.Span), num(a.LogLen), rate(a.OwnRate), a.Limits}, "|")
	var total string
	if a.TotalInterval > 0 {
		total = strings.Join([]string{num(a.TotalInterval), strconv.Itoa(a.TotalBurst), num(a.TotalSpan), rate(a.TotalRate),
			num(a.Ring), a.TotalLimits}, "|")
	}
	return countedArgs{Now: a.Now, Server: a.Server, Tag: a.Tag, Member: a.Member, Mine: mine, Policy: p, Total: total}
}

// policyLua defines policy_of and total_of: the counted script's Policy
// and Total arguments as tables (see cacheLua), with the quotas of their
// limits as counters (countersLua: calls of one unit are kept by the
// spacing alone on the spaced limits).
//
// policy_of(s), total_of(s): the parsed Policy and Total arguments
// (parse_policy, parse_total; total_of of "" is nil). The quotas'
// counters are the same tables on every call: each call loads them
// (counter_load) before it uses them. A policy's own_n is its own_rate
// as a number, converted once.
var policyLua = `
local function parse_policy(s)
  local iv, b, horizon, keep, live, tick_log, tag_keep, span, log_len, own, limits = string.match(s,
    '^(%d+)|(%d+)|(%d+)|(%d+)|(%d+)|(%d+)|(%d+)|(%d+)|(%d+)|([^|]*)|(.*)$')
  return {interval = iv + 0, burst = b + 0, horizon = horizon + 0, keep = keep + 0, live = live + 0, tick_log = tick_log + 0,
    tag_keep = tag_keep + 0, span = span + 0, log_len = log_len + 0, own_rate = own, own_n = tonumber(own),
    quotas = counters_in_use(parse_limits(limits), false)}
end

local function parse_total(s)
  local iv, b, span, rate, ring, limits = string.match(s, '^(%d+)|(%d+)|(%d+)|([^|]*)|(%d+)|(.*)$')
  return {interval = iv + 0, burst = b + 0, span = span + 0, rate = rate + 0, ring = ring + 0,
    quotas = counters_in_use(parse_limits(limits), false)}
end

local function policy_of(s) return cached(s, parse_policy) end
local function total_of(s)
  if s == '' then return nil end
  return cached(s, parse_total)
end
`

// countedFunction reserves the next tick of one call of a bucket with
// quotas or a group's total (a per-account vendor), as the full script
// would: a call of one unit in the normal lane, to a bucket without an
// in-flight cap or warm-up. It hands the call to the full script
// (a handover) for anything else: a state missing or written on another
// server, the bucket's or the total's (needState), adaptation in force
// (needAdapt: a pause, a rate, a lesson, a high call waiting, costly
// calls), the total's spaced counters in use after a costly call
// (needCostly), another replica's tick the widest (needWide: a rolling
// edit), and what one full grant settles (needUpkeep: a fair share older
// than 250 ms, share_of; a counter to adopt, counter_adopt). It
// refreshes its own widest tick itself. What it writes before a handover
// (the bucket's asking, an expired counter's slots, the ring's passed
// slots, its widest tick's refresh) is upkeep the full grant would do
// alike.
//
// It replies as every grant (see replyHeader), for one call.
var countedFunction = newFunction("counted", codesLua+fmtLua+nowFromLua+extendLua+rollLua+countersLua+
	lineFieldLua+runOfLua+totalStateLua+totalSaveLua+heldLua+putLua+keepAliveLua+logTicksLua+foldLua+ringLua+groupLua+cacheLua+policyLua+scratchLua,
	countedLua)

// countedLua is the counted grant's main part. It binds KEYS
// (countedKeyNames) to locals k_* and ARGV (countedArgs) to locals a_*,
// and parses the policy (p) and the total (tot). Then, in order:
//
//  1. The states (the gate hash's line, run, adapted, ...; the total's
//     hash, the local ts, read by name), written on this server
//     (a_server; NO_SERVER where INFO is refused: then only a missing
//     state is told), with no adaptation in force: the control hash is
//     read under the gate hash's mark (if adapted, see adaptedLua), then
//     unmarked. Else the call is handed over (NEED_STATE, NEED_ADAPT,
//     NEED_COSTLY).
//  2. The tick (interval, burst): the widest live one (line_widest: the
//     'wide' field read only when the line does not say it is the
//     caller's, see wide_entry), at the fair share of the total (fair,
//     see fair_pace).
//  3. The quotas (p.quotas, tot.quotas; calls of one unit are kept by the
//     spacing alone on the spaced limits): the earliest start they admit
//     (start).
//  4. The earliest tick both lines admit (tick, see fit): the bucket's
//     own at its pace (its virtual time vt under a total), the total's
//     once its ring is cleared (ring_cleared).
//  5. keep(untilv, tag_keep), a local function: the bucket's keys outlive
//     untilv (see keep_alive), and the line says so.
//  6. Beyond the horizon (tick - now > horizon): the caller comes back
//     one tick after the last deferred caller (defer_at).
//  7. Grant: the line (and the log, newlog), the ticks list, the tag
//     record, the quotas, the total (total_granted).
const countedLua = `
local k_gate = KEYS[1]
local k_control = KEYS[2]
local k_stats = KEYS[3]
local k_ticks = KEYS[4]
local k_expiry = KEYS[5]
local k_tags = KEYS[6]
local k_total = KEYS[7]
local k_asking = KEYS[8]
local k_rates = KEYS[9]
local k_slots = KEYS[10]
local k_counts = KEYS[11]
local k_total_counts = KEYS[12]
local a_now = ARGV[1] + 0
local a_server = ARGV[2]
local a_tag = ARGV[3]
local a_member = ARGV[4]
local a_mine = ARGV[5]
local a_policy = ARGV[6]
local a_total = ARGV[7]
local p = policy_of(a_policy)
local tot = total_of(a_total)

local now = now_from(a_now)
local runid = a_server == NO_SERVER and '' or a_server
local line, run, adapted, last_vt, log, asked_at, asked_rate, defer_at = unpack(redis.call('HMGET', k_gate,
  'line', 'run', 'adapted', 'vt', 'log', 'asked_at', 'asked_rate', 'defer_at'))
if a_server == '' or run ~= run_of(runid) then return handover(NEED_STATE) end
local last, n, gm, gc, kept, wiv, wb, wfresh = read_line(line)
if last == nil then return handover(NEED_STATE) end
if adapted then
  local hi_until, costly_until = unpack(redis.call('HMGET', k_gate, 'hi_until', 'costly_until'))
  local paused, rate, guard, tol = unpack(redis.call('HMGET', k_control, 'paused_until', 'rate', 'guard', 'tol'))
  if (tonumber(paused) or 0) > now or rate or guard or tol or (tonumber(hi_until) or 0) > now or
    (tonumber(costly_until) or 0) > now then return handover(NEED_ADAPT) end
  redis.call('HDEL', k_gate, 'adapted')
end
local tiv, ts = 0, scratch.total_state
if tot then
  tiv = tot.interval
  local tl
  ts.run, tl = unpack(redis.call('HMGET', k_total, 'run', 'tl'))
  read_total(tl, ts)
  if not ts.last or ts.run ~= run_of(runid) then return handover(NEED_STATE) end
  if ts.costly_until > now then return handover(NEED_COSTLY) end
end

if wiv ~= p.interval or wb ~= p.burst then return handover(NEED_WIDE) end
if now >= wfresh then
  if redis.call('HGET', k_gate, 'wide') ~= a_mine then return handover(NEED_UPKEEP) end
  wfresh = now + math.floor(p.live / 4)
  redis.call('HSET', k_gate, 'wide_at', fmt(now), 'line', line_of(last, n, gm, gc, kept, wiv, wb, wfresh))
end
local interval, burst = p.interval, p.burst
local fair, asked = 0, false
if tiv > 0 and a_member ~= '' then
  local k, g = scratch.fair_keys, scratch.fair
  k.total, k.asking, k.rates = k_total, k_asking, k_rates
  g.member, g.own, g.rate, g.span, g.horizon, g.keep = a_member, p.own_rate, tot.rate, tot.span, p.horizon, p.keep
  g.asked_at, g.asked_rate, g.share, g.share_at, g.own_n, g.ts = asked_at, asked_rate, ts.share, ts.share_at, p.own_n, ts
  fair, asked = fair_pace(k, g, interval, now)
  if not fair then return handover(NEED_UPKEEP) end
end

local start = now
for _, c in ipairs(p.quotas) do
  if counter_load(k_counts, c, now, true) == false then return handover(NEED_UPKEEP) end
  start = math.max(start, counter_free_at(k_counts, c, 1, now))
end
for _, c in ipairs(tot and tot.quotas or scratch.none) do
  if counter_load(k_total_counts, c, now, true) == false then return handover(NEED_UPKEEP) end
  start = math.max(start, counter_free_at(k_total_counts, c, 1, now))
end

local tick, pace = start, math.floor(interval / burst)
local k, kth, head = p.log_len, nil, ''
if k > 0 and interval == p.interval and burst == p.burst then kth, head = log_cut(log or '', k) else k = 0 end
local vt = nil
if tiv > 0 then
  vt = math.max(now, (tonumber(last_vt) or 0) + math.max(pace, fair))
  tick = math.max(tick, vt)
  if tot.ring > 0 then
    local cleared = ring_cleared(k_slots, tot.ring, tiv, ts.cleared, ts.kept, p.keep, now)
    ts.cleared = cleared
  end
end
local horizon = p.horizon
if fair > 0 and fair >= pace then horizon = math.floor(horizon / 2) end
local fs, ft = scratch.fit_line, scratch.fit_total
fs.last, fs.n, fs.interval, fs.burst, fs.cost, fs.charge = last, n, interval, burst, 1, false
fs.k, fs.kth, fs.span = k, kth, p.span
ft.iv, ft.burst, ft.last, ft.n = tiv, tot and tot.burst, ts.last, ts.n or 0
ft.blocked, ft.ring, ft.slots, ft.horizon, ft.now = ts.blocked or 0, tot and tot.ring, k_slots, horizon, now
tick = fit(fs, ft, tick)

local kk = scratch.keep_keys
kk.gate, kk.control, kk.ticks, kk.expiry, kk.tags, kk.member = k_gate, k_control, k_ticks, k_expiry, k_tags, a_member
local gf = emptied(scratch.gate_fields)
if asked then put(gf, 'asked_at', fmt(now), 'asked_rate', p.own_rate) end

if tick - now > horizon then
  if tiv > 0 and tot.ring > 0 then save_total(k_total, ts) end
  local reason = BEYOND_HORIZON
  if start - now > horizon then reason = HELD_BY_LIMIT end
  local at = math.max(tick - horizon, (tonumber(defer_at) or 0) + pace)
  local untilv = math.max(at, last) + p.keep
  if untilv > kept then
    kept = keep_alive(kk, untilv, kept, 0, p.keep, 0, now)
    put(gf, 'line', line_of(last, n, gm, gc, kept, wiv, wb, wfresh))
  end
  put(gf, 'defer_at', fmt(at))
  redis.call('HSET', k_gate, unpack(gf))
  redis.call('HINCRBY', k_stats, 'deferred', 1)
  return {ANSWERED, '', 0, 0, 0, DEFERRED, at - now, reason, 0}
end

local newlog = nil
if tick == last then
  n = n + 1
else
  n = 1
  if k > 0 and head ~= '' then newlog = fmt(tick) .. ',' .. head elseif k > 0 then newlog = fmt(tick) end
end
last = tick
local m = math.floor(now / 60000000)
gc, gm = count_granted(k_stats, 1, m, gm, gc), m
log_grant(k_ticks, k_tags, tick, a_tag, p.tick_log, p.keep, p.tag_keep, now)
local untilv = math.max(tick, tonumber(defer_at) or 0) + p.keep
if untilv > kept then kept = keep_alive(kk, untilv, kept, 0, p.keep, p.tag_keep, now) end
put(gf, 'line', line_of(last, n, gm, gc, kept, wiv, wb, wfresh), 'vt', fmt(vt or tick))
if newlog then put(gf, 'log', newlog) end
redis.call('HSET', k_gate, unpack(gf))
for _, c in ipairs(p.quotas) do counter_add(k_counts, c, tick, 1, p.keep, now) end
if tiv > 0 then
  local k, t = scratch.total_keys, scratch.total
  k.total, k.slots, k.counts = k_total, k_slots, k_total_counts
  t.iv, t.ring, t.ts, t.counters, t.costly_until, t.run = tiv, tot.ring, ts, tot.quotas, nil, nil
  total_granted(k, t, tick, 1, p.keep, now)
end
return {ANSWERED, '', 0, 0, 0, GRANTED, tick - now, 0, tick}
`
