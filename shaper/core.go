package shaper

import (
	"fmt"
	"strconv"
)

// Every grant (core, counted, full) replies in one shape:
//
//	{need, server, tol, iv, bare, code₁, wait₁, reason₁, tick₁, …}
//
// need is answered, or what a lean grant (core, counted) lacks to decide
// (then no calls follow, and the gate asks the full grant); server is the
// run_id the full grant read by INFO (empty: as the gate passed it); tol is
// a learned tolerance (µs; 0: the policy's); iv and bare, while a margin
// lesson is in force, the interval in force and the spacing without the
// guard, from which Go makes the gap between starts (startGap; bare 0:
// starts are not stamped). Then, for each call in order, its code (granted
// or deferred), the wait (µs: to the tick, or before asking again), why it
// was deferred (deferReason) and the tick (µs; 0 when deferred).
const (
	replyDeferred = 0 // no tick: ask again after the wait; the reason says why
	replyGranted  = 1 // a tick, the wait away from Redis now
	replyHeader   = 5 // need, server, tol, iv, bare
	replyItem     = 4 // code, wait, reason, tick
)

// handover says what a lean grant lacks to decide (the reply's need).
type handover int

const (
	answered    handover = iota // the grant answered every call
	needState                   // the state is missing, or was written on another server or in another layout
	needAdapt                   // adaptation in force the counted grant does not apply (a pause, a rate, a lesson, a high call)
	needLearned                 // a learned rate, which the full grant may step up
	needCostly                  // counters in use after a costly call
	needWide                    // the core grant: another tick than the caller's is the widest (a rolling edit)
	needUpkeep                  // the core grant: the keys' expiry, the widest tick or the minute's count is due its upkeep
)

// codesLua names the reply's codes, the defer reasons and noServer in the
// scripts, and defines handover(why): a lean grant's reply when it cannot
// decide.
var codesLua = fmt.Sprintf(`local DEFERRED, GRANTED, ANSWERED, NEED_STATE, NEED_ADAPT, NEED_LEARNED, NEED_COSTLY = %d, %d, %d, %d, %d, %d, %d
local NEED_WIDE, NEED_UPKEEP = %d, %d
local BEYOND_HORIZON, IN_FLIGHT_FULL, STATE_RESET, BEHIND_HIGH, HELD_BY_LIMIT, HELD_BY_PAUSE, NEWER_LAYOUT = %d, %d, %d, %d, %d, %d, %d
local function handover(why) return {why, '', 0, 0, 0} end
`, replyDeferred, replyGranted, answered, needState, needAdapt, needLearned, needCostly, needWide, needUpkeep,
	beyondHorizon, inFlightFull, stateReset, behindHigh, heldByLimit, heldByPause, newerLayout)

// fmtLua defines fmt(x): an integer as a string, without exponent. It
// keeps the last string it made (fmt_x, fmt_s): a grant writes its tick
// as text up to three times (the tick's vt, the log, the total's last),
// and a string.format costs Redis about as much as a field read.
const fmtLua = `
local fmt_x, fmt_s = nil, nil
local function fmt(x) if x ~= fmt_x then fmt_x, fmt_s = x, string.format('%d', x) end return fmt_s end
`

// formLua defines the form a server's items take: form() returns packer,
// struct where the server's Lua has it, false where it does not (nil
// until the first line or item is read or written: a function's library
// cannot look at globals while it loads, and a plain read of a missing
// global is an error); and tick_item (see lineFieldLua).
var formLua = `
local packer = nil
local function form()
  if packer == nil then packer = rawget(_G, 'struct') or false end
  return packer
end

local function tick_item(t)
  if form() then return packer.pack('<d', t) end
  return string.format('%d', t)
end

`

