package shaper

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"fmt"
	"strconv"
	"strings"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/shaper-dev/shaper/internal/redisonce"
)

// deferReason says why a reservation was not granted.
type deferReason int

const (
	granted       deferReason = iota // not deferred
	beyondHorizon                    // the next free tick is further than the horizon: a backlog (the calls before took the ticks)
	inFlightFull                     // max_in_flight slots are all taken
	stateReset                       // the state was missing (first use or lost): waiting out the horizon
	behindHigh                       // a call of the high lane waits for a tick
	heldByLimit                      // a spent limit (a quota, a costly call's units) puts the earliest start beyond the horizon
	heldByPause                      // a pause puts the earliest start beyond the horizon
	newerLayout                      // the state was written in a newer layout than this version knows: nothing is granted until it is upgraded
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
	// tag is the tag the tick was recorded with (the asking call's
	// Request.Tag): the tick keeps it when it moves to another caller
	// (handOn), and a give-up or a refusal names it (see unsend).
	tag string
	// tolerance is a learned tolerance tighter than the policy's (0: none).
	tolerance time.Duration
	// gap is, after a margin lesson, the least gap between this call's
	// start and the start before it (0: starts are not stamped; see
	// startLua).
	gap time.Duration
	// server is the run_id of the server that answered, as the gate
	// passed it or the script read it (noServer: INFO refused).
	server string
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

// countersLua defines the counters every limit keeps (see limitSpec):
// at most rate units in any span (the limit's window + guard), counted
// in slots of width slot µs. In the hash key, field id..':'..j holds the
// units of the calls whose tick is in [j*slot, (j+1)*slot), id..':sum'
// their sum, id..':low' the oldest slot that may still count,
// id..':top' the newest written and id..':slot' the width they were
// written in. An edit that changes the width (the guard's) moves what
// was counted into the new slot of the old top's end, where it counts
// at least as long as it did; a counter of the previous release, named
// by the limit's place (pos), is taken over on first touch (see
// counter_adopt). A call counts until its slot's end has
// left the span, so a count errs on the safe side by at most one slot
// (1/limitSlots of the window), and the state is at most
// (span + horizon) / slot + 5 fields whatever the rate.
//
// parse_limits(spec) reads "kind:rate:span:slot:id,..." (see limitSpec:
// kind q a quota, c a spaced limit counted for every call, s one
// counted for calls above one unit).
//
// counters_in_use(all, spaced): the quotas of all, and its spaced limits
// when spaced is true.
//
// counter_adopt(key, c, old, now) moves counter old ({id, slot}: the
// previous release's, named by its place, or c before an edit of its
// slots' width) into c: each old slot's units into the slot of c that
// holds the old one's end, where they count at least as long as they
// did. Returns c's sum, low and top (nil: nothing to move).
//
// slot_fields(c, from, to): the field names of c's slots from..to.
//
// slots_in(key, c, from, to): the counted slots of c from from to to, as
// a list of {j, units} in order. A short range is read field by field; a
// long one (after an idle spell, or slots much shorter than the horizon)
// from the whole hash, whose fields are at most the grants of a span and
// a horizon.
//
// drop_slots(key, c, slots): deletes the fields of slots (a list of
// slots_in).
//
// counter_load(key, c, now, write) reads counter c and drops the slots no
// window ending at or after now holds (when write is true). Where
// counter_adopt is left out (counterAdoptLua, the counted grant), a
// counter it would adopt (none yet, or written in another slot width) is
// not read: it returns false. It reads the
// units of now's slot too (c.jn, c.jn_units), where a grant's tick
// usually falls: counter_add then writes them with the sum, in one
// command.
//
// counter_free_at(key, c, cost, now) is the earliest moment c admits
// cost more units: now when they fit, else when enough counted slots
// have left the span.
//
// counter_add(key, c, t, cost, keep, now) counts cost units at tick t;
// the key outlives the slot's end by keep. A tick in now's slot, not past
// the newest counted (the usual grant), is one HSET and no table.
//
// counter_fill(key, c, t, now) counts c as spent at t: what a lost state
// may have granted. The fill is kept apart (id..':fill') so that a count
// the vendor announces can replace it (see countUsedScript). It sets c.jn
// to nil: the units of now's slot may be gone, and counter_add adds to
// what the hash holds.
const countersLua = `
local counter_adopt = nil
local function parse_limits(spec)
  local out = {}
  for kind, rate, span, slot, id in string.gmatch(spec, '(%a):(%d+):(%d+):(%d+):([%w.]+)') do
    out[#out + 1] = {id = id, pos = tostring(#out + 1), kind = kind, rate = tonumber(rate), span = tonumber(span),
      slot = tonumber(slot), f_sum = id .. ':sum', f_low = id .. ':low', f_top = id .. ':top', f_slot = id .. ':slot'}
  end
  return out
end

local function counters_in_use(all, spaced)
  if spaced then return all end
  local out = {}
  for _, c in ipairs(all) do
    if c.kind == 'q' then out[#out + 1] = c end
  end
  return out
end

local function slot_fields(c, from, to)
  local f = {}
  for j = from, to do f[#f + 1] = c.id .. ':' .. fmt(j) end
  return f
end

local function slots_in(key, c, from, to)
  local out = {}
  if to < from then return out end
  if to - from <= 128 then
    local vals = redis.call('HMGET', key, unpack(slot_fields(c, from, to)))
    for i, v in ipairs(vals) do
      if v then out[#out + 1] = {from + i - 1, tonumber(v)} end
    end
    return out
  end
  local all = redis.call('HGETALL', key)
  local prefix = '^' .. c.id .. ':(%-?%d+)$'
  for i = 1, #all, 2 do
    local j = tonumber(string.match(all[i], prefix))
    if j and j >= from and j <= to then out[#out + 1] = {j, tonumber(all[i + 1])} end
  end
  table.sort(out, function(x, y) return x[1] < y[1] end)
  return out
end

local function drop_slots(key, c, slots)
  local f = {}
  for _, s in ipairs(slots) do f[#f + 1] = c.id .. ':' .. fmt(s[1]) end
  for i = 1, #f, 500 do redis.call('HDEL', key, unpack(f, i, math.min(i + 499, #f))) end
end

local function counter_load(key, c, now, write)
  local jn = math.floor(now / c.slot)
  if jn ~= c.jn or not c.f_jn then c.jn, c.f_jn = jn, c.id .. ':' .. fmt(jn) end
  local sum, low, top, units, slot = unpack(redis.call('HMGET', key, c.f_sum, c.f_low, c.f_top, c.f_jn, c.f_slot))
  slot = tonumber(slot)
  if write and not counter_adopt and (not sum or (slot and slot ~= c.slot)) then return false end
  if not sum and write then sum, low, top = counter_adopt(key, c, {id = c.pos, slot = c.slot}, now) end
  if slot and slot ~= c.slot and sum and write then
    sum, low, top = counter_adopt(key, c, {id = c.id, slot = slot}, now)
    units = nil
  end
  c.jn_units = tonumber(units) or 0
  c.sum = tonumber(sum) or 0
  c.top = tonumber(top)
  low = tonumber(low)
  local j0 = math.floor((now - c.span) / c.slot)
  c.low = j0
  if low == nil or c.top == nil then c.sum = 0 return end
  if low >= j0 then c.low = low return end
  local gone = slots_in(key, c, low, math.min(j0 - 1, c.top))
  if c.top < j0 then
    c.sum = 0
  else
    for _, s in ipairs(gone) do c.sum = c.sum - s[2] end
  end
  if write then
    drop_slots(key, c, gone)
    redis.call('HSET', key, c.id .. ':sum', c.sum, c.id .. ':low', fmt(j0))
  end
end

local function counter_free_at(key, c, cost, now)
  local need = c.sum + cost - c.rate
  if need <= 0 or c.top == nil then return now end
  for _, s in ipairs(slots_in(key, c, c.low, c.top)) do
    need = need - s[2]
    if need <= 0 then return (s[1] + 1) * c.slot + c.span end
  end
  return (c.top + 1) * c.slot + c.span
end

local function counter_add(key, c, t, cost, keep, now)
  local j = math.floor(t / c.slot)
  c.sum = c.sum + cost
  if j == c.jn and c.top ~= nil and j <= c.top then
    c.jn_units = c.jn_units + cost
    return redis.call('HSET', key, c.f_sum, c.sum, c.f_jn, c.jn_units)
  end
  local f = {c.f_sum, c.sum}
  if j == c.jn then
    c.jn_units = c.jn_units + cost
    f[3], f[4] = c.f_jn, c.jn_units
  else
    redis.call('HINCRBY', key, c.id .. ':' .. fmt(j), cost)
  end
  if c.top == nil or j > c.top then
    c.top = j
    f[#f + 1] = c.f_low
    f[#f + 1] = fmt(c.low)
    f[#f + 1], f[#f + 2], f[#f + 3], f[#f + 4] = c.f_top, fmt(j), c.f_slot, c.slot
    redis.call('HSET', key, unpack(f))
    extend(key, (j + 1) * c.slot + keep, now)
  else
    redis.call('HSET', key, unpack(f))
  end
end
`

// counterAdoptLua defines counter_adopt (see countersLua), which the
// counted grant leaves out: a counter to adopt hands its call to the full
// grant (counter_load returns false).
const counterAdoptLua = `
counter_adopt = function(key, c, old, now)
  local sum, low, top = unpack(redis.call('HMGET', key, old.id .. ':sum', old.id .. ':low', old.id .. ':top'))
  if not (sum and low and top) then return nil end
  top = tonumber(top)
  low = math.max(tonumber(low), top - 4096)
  local names, moved, f = {}, {}, {}
  for j = low, top do names[#names + 1] = old.id .. ':' .. fmt(j) end
  local units = redis.call('HMGET', key, unpack(names))
  for _, name in ipairs({'sum', 'low', 'top', 'fill', 'fill_j', 'slot'}) do names[#names + 1] = old.id .. ':' .. name end
  for i = 1, #names, 500 do redis.call('HDEL', key, unpack(names, i, math.min(i + 499, #names))) end
  local first, last = nil, math.floor(((top + 1) * old.slot - 1) / c.slot)
  for i, u in ipairs(units) do
    if u then
      local j = math.floor(((low + i) * old.slot - 1) / c.slot)
      moved[j], first = (moved[j] or 0) + tonumber(u), first or j
    end
  end
  if not first then first, moved[last] = last, tonumber(sum) end
  for j, u in pairs(moved) do f[#f + 1], f[#f + 2] = c.id .. ':' .. fmt(j), u end
  redis.call('HSET', key, c.id .. ':sum', sum, c.id .. ':low', fmt(first), c.id .. ':top', fmt(last), c.id .. ':slot', c.slot,
    unpack(f))
  return sum, fmt(first), fmt(last)
end
`

// counterFillLua defines counter_fill (see countersLua): what the full
// grant's recovery counts as spent.
const counterFillLua = `
local function counter_fill(key, c, t, now)
  local j = math.floor(t / c.slot)
  c.jn = nil
  if c.top then drop_slots(key, c, slots_in(key, c, c.low, c.top)) end
  c.low = math.floor((now - c.span) / c.slot)
  c.sum, c.top, c.fill = c.rate, j, c.rate
  redis.call('HSET', key, c.id .. ':' .. fmt(j), c.rate, c.id .. ':sum', c.rate, c.id .. ':low', fmt(c.low),
    c.id .. ':top', fmt(j), c.id .. ':fill', c.rate, c.id .. ':fill_j', fmt(j), c.id .. ':slot', c.slot)
  extend(key, (j + 1) * c.slot + c.span, now)
end
`

// reserveKeyNames names the reserve script's KEYS, in order: the
// script binds each to a local k_<name>, and bucketKeys.reserve returns
// them in this order (TestScriptBindings keeps the three equal).
var reserveKeyNames = []string{"gate", "control", "stats", "inflight", "epoch", "expiry", "total",
	"asking", "rates", "slots", "ticks", "counts", "total_counts", "tags", "old_ticks"}

// reserveArgs is what a grant of one call says to the reserve scripts:
// the full one takes it as fullArgs, the counted one as countedArgs.
type reserveArgs struct {
	Now         int64  // Redis time override (µs; 0: TIME)
	Interval    int64  // tick interval (µs) of the caller's policy
	Burst       int    // units per tick of the caller's policy
	Horizon     int64  // µs: no tick is reserved further ahead
	MaxInFlight int    // 0: no cap
	LeaseTTL    int64  // µs, counted from the tick
	Lease       string // lease id ("" without a cap)
	Span        int64  // the primary limit's window + guard (µs)
	ReplicaLive int64  // µs: configured ticks older than this do not count
	Keep        int64  // µs the state outlives its last tick
	Member      string // the bucket's name in its group ("" for a group of one)
	// The group's total ("" and zeros without one).
	TotalInterval int64 // µs
	TotalBurst    int
	TotalSpan     int64   // its primary window + guard (µs)
	TotalRate     float64 // calls per total window
	OwnRate       float64 // the bucket's own rate per total window
	Ring          int64   // slots of the total's ring bitmap (0: a line of ticks)
	LogLen        int64   // ticks kept in the bucket's log (0: none)
	Rate          float64 // the configured primary rate
	RaiseStep     float64 // see raiseLua
	Quiet         int64   // µs, see raiseLua
	Probe         int64   // µs, see raiseLua
	TickLog       int     // length of the ticks list (0: keep none)
	Window        int64   // the primary limit's window (µs)
	Warmup        int64   // µs; 0: none
	WarmupFrom    float64 // calls per primary window
	Cost          int     // units the call uses of every limit
	High          bool    // the call is in the high lane
	Limits        string  // the bucket's limits (limitSpec)
	TotalLimits   string  // the total's limits (limitSpec; "" without one)
	Recheck       int64   // quiet time (µs) before a learned rate probes toward est_hi (Adapt.Recheck windows)
	Ceiling       float64 // see raiseLua (Adapt.Ceiling)
	Tag           string  // the call's tag (Request.Tag; "": none)
	TagKeep       int64   // µs a tag outlives its tick in the record
	Server        string  // the server's run_id as the gate knows it ("": ask INFO; noServer: unknown)
}

// fullArgs are the full reserve script's ARGV, in order
// (TestScriptBindings). What the bucket's policy and its group's total
// say comes in two strings (see cacheLua).
type fullArgs struct {
	Now    int64  `lua:"now"`    // Redis time override (µs; 0: TIME)
	Server string `lua:"server"` // the server's run_id as the gate knows it ("": ask INFO; noServer: unknown)
	Tag    string `lua:"tag"`    // the call's tag (Request.Tag; "": none)
	Member string `lua:"member"` // the bucket's name in its group ("" for a group of one)
	Mine   string `lua:"mine"`   // the caller's tick as widest keeps it (Bucket.mine)
	Cost   int    `lua:"cost"`   // units the call uses of every limit
	High   bool   `lua:"high"`   // the call is in the high lane
	Lease  string `lua:"lease"`  // lease id ("" without a cap)
	// Policy is "interval|burst|horizon|max_in_flight|lease_ttl|span|
	// replica_live|keep|log_len|rate|raise_step|quiet|probe|recheck|
	// ceiling|tick_log|window|warmup|warmup_from|tag_keep|limits", the
	// fields of reserveArgs of those names.
	Policy string `lua:"policy"`
	// Total is "interval|burst|span|rate|own_rate|ring|limits", the
	// group's total (reserveArgs' Total* fields, OwnRate and Ring; "":
	// none).
	Total string `lua:"total"`
}

// argv returns the arguments in the order of the struct's fields.
func (a fullArgs) argv() []any {
	high := 0
	if a.High {
		high = 1
	}
	return []any{a.Now, a.Server, a.Tag, a.Member, a.Mine, a.Cost, high, a.Lease, a.Policy, a.Total}
}

// full builds the full script's arguments; mine is the caller's tick as
// widest keeps it.
func (a reserveArgs) full(mine string) fullArgs {
	num := func(v int64) string { return strconv.FormatInt(v, 10) }
	policy := strings.Join([]string{num(a.Interval), strconv.Itoa(a.Burst), num(a.Horizon), strconv.Itoa(a.MaxInFlight),
		num(a.LeaseTTL), num(a.Span), num(a.ReplicaLive), num(a.Keep), num(a.LogLen), redisFloat(a.Rate), redisFloat(a.RaiseStep),
		num(a.Quiet), num(a.Probe), num(a.Recheck), redisFloat(a.Ceiling), strconv.Itoa(a.TickLog), num(a.Window), num(a.Warmup),
		redisFloat(a.WarmupFrom), num(a.TagKeep), a.Limits}, "|")
	var total string
	if a.TotalInterval > 0 {
		total = strings.Join([]string{num(a.TotalInterval), strconv.Itoa(a.TotalBurst), num(a.TotalSpan), redisFloat(a.TotalRate),
			redisFloat(a.OwnRate), num(a.Ring), a.TotalLimits}, "|")
	}
	return fullArgs{Now: a.Now, Server: a.Server, Tag: a.Tag, Member: a.Member, Mine: mine, Cost: a.Cost, High: a.High,
		Lease: a.Lease, Policy: policy, Total: total}
}

// redisFloat is v as go-redis sends a float64 argument.
func redisFloat(v float64) string { return strconv.FormatFloat(v, 'f', -1, 64) }

// reserveFunction reserves the next tick of one call, of its bucket and of
// its group's total when it has one. The model: a bucket has limits, each
// spaced (its calls one tick apart, the tick from the spaced limits, see
// tickFor) or a quota (counted, see countersLua); a call starts at the
// earliest tick every limit of its bucket and of its total admits its
// cost at. Each step below is one function; the main part at the end
// calls them in order.
//
// It replies as every grant (see replyHeader), for one call, and never
// hands it over; the server in its reply is the run_id it read by INFO
// when the gate did not know it (noServer where INFO is refused). A
// tolerance comes back when a margin was learned (see Control.Refused).
//
// It runs as a Redis function where the server has them (see
// functions.go): its steps, defined before the bindings, are then
// defined once, when the library is loaded, not on every grant.
var reserveFunction = newFunction("reserve", codesLua+fmtLua+nowFromLua+rollLua+spacingLua+extendLua+raiseLua+countersLua+counterAdoptLua+counterFillLua+
	lineFieldLua+runOfLua+totalStateLua+totalSaveLua+totalAdoptLua+heldLua+itemLua+convertLua+lineLua+ringLua+groupLua+fairShareLua+cacheLua+reserveStepsLua+reserveLimitsLua+fullPolicyLua, reserveLua)

// reserveStepsLua, reserveLimitsLua and fullPolicyLua define the steps
// of the full reserve script that only it takes (see groupLua for those
// it shares with the counted one); reserveStepsLua those of the tick and
// the state: adaptation, the server, a lost state, warm-up. Each step of
// the model is a function of its inputs, defined in the library so that
// a call creates no closure over them.
//
// newer_layout(run): whether a hash's run is tagged with a newer layout
// than this version's (l<N>:, N above LAYOUT, the Go layout; see
// run_of): such a state may count what this version cannot read.
//
// adapted_tick(key, ctl, interval, burst, now, raise, span, window): what
// adaptation set (a lowered or learned rate, a learned guard from
// refusals at the full rate: network jitter, a vendor that enforces
// spacing) widens the tick. ctl holds the control hash's fields by name.
// Returns the tick and the adapted rate (nil: the configured one).
//
// server(k_epoch, known, keep, now): which Redis server this is and
// whether it changed. A state written by another server than this one (a
// replica promoted by a failover, a restart from a snapshot or an
// append-only file) may be a stale copy that lacks the last ticks the old
// server granted: it counts as lost. The server is told by its run_id
// (new for every server process): known, as the gate passes it (see
// server.go), or "" to read it from INFO server. It is kept with the
// epoch ("run_id|switched_at") and with each state ("run"). For keep
// after a switch, a missing state counts as lost as well (it may never
// have reached this server). Where INFO is not allowed, runid is "" and
// only missing states are detected. The epoch is set once per group: a
// state missing while it exists expired after idle or was lost (the
// expiry set tells which); with the epoch missing too, this is a first
// start or Redis lost everything: a gate that passed another server's
// run_id granted on that one, and the loss is a switch as above (every
// missing state of the group counts as lost for keep, the loss certain);
// else it cannot be told from a first start, and the loss is uncertain
// (see lost_at and UNSURE). What the gate knows is checked against INFO
// whenever it is not what the epoch says (a first start, a loss, a switch
// the gate has not seen yet): an epoch is never written from a run_id
// INFO did not give. Returns the run_id as the gate should know it
// (noServer where INFO is refused), then runid, epoch, switched.
//
// lost_at(st, last, epoch, switched, runid, k_expiry, member, horizon,
// span, now): where the next tick of a lost state comes (nil: not lost),
// and whether the loss is certain (a known server switched, or the state
// is missing while the group says it should be there). st is the gate
// hash. A group found without its epoch is new, or Redis lost everything
// and cannot say so: every state of the group missing within horizon +
// span (its longest spaced window) counts as lost, uncertain (quotas
// keep what they hold): no account is granted beside ticks a lost state
// handed out (TestOwnRedisRestartLosesEveryAccount), and all start a
// horizon after the epoch, as the first. The expiry set holds until
// when (that + span), as UNSURE, a name no bucket can have. In order:
// a state another version of shaper wrote on this server (the run_id is
// this server's, the layout's tag another) may not read here, so its
// ticks reach at most now + horizon, as a stale copy's; but the counters
// are this server's and kept their layout: the loss is not certain, and
// the quotas keep what they counted. A state holding a plan and no tick
// yet (calls planned, none granted) lost nothing, unless the group lost
// its epoch with it. A stale copy (last ~= nil, another run): the ticks
// it lacks reach at most now + horizon.
//
// log_at(l, k, span): the log of a state reset at l, its last k ticks as
// if spaced at the bucket's pace up to l, so that the next come at that
// pace.
//
// note_wide(k_gate, line, wide, wide_at, wiv, wb, wfresh): 'wide' and
// 'wide_at' as widest left them, and the line (when it reads) with the
// widest tick's entry (see wide_entry).
//
// warm_since(k_gate, had_state, warm, last, paused, pfrom, window, now):
// the moment a warm-up ramp started (nil: none): when the bucket starts
// after being idle longer than its window (its state gone, or a pause
// that long ending). Without a state, the ramp starts at the line's last
// tick, else now (warm = last or now): a lost state's first tick waits
// the horizon.
//
// warm_tick(k_gate, st, last, paused, ctl, p, rate, lguard, interval,
// burst, now): the tick while a warm-up ramp runs (see warm_since), from
// p.warmup_from to the rate over p.warmup.
var reserveStepsLua = `
local LAYOUT = ` + strconv.Itoa(layout) + `
local function newer_layout(run)
  local v = string.match(run or '', '^l(%d+):')
  return v ~= nil and tonumber(v) > LAYOUT
end
local function adapted_tick(key, ctl, interval, burst, now, raise, span, window)
  local cfg = raise.cfg
  local rate = tonumber(ctl.rate)
  if rate and ctl.rate_source == 'learned' then
    local r = raise_rate(key, now, raise)
    if r == 0 then rate = nil elseif r then rate = r end
  end
  if rate and rate > 0 then
    local iv, b = spacing(rate, burst, span)
    interval = math.max(interval, iv)
    burst = b
  end
  local lguard = tonumber(ctl.guard)
  if lguard and lguard > 0 then
    local iv, b = spacing(rate or cfg, burst, window + lguard)
    interval = math.max(interval, iv)
    burst = b
  end
  return interval, burst, rate
end

local function server(k_epoch, known, keep, now)
  local passed = known
  local ep = redis.call('GET', k_epoch)
  local erun, eat = string.match(ep or '', '^(%w+)|(%d+)$')
  if known == '' or not ep or (known ~= NO_SERVER and erun ~= known) then
    known = NO_SERVER
    local info = redis.pcall('INFO', 'server')
    if type(info) == 'string' then known = string.match(info, 'run_id:(%w+)') or NO_SERVER end
  end
  local runid = known == NO_SERVER and '' or known
  local epoch = ep ~= false
  local switched = false
  if runid ~= '' then
    if not epoch and passed ~= '' and passed ~= NO_SERVER and passed ~= runid then
      switched = true
      redis.call('SET', k_epoch, runid .. '|' .. fmt(now))
    elseif not epoch then
      redis.call('SET', k_epoch, runid .. '|0')
    elseif erun ~= runid then
      switched = true
      redis.call('SET', k_epoch, runid .. '|' .. fmt(now))
    elseif now - tonumber(eat) < keep then
      switched = true
    end
  elseif not epoch then
    redis.call('SET', k_epoch, fmt(now))
  end
  return known, runid, epoch, switched
end

local UNSURE = '{epoch}'
local function lost_at(st, last, epoch, switched, runid, k_expiry, member, horizon, span, now)
  if st.line and st.run and st.run ~= run_of(runid) and string.match(st.run, '(%w*)$') == runid then
    if st.run == PREVIOUS_LAYOUT .. runid then return nil, false end
    return math.max(last or 0, now + horizon), false
  end
  if last == nil and (st.plan == false or not epoch or switched) then
    local exp = tonumber(redis.call('ZSCORE', k_expiry, member))
    if not epoch then redis.call('ZADD', k_expiry, now + span + horizon, UNSURE) end
    if not epoch or switched or (exp and exp > now) then
      return now + horizon, switched or (epoch and exp ~= nil and exp > now)
    end
    local unsure = tonumber(redis.call('ZSCORE', k_expiry, UNSURE))
    if unsure and unsure > now then return math.max(unsure - span, now), false end
  elseif last ~= nil and runid ~= '' and st.run ~= run_of(runid) then
    return math.max(last, now + horizon), true
  end
  return nil, false
end

local function log_at(l, k, span)
  if k <= 0 then return '' end
  local pace = math.ceil(span / k)
  local parts = {}
  for i = 1, k do parts[i] = fmt(l - (i - 1) * pace) end
  return table.concat(parts, ',')
end

local function note_wide(k_gate, line, wide, wide_at, wiv, wb, wfresh)
  local fields = {'wide', wide, 'wide_at', fmt(wide_at)}
  local l, n, gm, gc, kept = read_line(line)
  if l then put(fields, 'line', line_of(l, n, gm, gc, kept, wiv, wb, wfresh)) end
  redis.call('HSET', k_gate, unpack(fields))
end

local function warm_since(k_gate, had_state, warm, last, paused, pfrom, window, now)
  if not had_state and warm == nil then
    warm = last or now
    redis.call('HSET', k_gate, 'warm', fmt(warm))
  end
  if paused > 0 and pfrom and paused - pfrom > window and (warm or 0) < paused then
    warm = paused
    redis.call('HSET', k_gate, 'warm', fmt(warm))
  end
  return warm
end

local function warm_tick(k_gate, st, last, paused, ctl, p, rate, lguard, interval, burst, now)
  local warm = warm_since(k_gate, st.line ~= false, tonumber(st.warm), last, paused, tonumber(ctl.pause_from), p.window, now)
  if not warm or now - warm >= p.warmup then return interval, burst end
  local top = rate or p.rate
  local from = math.min(p.warmup_from, top)
  local r = from + (top - from) * math.max(now - warm, 0) / p.warmup
  local span = p.span
  if lguard and lguard > 0 then span = math.max(span, p.window + lguard) end
  local iv, b = spacing(r, burst, span)
  return math.max(interval, iv), math.min(burst, b)
end
`

// reserveLimitsLua defines the full script's steps for its limits: the
// spaced counters a costly call puts in use, the counters' earliest
// start, the in-flight lease, the total's line of ticks.
//
// spaced_span(cs): how long a call stays in the spaced counters of cs.
//
// counted_spaced(key, cs, costly_until, l, now): at the first call of
// more than one unit after calls of one unit only (costly_until past),
// the spaced counters of cs did not count those calls: count each as
// spent up to l, the last tick granted (nothing when that is a window
// ago), and return until when the counters are in use from now on (nil:
// they were), for the caller to write (the gate hash's costly_until, or
// the total's), so that the next costly call, granted or not, does not
// count them as spent again.
//
// counters_start(k_counts, own, k_total_counts, totals, cost, from,
// now): the earliest start at or after from every counter in use admits
// cost more units at, and whether the bucket's line charges a tick's
// units (a spaced limit without a guard is kept by the spacing alone for
// calls of one unit, and not counted for them).
//
// leased(k_inflight, cap, ttl, lease, tick, now): the call's in-flight
// lease, until ttl after its tick, unless cap leases are live.
//
// total_line(k, ts, t, epoch, switched, runid, totals, horizon, keep,
// now): the total's line of ticks, one total interval apart: its last
// tick, the calls on it, and the tick before which none may come
// (blocked), and whether it was reset. In slot mode (ring > 0) the ticks
// are slots of a ring bitmap over the horizon, so that a bucket's tick
// can take any free slot and ticks reserved ahead by other buckets leave
// no unused gaps; otherwise (very high totals) a line, like a bucket's.
// Lost with the group, or a stale copy, the total's ticks reach at most
// now + horizon (a copy is stale when its run is not run_of this
// server's). k holds the keys (total, slots, counts), ts the total's
// numbers and run (read_total: a reset or a cleared slot saved there),
// t its policy.
const reserveLimitsLua = `
local function spaced_span(cs)
  local w = 0
  for _, c in ipairs(cs) do
    if c.kind ~= 'q' then w = math.max(w, c.span + c.slot) end
  end
  return w
end

local function counted_spaced(key, cs, costly_until, l, now)
  if costly_until > now then return nil end
  local untilv = math.max(l or now, now) + spaced_span(cs)
  if l == nil then return untilv end
  for _, c in ipairs(cs) do
    if c.kind ~= 'q' and l + c.span + c.slot > now then counter_fill(key, c, l, now) end
  end
  return untilv
end

local function counters_start(k_counts, own, k_total_counts, totals, cost, from, now)
  local charge = false
  for _, c in ipairs(own) do
    if c.kind ~= 's' or cost > 1 then from = math.max(from, counter_free_at(k_counts, c, cost, now)) end
    if c.kind == 's' then charge = true end
  end
  for _, c in ipairs(totals) do
    if c.kind ~= 's' or cost > 1 then from = math.max(from, counter_free_at(k_total_counts, c, cost, now)) end
  end
  return from, charge
end

local function leased(k_inflight, cap, ttl, lease, tick, now)
  redis.call('ZREMRANGEBYSCORE', k_inflight, '-inf', fmt(now))
  if redis.call('ZCARD', k_inflight) >= cap then return false end
  redis.call('ZADD', k_inflight, fmt(tick + ttl), lease)
  extend(k_inflight, tick + ttl, now)
  return true
end

local function total_line(k, ts, t, epoch, switched, runid, totals, horizon, keep, now)
  local tlast, tn, blocked = ts.last, ts.n or 0, ts.blocked or 0
  local stale = runid ~= '' and ts.run ~= run_of(runid) and (tlast ~= nil or switched)
  local reset = not epoch or stale
  if reset then
    blocked = math.max(blocked, now + horizon)
    redis.call('DEL', k.slots)
    ts.blocked = blocked
    save_total(k.total, ts, run_of(runid))
    if tlast == nil then tlast, tn = blocked, t.burst end
    for _, c in ipairs(totals) do
      if c.kind ~= 'q' or stale then counter_fill(k.counts, c, blocked, now) end
    end
  end
  if t.ring > 0 then
    ts.cleared = ring_cleared(k.slots, t.ring, t.interval, ts.cleared, ts.kept or 0, keep, now)
    save_total(k.total, ts)
  end
  return tlast, tn, blocked, reset
end
`

// fullPolicyLua defines full_policy and total_policy: fullArgs' Policy
// and Total as tables.
const fullPolicyLua = `
local function parse_full(s)
  local iv, b, horizon, cap, ttl, span, live, keep, log_len, rate, step, quiet, probe, recheck, ceiling, tick_log, window,
    warmup, warmup_from, tag_keep, limits = string.match(s, '^' .. string.rep('([^|]*)|', 20) .. '(.*)$')
  rate = tonumber(rate)
  return {interval = iv + 0, burst = b + 0, horizon = horizon + 0, max_in_flight = cap + 0, lease_ttl = ttl + 0, span = span + 0,
    live = live + 0, keep = keep + 0, log_len = log_len + 0, rate = rate, tick_log = tick_log + 0, window = window + 0,
    warmup = warmup + 0, warmup_from = tonumber(warmup_from), tag_keep = tag_keep + 0, limits = parse_limits(limits),
    raise = {cfg = rate, step = tonumber(step), quiet = quiet + 0, probe = probe + 0, recheck = recheck + 0, ceiling = tonumber(ceiling)}}
end
local function parse_total(s)
  local iv, b, span, rate, own, ring, limits = string.match(s, '^' .. string.rep('([^|]*)|', 6) .. '(.*)$')
  return {interval = iv + 0, burst = b + 0, span = span + 0, rate = tonumber(rate), own_rate = own, ring = ring + 0,
    limits = parse_limits(limits)}
end
local function full_policy(s) return cached(s, parse_full) end
local function total_policy(s)
  if s == '' then return nil end
  return cached(s, parse_total)
end
`

// reserveLua is the full reserve script's main part: it binds KEYS
// (reserveKeyNames) to locals k_* and ARGV (fullArgs) to locals a_*,
// parses the policy (p) and the total (t, nil without one), and calls the
// steps in order:
//
//  1. The tick (interval, burst): the widest live one (see widest),
//     widened by adaptation (adapted_tick) and the fair share (fair, see
//     fair_pace). Hash fields are read by name into st (the gate hash)
//     and ts (the total's hash), false when not set. A state a newer
//     shaper wrote (newer_layout) may count what this one cannot read:
//     nothing of it is granted or written here; its calls wait a horizon
//     (NEWER_LAYOUT). The control hash (ctl) is read under the gate
//     hash's mark (st.adapted, see adaptedLua), and for a state made
//     anew, which gets the mark again if it applies.
//  2. The state (server, read_line), and whether it was lost. The
//     counters in use (own, totals): every quota's, and the spaced
//     limits' while calls of more than one unit come (costly_until: a
//     span after the last one); see counted_spaced. A call of more than
//     one unit sets the gate hash's mark: the core script reads
//     costly_until only under it. A lost state's next tick comes at l
//     (lost_at; the old one may have granted ticks up to there), its log
//     rebuilt to match, every spaced counter spent up to l, and each
//     quota spent for its window when the loss is certain: what the old
//     state granted is unknown. keep_line(untilv, tag_keep), a local
//     function: keep_alive, and the line's kept with what it extended
//     the keys to (a state without a line: its next call extends them).
//  3. Warm-up (warm_tick): the rate ramps from warmup_from to the rate
//     over warmup.
//  4. The total's line of ticks (see total_line).
//  5. Lanes: while a high call waits for a tick (hi_until), normal calls
//     step aside.
//  6. The counters: the earliest start the pause and the counters allow
//     (start, see counters_start).
//  7. The earliest tick every line admits (tick, see fit). In a group
//     with a total, a bucket keeps its own pace: a virtual time vt one
//     pace apart per unit (its fair share's interval, or its own), rather
//     than spacing from its actual ticks, so that a tick the total pushed
//     later does not slow it down further; its own limit then holds by
//     the log of its last ticks (logged), used while nothing (a lowered
//     rate, a slower replica) widened the tick. A bucket held to its fair
//     share reserves only half a horizon ahead (horizon), so that buckets
//     below their share (which keep the whole horizon) find the total's
//     slots they need before the others take them.
//  8. Beyond the horizon, or at the in-flight cap (leased): come back
//     later, each deferred caller one tick after the one before in its
//     lane (defer_at, hdefer_at), so that a crowd beyond the horizon
//     polls once per tick in the order it arrived. At the cap the gate
//     hash may be new (its 'wide'): it expires as after a grant
//     (keep_line).
//  9. Grant: the bucket's state (the line, and the local log: the log
//     after this tick, nil to leave it as it was), the total's, the
//     counters, the ticks list, the call's tag (see Bucket.tagged). A margin lesson in force (tol):
//     the call stamps its start (see startLua), apart from the start
//     before it by the gap Go makes of the spacing without the guard
//     (bare, see startGap).
const reserveLua = `
local k_gate = KEYS[1]
local k_control = KEYS[2]
local k_stats = KEYS[3]
local k_inflight = KEYS[4]
local k_epoch = KEYS[5]
local k_expiry = KEYS[6]
local k_total = KEYS[7]
local k_asking = KEYS[8]
local k_rates = KEYS[9]
local k_slots = KEYS[10]
local k_ticks = KEYS[11]
local k_counts = KEYS[12]
local k_total_counts = KEYS[13]
local k_tags = KEYS[14]
local k_old_ticks = KEYS[15]
local a_now = ARGV[1] + 0
local a_server = ARGV[2]
local a_tag = ARGV[3]
local a_member = ARGV[4]
local a_mine = ARGV[5]
local a_cost = ARGV[6] + 0
local a_high = ARGV[7] == '1'
local a_lease = ARGV[8]
local a_policy = ARGV[9]
local a_total = ARGV[10]
local p = full_policy(a_policy)
local t = total_policy(a_total)
local keys = {gate = k_gate, control = k_control, ticks = k_ticks, expiry = k_expiry, tags = k_tags, member = a_member}
local now = now_from(a_now)
local tiv = t and t.interval or 0

local st = {}
st.line, st.defer_at, st.vt, st.log, st.plan, st.warm, st.run, st.hi_until, st.hdefer_at, st.costly_until,
  st.wide, st.wide_at, st.adapted, st.asked_at, st.asked_rate = unpack(redis.call('HMGET', k_gate, 'line',
  'defer_at', 'vt', 'log', 'plan', 'warm', 'run', 'hi_until', 'hdefer_at', 'costly_until', 'wide', 'wide_at', 'adapted',
  'asked_at', 'asked_rate'))
local ts = {}
if tiv > 0 then
  local tl
  ts.run, tl = unpack(redis.call('HMGET', k_total, 'run', 'tl'))
  if not tl and ts.run and not string.find(ts.run, '^l%d+:') then tl, ts.run = total_adopt(k_total, ts.run), run_of(ts.run) end
  read_total(tl, ts)
end
if newer_layout(st.run) or newer_layout(ts.run) then
  return {ANSWERED, '', 0, 0, 0, DEFERRED, p.horizon, NEWER_LAYOUT, 0}
end
local interval, burst, wide_new, wide_at_new = widest(st.wide, st.wide_at, a_mine, p.interval, p.burst, p.live, now)
local wiv, wb, wfresh = wide_entry(st.wide, st.wide_at, wide_at_new, p.interval, p.burst, p.live)
if wide_at_new then note_wide(k_gate, st.line, wide_new or st.wide, wide_at_new, wiv, wb, wfresh) end
local ctl = {}
if st.adapted or not st.line then
  ctl.paused_until, ctl.rate, ctl.rate_source, ctl.guard, ctl.tol, ctl.pause_from = unpack(redis.call('HMGET', k_control,
    'paused_until', 'rate', 'rate_source', 'guard', 'tol', 'pause_from'))
end
local rate
interval, burst, rate = adapted_tick(k_control, ctl, interval, burst, now, p.raise, p.span, p.window)
local paused = tonumber(ctl.paused_until) or 0
local lguard = tonumber(ctl.guard)
if not st.adapted and (paused > now or ctl.rate or lguard or ctl.tol) then redis.call('HSET', k_gate, 'adapted', '1') end
local fair = 0
if tiv > 0 and a_member ~= '' then
  local asked
  fair, asked = fair_pace({total = k_total, asking = k_asking, rates = k_rates}, {member = a_member, own = t.own_rate,
    rate = t.rate, span = t.span, horizon = p.horizon, keep = p.keep, asked_at = st.asked_at,
    asked_rate = st.asked_rate, share = ts.share, share_at = ts.share_at, ts = ts}, interval, now)
  if asked then redis.call('HSET', k_gate, 'asked_at', fmt(now), 'asked_rate', t.own_rate) end
end

local known, runid, epoch, switched = server(k_epoch, a_server, p.keep, now)
if k_ticks == k_tags and st.run ~= run_of(runid) then convert_tags(k_tags, k_old_ticks, p.keep, now) end
local last, n, gm, gc, kept = read_line(st.line)
local m = math.floor(now / 60000000)
local logs, reason = st.log, BEYOND_HORIZON
local own = counters_in_use(p.limits, a_cost > 1 or (tonumber(st.costly_until) or 0) > now)
local totals = {}
local total_costly = ts.costly_until or 0
if tiv > 0 then totals = counters_in_use(t.limits, a_cost > 1 or total_costly > now) end
for _, c in ipairs(own) do counter_load(k_counts, c, now, true) end
for _, c in ipairs(totals) do counter_load(k_total_counts, c, now, true) end
if a_cost > 1 then
  redis.call('HSET', k_gate, 'adapted', '1')
  local own_until = counted_spaced(k_counts, own, tonumber(st.costly_until) or 0, last, now)
  if own_until then redis.call('HSET', k_gate, 'costly_until', fmt(own_until)) end
  local total_until = tiv > 0 and counted_spaced(k_total_counts, totals, total_costly, ts.last, now)
  if total_until then ts.costly_until = total_until save_total(k_total, ts) end
end
local lost, certain = lost_at(st, last, epoch, switched, runid, k_expiry, a_member, p.horizon, spaced_span(p.limits), now)
if lost then
  last, n, reason, logs = lost, burst, STATE_RESET, log_at(lost, p.log_len, p.span)
  redis.call('HSET', k_gate, 'line', line_of(last, n, gm or m, gc, kept, wiv, wb, wfresh), 'run', run_of(runid), 'log', logs)
  redis.call('HINCRBY', k_stats, 'resets', 1)
  for _, c in ipairs(own) do
    if c.kind ~= 'q' or certain then counter_fill(k_counts, c, lost, now) end
  end
end

local function keep_line(untilv, tag_keep)
  local ext = keep_alive(keys, untilv, kept, paused, p.keep, tag_keep, now)
  if ext and last then
    kept = ext
    redis.call('HSET', k_gate, 'line', line_of(last, n, gm or m, gc, kept, wiv, wb, wfresh))
  end
end

if p.warmup > 0 then interval, burst = warm_tick(k_gate, st, last, paused, ctl, p, rate, lguard, interval, burst, now) end

local tlast, tn, blocked = nil, 0, 0
if tiv > 0 then
  local reset
  tlast, tn, blocked, reset = total_line({total = k_total, slots = k_slots, counts = k_total_counts}, ts, t, epoch, switched,
    runid, totals, p.horizon, p.keep, now)
  if reset then reason = STATE_RESET end
end

local hi_until = tonumber(st.hi_until) or 0
if not a_high and hi_until > now then
  redis.call('HINCRBY', k_stats, 'deferred', 1)
  return {ANSWERED, known, 0, 0, 0, DEFERRED, math.min(hi_until - now, math.max(interval, 5000)), BEHIND_HIGH, 0}
end

local start, charge = counters_start(k_counts, own, k_total_counts, totals, a_cost, math.max(now, paused), now)

local tick = start
local k, kth, head = p.log_len, nil, ''
if k > 0 and interval == p.interval and burst == p.burst then kth, head = log_cut(logs or '', k) else k = 0 end
local vt = nil
if tiv > 0 then
  local pace = math.max(math.floor(interval / burst), fair)
  vt = math.max(now, (tonumber(st.vt) or 0) + pace)
  tick = math.max(tick, vt)
  vt = vt + pace * (a_cost - 1)
end
local horizon = p.horizon
if fair > 0 and fair >= math.floor(interval / burst) then horizon = math.floor(horizon / 2) end
tick = fit({last = last, n = n, interval = interval, burst = burst, cost = a_cost, charge = charge, k = k, kth = kth, span = p.span},
  {iv = tiv, burst = t and t.burst, last = tlast, n = tn, blocked = blocked, ring = t and t.ring, slots = k_slots, horizon = horizon,
    now = now}, tick)

if tick - now > horizon then
  if reason == BEYOND_HORIZON and start - now > horizon then
    reason = HELD_BY_LIMIT
    if paused >= start then reason = HELD_BY_PAUSE end
  end
  local field, prev = 'defer_at', st.defer_at
  if a_high then field, prev = 'hdefer_at', st.hdefer_at end
  local at = math.max(tick - horizon, (tonumber(prev) or 0) + math.floor(interval / burst))
  redis.call('HSET', k_gate, field, fmt(at))
  if a_high then redis.call('HSET', k_gate, 'hi_until', fmt(at + 2 * interval), 'adapted', '1') end
  keep_line(math.max(at, last or 0) + p.keep, 0)
  redis.call('HINCRBY', k_stats, 'deferred', 1)
  return {ANSWERED, known, 0, 0, 0, DEFERRED, at - now, reason, 0}
end
if p.max_in_flight > 0 and not leased(k_inflight, p.max_in_flight, p.lease_ttl, a_lease, tick, now) then
  keep_line(math.max(last or now, now) + p.keep, 0)
  redis.call('HINCRBY', k_stats, 'deferred', 1)
  return {ANSWERED, known, 0, 0, 0, DEFERRED, math.max(interval, 5000), IN_FLIGHT_FULL, 0}
end

local log = nil
if tick == last then
  n = n + a_cost
else
  n = a_cost
  if k > 0 and head ~= '' then log = fmt(tick) .. ',' .. head elseif k > 0 then log = fmt(tick) end
end
last, gc, gm = tick, count_granted(k_stats, 1, m, gm, gc), m
local fields = {'line', line_of(last, n, gm, gc, kept, wiv, wb, wfresh), 'vt', fmt(vt or tick), 'run', run_of(runid)}
if log then put(fields, 'log', log) end
redis.call('HSET', k_gate, unpack(fields))
if a_high and hi_until > 0 then redis.call('HDEL', k_gate, 'hi_until') end
log_grant(k_ticks, k_tags, tick, a_tag, p.tick_log, p.keep, p.tag_keep, now)
keep_line(math.max(tick, tonumber(st.defer_at) or 0) + p.keep, p.tag_keep)
for _, c in ipairs(own) do counter_add(k_counts, c, tick, a_cost, p.keep, now) end
if a_cost > 1 then redis.call('HSET', k_gate, 'costly_until', fmt(tick + spaced_span(own))) end
if tiv > 0 then
  local costly = nil
  if a_cost > 1 then costly = tick + spaced_span(totals) end
  ts.last, ts.n = tlast, tn
  total_granted({total = k_total, slots = k_slots, counts = k_total_counts}, {iv = tiv, ring = t.ring, ts = ts, counters = totals,
    costly_until = costly, run = run_of(runid)}, tick, a_cost, p.keep, now)
end
local tol, bare = tonumber(ctl.tol) or 0, 0
if tol > 0 and burst == 1 then bare = spacing(rate or p.raise.cfg, burst, p.window) end
return {ANSWERED, known, tol, interval, bare, GRANTED, tick - now, 0, tick}
`

// batchStagger spaces the moments at which callers of a batch deferred as
// one (a high call waits) come back, in their order.
const batchStagger = time.Millisecond

// fullFor is how long a bucket a lean grant handed to a richer one
// stays with it: what the lean grant cannot decide (adaptation in force,
// a learned rate, counters in use after a costly call, another replica's
// tick the widest) lasts a while, and asking the lean grant first would
// cost a second round trip on every grant. What the lean grant found
// missing or due (needState: a new bucket, one that expired after idle,
// another server's; needUpkeep: the keys' expiry, the widest tick's
// refresh, the minute's count) does not last: the full grant writes it,
// and the next grant is lean again.
const fullFor = time.Second

// stayFull keeps the bucket on the full grant for fullFor after a lean
// grant handed a call over (reply res) for a reason that lasts.
func (b *Bucket) stayFull(res []any, now time.Time) {
	if code, ok := res[0].(int64); ok && (handover(code) == needState || handover(code) == needUpkeep) {
		return
	}
	b.fullUntil.Store(now.Add(fullFor).UnixNano())
}

// reserve asks for the next tick of a call of req in one Redis round
// trip (two when a lean grant hands the call to a richer one: at most
// once per fullFor for what lasts, once per upkeep for what does not).
// Being deferred is not an error: errors mean Redis failed.
func (b *Bucket) reserve(ctx context.Context, req Request) (reservation, error) {
	rs, err := b.reserveMany(ctx, []Request{req})
	if err != nil {
		return reservation{}, err
	}
	return rs[0], nil
}

// reserveMany asks for the next ticks of the calls of reqs, in their
// order, as one call after the other would: in one round trip when they
// all have the common shape (see batchable), else one each.
func (b *Bucket) reserveMany(ctx context.Context, reqs []Request) ([]reservation, error) {
	srv := &b.gate.srv
	for {
		now := b.gate.clock.Now()
		server, dials := srv.known(b.group, now)
		rs, err := b.reserveAt(ctx, reqs, server, now)
		if err != nil {
			return nil, err
		}
		if r := rs[len(rs)-1]; server == "" || r.server != server {
			// Read by INFO: the script asked the server itself.
			srv.learn(b.group, r.server, dials, now)
		}
		if server == "" || srv.still(dials) {
			return rs, nil
		}
		// A connection was dialed since the arguments were built: the
		// reply may come from another server than the one they name (a
		// failover, a restart), or the pool only grew. Ask the server
		// that holds the bucket now; when it is the one named, the reply
		// stands. Else give the ticks up and ask again, with INFO.
		if same, err := srv.check(ctx, b.gate.rdb, b.group, b.keys.check, server, b.gate.clock.Now()); err == nil && same {
			return rs, nil
		}
		for i, r := range rs {
			if r.ok {
				if err := b.giveUp(ctx, r.lease, gaveUpDropped, r.tick, reqs[i].Cost, r.tag); err != nil {
					return nil, err
				}
			}
		}
	}
}

// runGrant runs the grant fn on the bucket's keys (in the order keys
// lists them) and, where it found the tags key in the other form (a
// group of one's list, a group of accounts' set: see retag), puts the key
// in the bucket's form and runs it once more.
func (b *Bucket) runGrant(ctx context.Context, fn *function, keys func(bucketKeys) []string, argv []any) ([]any, error) {
	res, err := b.gate.run(ctx, fn, keys(b.tickKeys()), argv...).Slice()
	if !isWrongType(err) {
		return res, err
	}
	if err := b.retag(ctx); err != nil {
		return nil, err
	}
	return b.gate.run(ctx, fn, keys(b.tickKeys()), argv...).Slice()
}

// batchable reports whether a call of req fits the core script: a call
// of one unit in the normal lane, to a bucket of the common shape, whose
// holder can be told from the next in a batch.
func (b *Bucket) batchable(req Request) bool {
	return b.core && max(req.Cost, 1) == 1 && req.Lane == Normal && !strings.Contains(req.Tag, "\n")
}

// reserveLean runs the core grant for all of reqs, or the adapt grant
// while adaptation is in force (the core grant hands it over, needAdapt:
// the adapt grant then serves the bucket for fullFor). ok is false when
// the lean grants handed the calls over to the full one.
func (b *Bucket) reserveLean(ctx context.Context, reqs []Request, server string, now time.Time) (rs []reservation, ok bool, err error) {
	args := b.coreArgs(reqs, server).argv()
	kind, fn, keys := "core", coreFunction, bucketKeys.core
	if b.member != "" {
		fn = coreFoldFunction
	}
	if now.UnixNano() < b.adaptUntil.Load() {
		kind, fn, keys = "adapt", adaptFunction, bucketKeys.adapt
	}
	for {
		b.gate.testRun(kind)
		res, err := b.runGrant(ctx, fn, keys, args)
		if err != nil {
			return nil, false, fmt.Errorf("shaper: reserve a tick for %q: %w", b.name, unavailable(ctx, err))
		}
		if rs, ok, err := b.parseReply(res, len(reqs), server); ok || err != nil {
			for i := range rs {
				if rs[i].ok {
					rs[i].tag = reqs[i].Tag
				}
			}
			return rs, ok, err
		}
		if code, _ := res[0].(int64); kind == "core" && handover(code) == needAdapt {
			b.adaptUntil.Store(now.Add(fullFor).UnixNano())
			kind, fn, keys = "adapt", adaptFunction, bucketKeys.adapt
			continue
		}
		b.stayFull(res, now)
		return nil, false, nil
	}
}

// reserveAt runs the core (or adapt) grant for all of reqs when they fit
// it and the server is known, else the counted grant for each call that
// fits it, else (or when a lean grant hands them over) the full one.
func (b *Bucket) reserveAt(ctx context.Context, reqs []Request, server string, now time.Time) ([]reservation, error) {
	lean := server != "" && now.UnixNano() >= b.fullUntil.Load()
	core := lean
	for _, req := range reqs {
		core = core && b.batchable(req)
	}
	if core {
		rs, ok, err := b.reserveLean(ctx, reqs, server, now)
		if ok || err != nil {
			return rs, err
		}
		if len(reqs) > 1 && now.UnixNano() >= b.fullUntil.Load() {
			// Handed over for what one full grant settles (the state, an
			// upkeep): the full grant takes the first call, and the rest
			// are one lean batch again.
			first, err := b.reserveEach(ctx, reqs[:1], server, now, false)
			if err != nil {
				return nil, err
			}
			if first[0].server != "" {
				server = first[0].server
			}
			rest, err := b.reserveAt(ctx, reqs[1:], server, now)
			if err != nil {
				return nil, err
			}
			return append(first, rest...), nil
		}
		lean = false
	}
	return b.reserveEach(ctx, reqs, server, now, lean)
}

// reserveEach runs a grant for each call of reqs in turn: the counted
// one while lean and the bucket fits it, else (or when the counted one
// hands the call over) the full one.
func (b *Bucket) reserveEach(ctx context.Context, reqs []Request, server string, now time.Time, lean bool) ([]reservation, error) {
	out := make([]reservation, 0, len(reqs))
	for _, req := range reqs {
		var lease string
		if b.policy.MaxInFlight > 0 {
			lease = newLeaseID()
		}
		args := b.reserveArgs(req, lease)
		args.Server = server
		mine := b.mine(args.Interval, args.Burst)
		if lean && b.counted && max(req.Cost, 1) == 1 && req.Lane == Normal {
			b.gate.testRun("counted")
			ca := args.counted(mine)
			res, err := b.runGrant(ctx, countedFunction, bucketKeys.counted, ca.argv())
			if err != nil {
				return nil, fmt.Errorf("shaper: reserve a tick for %q: %w", b.name, unavailable(ctx, err))
			}
			rs, ok, err := b.parseReply(res, 1, server)
			if err != nil {
				return nil, err
			}
			if ok {
				if rs[0].ok {
					rs[0].tag = req.Tag
				}
				out = append(out, rs[0])
				continue
			}
			b.stayFull(res, now)
			lean = false
		}
		b.gate.testRun("full")
		res, err := b.runGrant(ctx, reserveFunction, bucketKeys.reserve, args.full(mine).argv())
		if err != nil {
			return nil, fmt.Errorf("shaper: reserve a tick for %q: %w", b.name, unavailable(ctx, err))
		}
		rs, ok, err := b.parseReply(res, 1, server)
		if err == nil && !ok {
			err = fmt.Errorf("shaper: reserve a tick for %q: the full script handed the call over: %v", b.name, res)
		}
		if err != nil {
			return nil, err
		}
		if rs[0].ok {
			rs[0].lease, rs[0].tag = lease, req.Tag
		}
		if rs[0].server != "" {
			server = rs[0].server
		}
		out = append(out, rs[0])
	}
	return out, nil
}

// mine is the caller's tick as widest keeps it:
// "interval|burst|replica|gen", gen the generation of the bucket's policy
// in this process (see Bucket.gen).
func (b *Bucket) mine(iv int64, burst int) string {
	return fmt.Sprintf("%d|%d|%s|%d", iv, burst, b.gate.replica, b.gen.Load())
}

// parseReply reads a grant's reply for n calls (its shape is at
// replyHeader). ok is false when a lean grant handed the calls over to
// the full one.
func (b *Bucket) parseReply(res []any, n int, server string) (rs []reservation, ok bool, err error) {
	bad := func() ([]reservation, bool, error) {
		return nil, false, fmt.Errorf("shaper: reserve a tick for %q: unexpected reply %v", b.name, res)
	}
	if len(res) < replyHeader {
		return bad()
	}
	var head [replyHeader]int64
	for i, x := range res[:replyHeader] {
		switch v := x.(type) {
		case int64:
			head[i] = v
		case string:
			if i != 1 {
				return bad()
			}
			if v != "" {
				server = v
			}
		default:
			return bad()
		}
	}
	if handover(head[0]) != answered {
		return nil, false, nil
	}
	if len(res) != replyHeader+replyItem*n {
		return bad()
	}
	tol := time.Duration(head[2]) * time.Microsecond
	var gap time.Duration
	if bare := time.Duration(head[4]) * time.Microsecond; bare > 0 {
		gap = startGap(time.Duration(head[3])*time.Microsecond, bare).Truncate(time.Microsecond)
	}
	for i := range n {
		var v [replyItem]int64
		for j := range v {
			x, isInt := res[replyHeader+replyItem*i+j].(int64)
			if !isInt {
				return bad()
			}
			v[j] = x
		}
		r := reservation{ok: v[0] == replyGranted, wait: time.Duration(v[1]) * time.Microsecond, reason: deferReason(v[2]),
			tick: v[3], tolerance: tol, server: server, gap: gap}
		if r.reason == behindHigh {
			// A batch told to step aside for a high call comes back in
			// its order, one stagger apart, not in a race that shuffles
			// it.
			r.wait += time.Duration(i) * batchStagger
		}
		rs = append(rs, r)
	}
	return rs, true, nil
}

// coreArgs builds the core script's arguments for the calls of reqs.
func (b *Bucket) coreArgs(reqs []Request, server string) coreArgs {
	p := b.policy
	iv, burst, guard, _ := b.spacing()
	var horizon time.Duration // the batch's: the longest of its calls'
	for _, r := range reqs {
		horizon = max(horizon, b.horizonOf(r))
	}
	var tags strings.Builder
	for _, r := range reqs {
		tags.WriteString(r.Tag)
		tags.WriteByte('\n')
	}
	return coreArgs{
		Now: b.gate.redisNow(), Server: runOf(server), Tags: tags.String(), Mine: b.mine(iv.Microseconds(), burst),
		Policy: fmt.Sprintf("%d|%d|%d|%d|%d|%d|%d|%d|%d|%d", iv.Microseconds(), burst, horizon.Microseconds(),
			b.keep.Microseconds(), b.tickLog(), (p.Limits[0].Window + guard).Microseconds(),
			p.Limits[0].Window.Microseconds(), p.Limits[0].Rate, tagKeep.Microseconds(), (replicaLive / 4).Microseconds()),
	}
}

// horizonOf is how far ahead a tick may be reserved for req: the
// policy's Horizon, or the request's when shorter.
func (b *Bucket) horizonOf(req Request) time.Duration {
	if req.Horizon > 0 && req.Horizon < b.policy.Horizon {
		return req.Horizon
	}
	return b.policy.Horizon
}

// reserveArgs builds the reserve script's arguments for one call.
func (b *Bucket) reserveArgs(req Request, lease string) reserveArgs {
	p := b.policy
	ra := b.raiseArgs()
	cfg := ra.Cfg
	iv, burst, guard, _ := b.spacing()
	args := reserveArgs{
		Now: b.gate.redisNow(), Interval: iv.Microseconds(), Burst: burst, Horizon: b.horizonOf(req).Microseconds(),
		MaxInFlight: p.MaxInFlight, LeaseTTL: p.LeaseTTL.Microseconds(), Lease: lease,
		Span: (p.Limits[0].Window + guard).Microseconds(), ReplicaLive: replicaLive.Microseconds(),
		Keep: b.keep.Microseconds(), Member: b.member,
		Rate: cfg, RaiseStep: ra.Step, Quiet: ra.Quiet, Probe: ra.Probe, Recheck: ra.Recheck, Ceiling: ra.Ceiling,
		TickLog: b.tickLog(), Window: p.Limits[0].Window.Microseconds(), Warmup: p.Warmup.Microseconds(), WarmupFrom: p.WarmupFrom,
		Cost: max(req.Cost, 1), High: req.Lane == High, Limits: b.limits,
		Tag: req.Tag, TagKeep: tagKeep.Microseconds(),
	}
	if t := b.total; t != nil {
		args.TotalInterval, args.TotalBurst, args.TotalSpan, args.TotalRate = t.interval.Microseconds(), t.burst, t.span.Microseconds(), t.rate
		args.OwnRate = EffectiveRate(iv, burst, t.window)
		args.TotalLimits = t.limits
		if n := (p.Horizon+t.interval-1)/t.interval + 4; t.burst == 1 && n <= maxRing {
			args.Ring = int64(n)
		}
		if per := int64(p.Limits[0].Rate / b.burst); len(p.spaced()) == 1 && per <= maxLog {
			args.LogLen = per
		}
	}
	return args
}

// giveUpScript frees an in-flight lease, counts a tick given up, takes
// it out of the ticks list, and takes its units out of the quotas that
// counted them (a call that never started used none; the spaced limits'
// counters keep them, on the safe side, as they may not have counted
// them).
//
// KEYS[1] in-flight sorted set, KEYS[2] stats hash, KEYS[3] ticks list,
// KEYS[4] the bucket's counters, KEYS[5] the group total's counters.
// ARGV[1] Redis time override (unused), ARGV[2] lease id ("" for none),
// ARGV[3] the counter to add one to ("late", "dropped") or "", ARGV[4]
// the tick given up (µs; 0: none), ARGV[5] its cost, ARGV[6] the bucket's
// limits, ARGV[7] the total's (limitSpec; "" without one), ARGV[8] the
// tag the tick was recorded with (see unsend).
// Returns 0.
var giveUpScript = redis.NewScript(fmtLua + extendLua + countersLua + counterAdoptLua + formLua + heldLua + itemLua + `
local k_inflight, k_stats, k_ticks, k_counts, k_total_counts = KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5]
local a_lease, a_counter = ARGV[2], ARGV[3]
local a_tick, a_cost = tonumber(ARGV[4]), tonumber(ARGV[5])
local a_limits, a_total_limits, a_tag = ARGV[6], ARGV[7], ARGV[8]
if a_lease ~= '' then redis.call('ZREM', k_inflight, a_lease) end
if a_counter ~= '' then redis.call('HINCRBY', k_stats, a_counter, 1) end
if a_tick > 0 then
  unsend(k_ticks, a_tick, a_tag)
  for _, pair in ipairs({{k_counts, a_limits}, {k_total_counts, a_total_limits}}) do
    for _, c in ipairs(parse_limits(pair[2])) do
      local field = c.id .. ':' .. fmt(math.floor(a_tick / c.slot))
      if c.kind == 'q' and redis.call('HEXISTS', pair[1], field) == 1 then
        if redis.call('HINCRBY', pair[1], field, -a_cost) <= 0 then redis.call('HDEL', pair[1], field) end
        if redis.call('HINCRBY', pair[1], c.id .. ':sum', -a_cost) < 0 then redis.call('HSET', pair[1], c.id .. ':sum', 0) end
      end
    end
  end
end
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
func (b *Bucket) giveUp(ctx context.Context, lease string, counter string, tick int64, cost int, tag string) error {
	if lease == "" && counter == "" && tick == 0 {
		return nil
	}
	var total string
	if b.total != nil {
		total = b.total.limits
	}
	k := b.tickKeys()
	if err := redisonce.Run(ctx, b.gate.rdb, giveUpScript, []string{k.inFlight, k.stats, k.ticks, k.counts, k.totalCounts}, 0,
		lease, counter, strconv.FormatInt(tick, 10), max(cost, 1), b.limits, total, k.logTag(tag)).Err(); err != nil {
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