// lineFieldLua defines read_line and line_of, and with formLua
// tick_item: how a gate hash keeps its line and how the ticks list keeps
// a tick, for every script that reads or writes them.
//
// The gate hash's 'line' holds eight numbers: the last reserved tick
// (µs), the calls granted on it, the grants of clock minute gm not yet
// folded into the stats hash (gc, see count_granted), what the bucket's
// keys were last extended to (µs, see keep_alive), and the widest tick
// asked under lately (see widest): its interval (µs) and burst, and
// until when (µs) it needs no refresh (wide_at + live / 4). A grant whose
// tick is that one reads no 'wide' field until then (see wide_entry);
// every writer of 'wide' writes the line's three with it, or zeros (the
// next grant reads 'wide'). It is one field read and written whole on
// every grant, where eight cost eight times the hash's work, and it is
// kept packed (struct.pack: eight doubles, 64 bytes, every value an
// integer below 2^53), where reading and writing it as text cost a tenth
// of the common grant. The embedded Redis's Lua has no struct: there the
// line is text, "last|n|gm|gc|kept|wiv|wb|wfresh". A server holds one
// form only; a line of the other, or of a version that kept fewer
// numbers, reads as none.
//
// read_line(line): the line's numbers, last, n, gm, gc, kept, wiv, wb,
// wfresh (and, packed, where the unpacking stopped); nil, 0, nil, 0, 0,
// 0, 0, 0 for none.
//
// line_of(last, n, gm, gc, kept[, wiv, wb, wfresh]): the line of those
// (see read_line); without the widest tick's three, zeros (see
// wide_entry).
//
// tick_item(t): tick t (µs) as the ticks list keeps it: packed (a
// double, 8 bytes) where the line is, else its digits.
var lineFieldLua = formLua + `

local function read_line(line)
  if form() and line and #line == 64 then return packer.unpack('<dddddddd', line) end
  local f = not packer and line and {string.match(line, '^(%d+)|(%d+)|(%d+)|(%d+)|(%d+)|(%d+)|(%d+)|(%d+)$')}
  if not f or not f[1] then return nil, 0, nil, 0, 0, 0, 0, 0 end
  return f[1] + 0, f[2] + 0, f[3] + 0, f[4] + 0, f[5] + 0, f[6] + 0, f[7] + 0, f[8] + 0
end

local function line_of(last, n, gm, gc, kept, wiv, wb, wfresh)
  wiv, wb, wfresh = wiv or 0, wb or 0, wfresh or 0
  if form() then return packer.pack('<dddddddd', last, n, gm, gc, kept, wiv, wb, wfresh) end
  return string.format('%d|%d|%d|%d|%d|%d|%d|%d', last, n, gm, gc, kept, wiv, wb, wfresh)
end
`

// heldLua defines the items of a ticks list that keeps its holders'
// tags (see Bucket.tagged). It needs formLua.
//
// held_item(t, tag): the item of tick t granted to the holder tag: the
// packed tick followed by the tag, or the digits, a space and the tag;
// tick_item(t) for no tag.
//
// item_tick(item): the tick of any item (the packed tick, or the leading
// digits); item_tagged(item): whether it names a holder.
const heldLua = `
local function held_item(t, tag)
  if tag == '' then return tick_item(t) end
  return tick_item(t) .. (packer and '' or ' ') .. tag
end

local function item_tagged(item)
  if packer then return #item > 8 end
  return string.find(item, '[ !]') ~= nil
end

local function item_tick(item)
  if form() and #item >= 8 and not string.find(item, '^%d+$') then return (packer.unpack('<d', item)) end
  return tonumber(string.match(item, '^%d+'))
end
`

// itemLua defines how the readers of a ticks list read its items, and
// how a tick leaves the judge's view while its holder's record stays. It
// needs formLua and heldLua.
//
// read_item(item): the item's tick, its holder's tag ("" for none) and
// whether the tick counts as sent (false for a kept item). An item is a
// tick alone (tick_item; digits too: a list written by a version that
// kept them so), a tick and its holder's tag (held_item: the packed
// tick followed by the tag, or the digits, a space and the tag), or a
// kept item (kept_item: the same with a NUL byte after the packed tick,
// or "!" in place of the space).
//
// tick_of(item): the tick of an item that counts as sent (nil for a kept
// one): what judging a rate-limited answer reads.
//
// kept_item(t, tag): the item of a tick given up or refused whose
// holder's record must stay (recover reads it as granted: the safe
// side), out of the judge's view: a NUL byte after the packed tick, or
// "!" in place of the space.
//
// unsend(key, t, tag): takes the item of tick t, granted to the holder
// tag, out of the judge's view of the ticks list at key: the item goes,
// and where it carried a tag a kept item takes its place. An item
// without the tag (a list whose tags live in the tags set, or one
// written before tags were kept in it) goes too. Returns whether one
// went.
const itemLua = `
local function read_item(item)
  form()
  if packer and #item >= 8 and not string.find(item, '^%d+$') then
    local t = item_tick(item)
    if string.byte(item, 9) == 0 then return t, string.sub(item, 10), false end
    return t, string.sub(item, 9), true
  end
  local t, sep, tag = string.match(item, '^(%d+)([ !]?)(.*)$')
  return tonumber(t), tag or '', sep ~= '!'
end

local function tick_of(item)
  local t, _, counted = read_item(item)
  return counted and t or nil
end

local function kept_item(t, tag)
  local item = tick_item(t)
  if packer then return item .. '\0' .. tag end
  return item .. '!' .. tag
end

local function unsend(key, t, tag)
  if tag ~= '' and redis.call('LREM', key, 1, held_item(t, tag)) == 1 then
    redis.call('LPUSH', key, kept_item(t, tag))
    return true
  end
  return redis.call('LREM', key, 1, tick_item(t)) == 1
end
`

// runOfLua defines run_of(runid): the 'run' a gate hash records, the
// run_id of the server it was written on, tagged with the state's layout
// (runTag). An older
// version takes a state of this one for a stale copy, as this one takes
// its: a switch between them costs a horizon, and the two never grant at
// once; a newer one's is not this version's to read or write
// (newer_layout). NO_SERVER is the run_id of a server whose INFO is
// refused (noServer).
var runOfLua = `
local NO_SERVER = '` + noServer + `'
local function run_of(runid) return '` + runTag + `' .. runid end
`

// layout is the version of the gate state's layout this version reads
// and writes (docs/design.md, "The state's layout"). A state written in
// a newer one is left alone: its calls wait (BoundUpgrade); one written
// in the layout before it, on the same server, is converted at its first
// touch. Layout 4: a group of one keeps its holders' tags in its ticks
// list, at the tags key (convertLua converts a layout 3 state's). Layout
// 5: a group total keeps its numbers in one field and its run tagged as
// a gate hash's (totalStateLua; total_adopt converts a layout 4 total,
// the gate hash reads as it did).
const layout = 5

// runTag tags the run a gate hash or a total hash records (see run_of).
var runTag = "l" + strconv.Itoa(layout) + ":"

// convertLua converts the state of a bucket written in the layout before
// this one (3) at the full grant's first touch, so that an upgrade waits
// no horizon and loses no record. It needs formLua, heldLua, itemLua and
// extendLua.
//
// PREVIOUS_LAYOUT tags the run of a state in the layout before this one
// (lost_at takes such a state, written on the same server, as its own).
//
// convert_tags(k_tags, k_old, keep, now): a group of one's record of tags
// (a sorted set at k_tags, scored by tick) and its ticks list (at k_old)
// become one list at k_tags, newest first: a tag with its tick's item
// (held_item), or a kept item where the list no longer counted the tick
// (given up, refused, trimmed: kept_item), and the ticks no tag held.
// The list keeps the set's expiry. Nothing to do when k_tags is not a
// set (converted, or never written). A worker of layout 3 reading the
// list where it expects the set gets WRONGTYPE, and recover falls back
// on asynq's lease: it never takes a granted call for one never granted.
var convertLua = `
local PREVIOUS_LAYOUT = 'l` + strconv.Itoa(layout-1) + `:'
local function convert_tags(k_tags, k_old, keep, now)
  local kind = redis.call('TYPE', k_tags)
  if type(kind) == 'table' then kind = kind.ok end
  if kind ~= 'zset' then return end
  local set, left, items = redis.call('ZRANGE', k_tags, 0, -1, 'WITHSCORES'), {}, {}
  for _, item in ipairs(redis.call('LRANGE', k_old, 0, -1)) do
    local t = item_tick(item)
    if t then left[t] = (left[t] or 0) + 1 end
  end
  for i = 1, #set, 2 do
    local t = tonumber(set[i + 1])
    if (left[t] or 0) > 0 then
      left[t] = left[t] - 1
      items[#items + 1] = {t, held_item(t, set[i])}
    else
      items[#items + 1] = {t, kept_item(t, set[i])}
    end
  end
  for t, c in pairs(left) do
    for _ = 1, c do items[#items + 1] = {t, tick_item(t)} end
  end
  table.sort(items, function(x, y) return x[1] > y[1] end)
  local ttl = redis.call('PTTL', k_tags)
  redis.call('DEL', k_tags, k_old)
  for i = 1, #items, 500 do
    local part = {}
    for j = i, math.min(i + 499, #items) do part[#part + 1] = items[j][2] end
    redis.call('RPUSH', k_tags, unpack(part))
  end
  if #items > 0 then
    if ttl > 0 then redis.call('PEXPIRE', k_tags, ttl) else extend(k_tags, now + keep, now) end
  end
end
`

// runOf is run_of for the core grant's Server argument: the run a state
// written on server records, or "" when the server is unknown.
func runOf(server string) string {
	switch server {
	case "":
		return ""
	case noServer:
		return runTag
	}
	return runTag + server
}

// widestLua defines widest, the rule by which the most conservative tick
// asked under lately wins while replicas disagree: the grants and the
// respace script use it.
//
// widest(wide, wide_at, mine, iv, b, live, now): while replicas disagree
// on the config (a rolling edit), the most conservative tick asked under
// lately wins. The gate hash's 'wide' ("interval|burst|replica|gen")
// holds it and 'wide_at' when it was last asked under: a caller whose
// tick (mine, the same of iv, b) is at least as wide takes its place, and
// it stops counting live after that. Within one replica the newer
// generation of the policy (gen, a config edit) takes the place at once,
// and a caller still under an older one spaces by the wider of the two
// and writes nothing: a raised rate is not held back by the calls that
// were on their way when it came. Returns the interval and burst to
// space by, and the fields' values to write (nil: unchanged).
var widestLua = `
local function widest(wide, wide_at, mine, iv, b, live, now)
  wide_at = tonumber(wide_at)
  if wide == mine and wide_at then
    if now - wide_at < live / 4 then return iv, b, nil, nil end
    return iv, b, nil, now
  end
  local wiv, wb, who, wgen = string.match(wide or '', '^(%d+)|(%d+)|(.*)|(%d+)$')
  wiv, wb = tonumber(wiv), tonumber(wb)
  if wiv == nil or wide_at == nil or now - wide_at >= live then return iv, b, mine, now end
  local me, gen = string.match(mine, '^%d+|%d+|(.*)|(%d+)$')
  if who == me and gen ~= wgen then
    if tonumber(gen) > tonumber(wgen) then return iv, b, mine, now end
    return math.max(iv, wiv), math.min(b, wb), nil, nil
  end
  if iv >= wiv and b <= wb then return iv, b, mine, now end
  return math.max(iv, wiv), math.min(b, wb), nil, nil
end
`

// lineLua defines the pieces of a bucket's line of ticks that the
// grants share, widest (widestLua) among them: the full grant takes them
// all, the lean grants the parts their hot path runs (putLua,
// logTicksLua, foldLua; keepAliveLua in the counted grant).
//
// put(t, a, b[, c, d]): see putLua.
//
// wide_entry(wide, wide_at, wide_at_new, iv, b, live): the widest tick
// as the line keeps it (see read_line) after widest: the caller's (iv,
// b) when widest wrote it (wide_at_new), else the 'wide' field's; fresh
// until live / 4 after it was last asked under (zeros: none). While the
// line's is the caller's tick and fresh, widest would space by that tick
// and write nothing the line does not say: the grant need not read
// 'wide'. (When the entry is another replica's with the same tick,
// widest would have the caller take its place; the caller does once it
// is no longer fresh.)
//
// line_widest(k_gate, mine, iv, b, live, now, wiv, wb, wfresh): widest
// for a caller of tick (iv, b) whose line holds the entry (wiv, wb,
// wfresh): without reading 'wide' while the entry is the caller's and
// fresh (see wide_entry). Returns widest's four values, then the entry
// for the line.
//
// keep_alive(k, untilv, kept, paused, keep, tag_keep, now): the bucket's
// keys (k: gate, control, ticks, expiry, tags, member) outlive untilv, and
// the tag record loses the entries tag_keep past their tick. The keys
// are extended further than asked (reachLua), and only once untilv
// passes what they were last extended to (kept, in the gate hash's
// line), so that a bucket extends them once in many grants rather than
// on every grant. Returns what they were extended to, for the line (nil:
// not extended).
//
// log_ticks(key, items, last, len, keep, now[, tag_keep]): the ticks
// list (newest first) gets items (tick_item or held_item, oldest first;
// last: the newest's tick), and a list made anew expires keep after the
// last tick. It is cut back to len once it holds tickTrim more; a list
// that keeps its holders' tags (tag_keep given) keeps a tag tag_keep
// after its tick too: each time it passes a multiple of tickTrim, its
// tickTrim oldest items go (twice at most) when none of them is a tag
// younger than that and at least len stay. A list so keeps what the
// record of tags must (30 s of tagged grants, whatever the rate) with
// one LRANGE of tickTrim items per tickTrim grants, and sheds what it
// holds beyond that by up to 2*tickTrim items per tickTrim grants.
//
// fold_granted(key, gm, c, m): c grants of clock minute gm into the
// stats hash key at minute m: into gm's slot, or the total once gm is
// more than a minute old.
//
// count_granted(key, k, m, gm, gc): the bucket's count of grants in
// clock minute m after k more, as its gate hash keeps it (gc in minute
// gm). The gate hash counts a minute's grants and folds them into the
// group's stats hash key (see minuteCounterLua) once they reach
// grantFold or the minute changes, so that most grants write no stats
// (the core grant of a group of one never folds: it hands a new
// minute's first grant to the full grant, see tallyLua); Stats adds what the gate hash holds to what the stats
// hash does. A
// gate hash that expires after idle takes the count it had not folded
// with it.
var lineLua = putLua + widestLua + wideEntryLua + keepAliveLua + logTicksLua + foldLua

// wideEntryLua defines wide_entry and line_widest (see lineLua).
const wideEntryLua = `
local function wide_entry(wide, wide_at, wide_at_new, iv, b, live)
  if wide_at_new then return iv, b, wide_at_new + math.floor(live / 4) end
  local wiv, wb = string.match(wide or '', '^(%d+)|(%d+)|')
  wide_at = tonumber(wide_at)
  if not wiv or not wide_at then return 0, 0, 0 end
  return wiv + 0, wb + 0, wide_at + math.floor(live / 4)
end

local function line_widest(k_gate, mine, iv, b, live, now, wiv, wb, wfresh)
  if wiv == iv and wb == b and now < wfresh then return iv, b, nil, nil, wiv, wb, wfresh end
  local wide, wide_at = unpack(redis.call('HMGET', k_gate, 'wide', 'wide_at'))
  local interval, burst, wide_new, wide_at_new = widest(wide, wide_at, mine, iv, b, live, now)
  wiv, wb, wfresh = wide_entry(wide, wide_at, wide_at_new, iv, b, live)
  return interval, burst, wide_new, wide_at_new, wiv, wb, wfresh
end
`

// keepAliveLua defines keep_alive (see lineLua). It needs extendLua.
var keepAliveLua = `
local function keep_alive(k, untilv, kept, paused, keep, tag_keep, now)
  if untilv <= kept then return nil end
  untilv = untilv + ` + reachLua + `
  extend(k.gate, untilv, now)
  extend(k.ticks, untilv, now)
  if redis.call('EXISTS', k.control) == 1 then extend(k.control, math.max(untilv, paused + keep), now) end
  redis.call('ZADD', k.expiry, 'GT', untilv, k.member)
  redis.call('ZREMRANGEBYSCORE', k.expiry, '-inf', now)
  extend(k.expiry, untilv, now)
  if tag_keep > 0 then
    if k.tags ~= k.ticks then redis.call('ZREMRANGEBYSCORE', k.tags, '-inf', '(' .. fmt(now - tag_keep)) end
    extend(k.tags, untilv + tag_keep, now)
  end
  return untilv
end
`

// foldLua defines fold_granted and count_granted (see lineLua). It needs
// rollLua.
var foldLua = `
local function fold_granted(key, gm, c, m)
  if gm < m - 1 then
    redis.call('HINCRBY', key, 'granted', fmt(c))
  else
    count_in(key, 'granted', gm, c)
  end
end

local function count_granted(key, k, m, gm, gc)
  if gm ~= m then
    if gm and gc > 0 then fold_granted(key, gm, gc, m) end
    gc = 0
  end
  gc = gc + k
  if gc < ` + grantFoldLua + ` then return gc end
  fold_granted(key, m, gc, m)
  return 0
end
`

// tallyLua defines tally(k_stats, gm, gc, k, m), the gate hash's count
// of grants (gc in clock minute gm, see count_granted) after k more in
// minute m, for the core grant of a group of one: counted in the line
// alone, since Stats adds what the line holds; nil when the minute
// changed (the full grant folds the count of the minute before, an
// upkeep). Nothing is written.
const tallyLua = `
local function tally(k_stats, gm, gc, k, m)
  if k == 0 or gm == m then return gm, gc + k end
end
`

// tallyFoldLua defines tally as the grants of a bucket in a group
// (whose stats hash its group's readers read without its line) and the
// adapt grant keep it: folded into the stats hash every grantFold grants
// and when the minute changes (count_granted).
const tallyFoldLua = `
local function tally(k_stats, gm, gc, k, m)
  if k == 0 then return gm, gc end
  return m, count_granted(k_stats, k, m, gm, gc)
end
`

// putLua defines put(t, a, b[, c, d]): t gets a, b (and c, d) at its
// end. (t[#t + 1], t[#t + 2] = a, b is not safe: the embedded Redis's
// Lua assigns one at a time.)
const putLua = `
local function put(t, a, b, c, d)
  local n = #t
  t[n + 1], t[n + 2] = a, b
  if c ~= nil then t[n + 3], t[n + 4] = c, d end
end
`

// logTicksLua defines log_ticks (see lineLua). It needs extendLua and
// heldLua.
var logTicksLua = `
local function log_ticks(key, items, last, len, keep, now, tag_keep)
  local n, trim = redis.call('LPUSH', key, unpack(items)), ` + tickTrimLua + `
  if n == #items then redis.call('PEXPIRE', key, math.ceil((last + keep - now) / 1000) + 1001) end
  if n <= len + trim then return end
  if not tag_keep then redis.call('LTRIM', key, 0, len - 1) return end
  if math.floor(n / trim) == math.floor((n - #items) / trim) then return end
  for _ = 1, 2 do
    if n - trim < len then return end
    for _, item in ipairs(redis.call('LRANGE', key, -trim, -1)) do
      if item_tagged(item) and item_tick(item) >= now - tag_keep then return end
    end
    redis.call('LTRIM', key, 0, -trim - 1)
    n = n - trim
  end
end
`

// reachLua is how much further than asked keep_alive and total_granted
// extend keys (µs, keep the Lua local of the state's keep): a quarter of
// keep, at least 10 s, at most four keeps. A bucket at 5/s with a 1 s
// window extended its keys by a quarter of its keep (262 ms), on almost
// every grant (7 of the 16 commands of such a grant); at 4.2 s it does
// once in 19 grants. An idle bucket's state outlives its last tick by at
// most five keeps, or keep and 10 s for a keep over 10 s.
const reachLua = `math.min(4 * keep, math.max(math.floor(keep / 4), 10000000))`

// tickTrim is how many ticks past its length the ticks list holds before
// it is cut back: one LTRIM per tickTrim grants instead of one each.
const tickTrim = 32

var tickTrimLua = fmt.Sprint(tickTrim)

// grantFold is how many grants a gate hash counts before it folds them
// into the group's stats hash (see count_granted): one HINCRBY per
// grantFold grants, and a group's stats lag its buckets' grants by less
// than grantFold each.
const grantFold = 8

var grantFoldLua = fmt.Sprint(grantFold)

// cacheLua defines cached(s, parse): parse(s), kept for the next call of
// the same s where the script runs as a Redis function (whose library
// keeps its state between calls; a script parses on every call). The
// reserve scripts take what a bucket's policy says as one string, the
// same for every call of the policy, so that a grant passes and binds
// one argument for it, not a dozen. At most specCache strings are kept:
// a Redis serving more policies parses some again. What parse returns
// is shared by the calls of s: they do not change it (the counters of
// countersLua excepted, which each call loads before it uses them).
var cacheLua = `
local specs, nspecs = {}, 0
local function cached(s, parse)
  local v = specs[s]
  if v then return v end
  v = parse(s)
  if nspecs >= ` + fmt.Sprint(specCache) + ` then specs, nspecs = {}, 0 end
  specs[s], nspecs = v, nspecs + 1
  return v
end
`

// specCache bounds the parsed policies a Redis function keeps (see
// cacheLua).
const specCache = 256

// coreKeyNames names the core grant's KEYS, in order (TestScriptBindings);
// adaptKeyNames the adapt grant's, which reads the control hash too.
var (
	coreKeyNames  = []string{"gate", "stats", "ticks", "tags"}
	adaptKeyNames = append(coreKeyNames[:len(coreKeyNames):len(coreKeyNames)], "control")
)

// core lists the core grant's keys, in the order of coreKeyNames.
func (k bucketKeys) core() []string {
	return []string{k.gate, k.stats, k.ticks, k.tags}
}

// adapt lists the adapt grant's keys, in the order of adaptKeyNames.
func (k bucketKeys) adapt() []string {
	return append(k.core(), k.control)
}

// coreArgs are the core and adapt grants' ARGV, in order
// (TestScriptBindings). What the bucket's policy says comes in one
// string (see cacheLua).
type coreArgs struct {
	Now    int64  `lua:"now"`    // Redis time override (µs; 0: TIME)
	Server string `lua:"server"` // the run a state written on this server records (runOf; "": the server is unknown)
	Tags   string `lua:"tags"`   // the calls asking, in their order: each one's tag (Request.Tag), followed by "\n" ("\n" alone: one call, no tag)
	Mine   string `lua:"mine"`   // the caller's tick as widest keeps it: "interval|burst|replica|gen" (Bucket.mine)
	// Policy is "interval|burst|horizon|keep|tick_log|span|window|rate|tag_keep|fresh":
	// the tick (µs) and burst of the caller's policy, the horizon, how
	// long the state outlives its last tick, the ticks list's length, the
	// limit's window + guard and window (µs) and its rate, how long a
	// tag outlives its tick in the record (µs), and how long the widest
	// tick stays fresh once asked under (replicaLive / 4, see
	// wide_entry).
	Policy string `lua:"policy"`
}

// argv returns the arguments in the order of the struct's fields.
func (a coreArgs) argv() []any {
	return []any{a.Now, a.Server, a.Tags, a.Mine, a.Policy}
}

// coreFunction reserves the next ticks of count calls of the common
// bucket, in their order, as count calls one after the other would: one
// limit, no total, no in-flight cap, no warm-up, calls of one unit in the
// normal lane, under the caller's own tick. It decides the hot path only
// and hands the rest over (see handover), before it writes anything:
//
//   - to the full grant, for a grant that is due upkeep (needUpkeep: the
//     keys' expiry once the line passes what they were extended to, the
//     widest tick's refresh every replicaLive/4, the count of the minute
//     before once the clock minute changes: a few times a minute), for a
//     state missing or written elsewhere (needState), and while another
//     replica's tick is the widest (needWide: a rolling edit);
//   - to the adapt grant while adaptation is in force (needAdapt: a pause,
//     a rate, a lesson, a high call waiting), which hands a learned rate
//     or costly calls to the full grant in turn.
//
// Beyond the horizon the caller comes back one tick after the last
// deferred one. It replies as every grant (see replyHeader), a call per
// tag of the batch, and runs as a Redis function where the server has
// them (see functions.go).
var coreFunction = newFunction("core", coreDefsLua+tallyLua, coreLua)

// coreFoldFunction is the core grant of a bucket in a group (an
// account): the same, with its grants folded into the group's stats
// hash as it goes (tallyFoldLua).
var coreFoldFunction = newFunction("core_fold", coreDefsLua+foldDefsLua, coreLua)

// coreLua is the core grant's body: adaptation in force is the adapt
// grant's.
var coreLua = coreHeadLua + "if adapted then return handover(NEED_ADAPT) end\n" + coreTailLua

// adaptFunction is the core grant with adaptation applied (adaptLua):
// what the core grant runs while the gate hash says adaptation is in
// force.
var adaptFunction = newFunction("adapt", coreDefsLua+spacingLua+foldDefsLua, adaptGrantLua)

// adaptGrantLua is the adapt grant's body.
var adaptGrantLua = coreHeadLua + adaptLua + coreTailLua

// coreDefsLua is what the core and adapt grants define once.
var coreDefsLua = codesLua + fmtLua + nowFromLua + lineFieldLua + heldLua + putLua + logTicksLua + cacheLua + corePolicyLua +
	emptiedLua + "local scratch = {tags = {}, ticks = {}, tagged = {}}\n"

// foldDefsLua is what a grant that folds its count of grants into the
// stats hash adds (tallyFoldLua).
var foldDefsLua = rollLua + foldLua + tallyFoldLua

// scratchLua defines scratch, the tables a grant fills on every call
// instead of making new ones (a function's library lives on between
// calls), and emptied(t), t with its list part emptied. In the counted
// grant, what it passes to fair_pace, fit, keep_alive and
// total_granted, every field filled on every call, the fields it
// writes to the gate hash (gate_fields), the total's numbers
// (total_state, see totalStateLua); its
// callers' tags, the ticks it logs and the tags it records (tags, ticks,
// tagged: the core grant's scratch has these three only); none, an empty
// list never written. A
// table made per call cost about what a Redis command from Lua does: the
// two fair_pace took cost 0.09x GCRA's Redis CPU in BenchmarkRedisCPU's
// per-account case.
const scratchLua = emptiedLua + `
local scratch = {fair_keys = {}, fair = {}, fit_line = {}, fit_total = {}, total_keys = {}, total = {}, keep_keys = {},
  gate_fields = {}, total_state = {}, tags = {}, ticks = {}, tagged = {}, none = {}}
`

// emptiedLua defines emptied(t): t with its list part emptied.
const emptiedLua = `
local function emptied(t)
  for i = #t, 1, -1 do t[i] = nil end
  return t
end
`

// corePolicyLua defines core_policy(s): coreArgs.Policy as a table.
const corePolicyLua = `
local function parse_core(s)
  local iv, b, horizon, keep, tick_log, span, window, rate, tag_keep, fresh = string.match(s,
    '^(%d+)|(%d+)|(%d+)|(%d+)|(%d+)|(%d+)|(%d+)|(%d+)|(%d+)|(%d+)$')
  return {interval = iv + 0, burst = b + 0, horizon = horizon + 0, keep = keep + 0, tick_log = tick_log + 0,
    span = span + 0, window = window + 0, rate = rate + 0, tag_keep = tag_keep + 0, fresh = fresh + 0}
end
local function core_policy(s) return cached(s, parse_core) end
`

// coreHeadLua is the core and adapt grants' start. It binds KEYS
// (coreKeyNames) to locals k_* and ARGV (coreArgs) to locals a_*: x + 0
// makes a number of a string with one strtod, where tonumber(x) makes
// two (the policy's numbers, p, are made once, see cacheLua). The state
// (the gate hash's line, run and adapted) is handed over (NEED_STATE)
// unless the server is known (a_server) and the line was written on it;
// the tick is the caller's when the line says it is the widest and
// fresh (see wide_entry), else the call is handed over.
const coreHeadLua = `
local k_gate = KEYS[1]
local k_stats = KEYS[2]
local k_ticks = KEYS[3]
local k_tags = KEYS[4]
local a_now = ARGV[1] + 0
local a_server = ARGV[2]
local a_tags = ARGV[3]
local a_mine = ARGV[4]
local a_policy = ARGV[5]
local p = core_policy(a_policy)

local now = now_from(a_now)
local line, run, adapted = unpack(redis.call('HMGET', k_gate, 'line', 'run', 'adapted'))
if a_server == '' or not line or run ~= a_server then return handover(NEED_STATE) end
local last, n, gm, gc, kept, wiv, wb, wfresh = read_line(line)
if last == nil then return handover(NEED_STATE) end
if wiv ~= p.interval or wb ~= p.burst then return handover(NEED_WIDE) end
local refresh = now >= wfresh
if refresh then
  if redis.call('HGET', k_gate, 'wide') ~= a_mine then return handover(NEED_UPKEEP) end
  wfresh = now + p.fresh
end
local tags = emptied(scratch.tags)
for tag in string.gmatch(a_tags, '([^\n]*)\n') do tags[#tags + 1] = tag end
local interval, burst, paused, tol, bare = p.interval, p.burst, 0, 0, 0
`

// adaptLua applies adaptation, read only when the gate hash says it is
// there (if adapted, see adaptedLua): the tick widened by a rate set or
// announced and by a guard learned from refusals, after any pause. A
// margin lesson in force (tol): calls stamp their starts (startLua),
// apart by a gap Go makes of the spacing without the guard (bare, see
// startGap). While a high call waits (hi_until), every call steps aside
// (BEHIND_HIGH). A learned rate, which may step up, and counters in use
// after a costly call are the full grant's (NEED_LEARNED, NEED_COSTLY).
const adaptLua = `
local k_control = KEYS[5]
if adapted then
  local costly_until, rate, source, guard, hi_until
  hi_until, costly_until = unpack(redis.call('HMGET', k_gate, 'hi_until', 'costly_until'))
  paused, rate, source, guard, tol = unpack(redis.call('HMGET', k_control, 'paused_until', 'rate', 'rate_source', 'guard', 'tol'))
  if source == 'learned' then return handover(NEED_LEARNED) end
  if (tonumber(costly_until) or 0) > now then return handover(NEED_COSTLY) end
  paused, rate, guard, hi_until = tonumber(paused) or 0, tonumber(rate), tonumber(guard), tonumber(hi_until) or 0
  if paused <= now and not rate and not guard and not tol and hi_until <= now then redis.call('HDEL', k_gate, 'adapted') end
  tol = tonumber(tol) or 0
  if rate and rate > 0 then
    local iv, b = spacing(rate, burst, p.span)
    interval, burst = math.max(interval, iv), b
  end
  if guard and guard > 0 then
    local iv, b = spacing(rate or p.rate, burst, p.window + guard)
    interval, burst = math.max(interval, iv), b
  end
  if tol > 0 and burst == 1 then bare = spacing(rate or p.rate, 1, p.window) end
  if hi_until > now then
    local out = {ANSWERED, '', tol, interval, bare}
    redis.call('HINCRBY', k_stats, 'deferred', fmt(#tags))
    for _ = 1, #tags do put(out, DEFERRED, math.min(hi_until - now, math.max(interval, 5000)), BEHIND_HIGH, 0) end
    return out
  end
end
`

// coreTailLua is the core and adapt grants' end: each call in turn (the
// loop over tags), the next tick on the line, or beyond the horizon a
// moment to come back (at), one tick after the last deferred caller's
// (defer_at, read only then). Then, before anything is written, the
// calls are handed to the full grant (NEED_UPKEEP) when the keys must be
// extended (the line passes what they were extended to, kept) or, for a
// group of one, the grants of a past clock minute folded into the stats
// hash (see tally). Else the line, the deferred moment, the ticks list
// and the tag record.
const coreTailLua = `
local out = {ANSWERED, '', tol, interval, bare}
local ticks, tagged = emptied(scratch.ticks), emptied(scratch.tagged)
local pace, at, from, deferred = math.floor(interval / burst), 0, math.max(now, paused), 0
for i = 1, #tags do
  local tick = from
  if tick <= last and n < burst then tick = last else tick = math.max(tick, last + interval) end
  if tick - now > p.horizon then
    if deferred == 0 then at = tonumber(redis.call('HGET', k_gate, 'defer_at')) or 0 end
    at, deferred = math.max(tick - p.horizon, at + pace), deferred + 1
    put(out, DEFERRED, at - now, from - now > p.horizon and HELD_BY_PAUSE or BEYOND_HORIZON, 0)
  else
    if tick == last then n = n + 1 else n = 1 end
    last = tick
    if k_ticks == k_tags then
      ticks[#ticks + 1] = held_item(tick, tags[i])
    else
      ticks[#ticks + 1] = tick_item(tick)
      if tags[i] ~= '' then put(tagged, fmt(tick), tags[i]) end
    end
    put(out, GRANTED, tick - now, 0, tick)
  end
end

if math.max(last, at) + p.keep > kept then return handover(NEED_UPKEEP) end
gm, gc = tally(k_stats, gm, gc, #ticks, math.floor(now / 60000000))
if not gm then return handover(NEED_UPKEEP) end
if deferred > 0 then
  redis.call('HSET', k_gate, 'defer_at', fmt(at), 'line', line_of(last, n, gm, gc, kept, wiv, wb, wfresh))
  redis.call('HINCRBY', k_stats, 'deferred', fmt(deferred))
elseif #ticks > 0 then
  redis.call('HSET', k_gate, 'line', line_of(last, n, gm, gc, kept, wiv, wb, wfresh))
end
if refresh then redis.call('HSET', k_gate, 'wide_at', fmt(now)) end
if #ticks > 0 then
  log_ticks(k_ticks, ticks, last, p.tick_log, p.keep, now, k_ticks == k_tags and p.tag_keep or nil)
  if #tagged > 0 then redis.call('ZADD', k_tags, unpack(tagged)) end
end
return out
`
