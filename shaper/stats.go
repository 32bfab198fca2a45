package shaper

import (
	"context"
	"fmt"
	"strconv"
	"time"

	"github.com/redis/go-redis/v9"
)

// minuteCounterLua defines count(key, name, now): it adds one to counter
// name of hash key, counted per clock minute in two slots by minute
// parity (name_m0/name_c0 and name_m1/name_c1), so that stats can tell the
// last minute from the total in constant space. When a slot moves to a
// new minute (roll), the count it held is folded into name: the total is
// name + name_c0 + name_c1 (see counterTotal).
const minuteCounterLua = rollLua + `
local function count(key, name, now)
  count_in(key, name, math.floor(now / 60000000), 1)
end
`

// rollLua defines roll(key, name, slot, m) of minuteCounterLua, and
// count_in(key, name, m, k): k more of counter name in clock minute m
// (not older than the slot's).
const rollLua = `
local function roll(key, name, slot, m)
  local held, c = unpack(redis.call('HMGET', key, name .. '_m' .. slot, name .. '_c' .. slot))
  if tonumber(held) == m then return end
  c = tonumber(c) or 0
  if c > 0 then redis.call('HINCRBY', key, name, c) end
  redis.call('HSET', key, name .. '_m' .. slot, string.format('%d', m), name .. '_c' .. slot, 0)
end
local function count_in(key, name, m, k)
  local slot = tostring(m % 2)
  roll(key, name, slot, m)
  redis.call('HINCRBY', key, name .. '_c' .. slot, string.format('%d', k))
end
`

// counterTotal is the total of a counter of minuteCounterLua: what was
// folded into name, and both minute slots.
func counterTotal(name string, num func(string) int64) int64 {
	return num(name) + num(name+"_c0") + num(name+"_c1")
}

// Stats is a snapshot of one bucket, read in one round trip.
type Stats struct {
	Bucket string
	// ConfiguredRate is the primary limit's rate per Window after burst
	// and guard; EffectiveRate is what the gate grants now (lower after
	// adaptation).
	ConfiguredRate float64
	EffectiveRate  float64
	Window         time.Duration
	RateReason     string
	RateSource     string // "learned" (429s), "announced" (headers), "set" (set by hand), "" (configured)
	// Source names what sets EffectiveRate now: "configured", "announced"
	// (rate-limit headers), "learned" (429s), "set" (set by hand), "margin"
	// (a guard learned from 429s at the full spacing) or "warmup".
	Source string
	// Guard is the guard in force: the policy's, or a wider one learned
	// from 429s (GuardReason says why).
	Guard       time.Duration
	GuardReason string
	// WarmingFor is what is left of a warm-up ramp (0: none).
	WarmingFor time.Duration
	// NextTick is how long until the next free tick (0: now).
	NextTick time.Duration
	// PausedFor is the pause remaining, with its reason.
	PausedFor   time.Duration
	PauseReason string
	// LastPauseUntil and LastPauseReason are the latest pause's end
	// (Redis time) and reason, kept after it ends (zero: never paused).
	LastPauseUntil  time.Time
	LastPauseReason string
	// At is the Redis time of the read.
	At       time.Time
	InFlight int64
	// Counters since the state was created.
	Granted  int64 // ticks granted
	Deferred int64 // reservations deferred (horizon or in-flight cap)
	Late     int64 // ticks given up by callers that woke too late
	Dropped  int64 // ticks given up because a pause began after they were granted, or the server may have changed
	Pauses   int64 // pauses set or extended
	Resets   int64 // times the state was found missing (first use, Redis data loss)
	// RateLimited counts rate-limited answers (CountRateLimited); the
	// LastMinute figures estimate the last 60 s from per-clock-minute
	// counts.
	RateLimited           int64
	GrantedLastMinute     int64
	RateLimitedLastMinute int64
	// Limits is what each limit of the policy has used, in the order of
	// its Limits, read when the policy has a quota; a spent quota holds
	// NextTick back.
	Limits []LimitUse
}

// statsFields are the fields statsScript reads from the stats hash.
var statsFields = []any{"granted", "deferred", "late", "pauses", "resets", "dropped", "rate_limited",
	"granted_m0", "granted_c0", "granted_m1", "granted_c1",
	"rate_limited_m0", "rate_limited_c0", "rate_limited_m1", "rate_limited_c1"}

// statsScript reads a bucket's state against Redis time.
//
// KEYS[1] gate hash, KEYS[2] control hash, KEYS[3] stats hash,
// KEYS[4] in-flight sorted set.
// ARGV[1] Redis time override (µs; 0: TIME), ARGV[2...] the stats hash
// fields to read (statsFields).
// Returns a flat list of name, value pairs: "now", "warm" (gate hash),
// "last", "gm", "gc" (the gate hash's line: the last tick, and the
// grants it has not folded into the stats hash yet, see count_granted),
// "paused_until", "pause_reason", "rate", "rate_source", "rate_reason",
// "guard", "guard_reason" (control hash), "in_flight", and every field
// asked for; missing values are left out, so Go tells them from zero.
var statsScript = redis.NewScript(nowLua + fmtLua + lineFieldLua + `
local now = now_us()
local out = {'now', string.format('%d', now), 'in_flight',
  tostring(redis.call('ZCOUNT', KEYS[4], '(' .. string.format('%d', now), '+inf'))}
local function put_pairs(...)
  local kv = {...}
  for i = 1, #kv, 2 do out[#out + 1] = kv[i]; out[#out + 1] = kv[i + 1] end
end
local function put(key, fields)
  local vals = redis.call('HMGET', key, unpack(fields))
  for i, f in ipairs(fields) do
    if vals[i] then out[#out + 1] = f; out[#out + 1] = vals[i] end
  end
end
put(KEYS[1], {'warm'})
local line = redis.call('HGET', KEYS[1], 'line')
if line then
  local last, _, gm, gc = read_line(line)
  if last then put_pairs('last', fmt(last), 'gm', fmt(gm), 'gc', fmt(gc)) end
end
put(KEYS[2], {'paused_until', 'pause_reason', 'rate', 'rate_source', 'rate_reason', 'guard', 'guard_reason'})
local asked = {}
for i = 2, #ARGV do asked[#asked + 1] = ARGV[i] end
put(KEYS[3], asked)
return out
`)

// lastMinute estimates the count of the last 60 s from the counts of the
// current clock minute and the previous one (slot m0/c0 and m1/c1 of
// counter name), weighting the previous minute by the part of it still
// inside the last 60 s.
func lastMinute(nowUS int64, name string, num func(string) int64) float64 {
	var sum float64
	for _, slot := range []string{"0", "1"} {
		sum += inLastMinute(nowUS, num(name+"_m"+slot)) * float64(num(name+"_c"+slot))
	}
	return sum
}

// inLastMinute is the part of clock minute m inside the 60 s before
// nowUS: 1 for the current minute, the part left of the previous one.
func inLastMinute(nowUS, m int64) float64 {
	switch nowUS / 60_000_000 {
	case m:
		return 1
	case m + 1:
		return 1 - float64(nowUS%60_000_000)/60_000_000
	}
	return 0
}

// Stats reads the bucket's state.
func (b *Bucket) Stats(ctx context.Context) (Stats, error) {
	args := append([]any{b.gate.redisNow()}, statsFields...)
	pairs, err := statsScript.Run(ctx, b.gate.rdb, []string{b.keys.gate, b.keys.control, b.keys.stats, b.keys.inFlight}, args...).StringSlice()
	if err != nil {
		return Stats{}, fmt.Errorf("shaper: stats of %q: %w", b.name, err)
	}
	if len(pairs)%2 != 0 {
		return Stats{}, fmt.Errorf("shaper: stats of %q: unexpected reply %q", b.name, pairs)
	}
	v := make(map[string]string, len(pairs)/2)
	for i := 0; i < len(pairs); i += 2 {
		v[pairs[i]] = pairs[i+1]
	}
	num := func(k string) int64 { n, _ := strconv.ParseInt(v[k], 10, 64); return n }
	now := num("now")
	window := b.policy.Limits[0].Window
	civ, cburst, cguard, ctol := b.spacing()
	st := Stats{
		Bucket:         b.name,
		Window:         window,
		ConfiguredRate: EffectiveRate(civ, cburst, window),
		PauseReason:    v["pause_reason"],
		RateReason:     v["rate_reason"],
		Granted:        counterTotal("granted", num),
		Deferred:       num("deferred"),
		Late:           num("late"),
		Pauses:         num("pauses"),
		Resets:         num("resets"),
		Dropped:        num("dropped"),
		RateLimited:    counterTotal("rate_limited", num),
		InFlight:       num("in_flight"),
	}
	// With the grants the gate hash counts and has not folded into the
	// stats hash yet (see count_granted).
	st.Granted += num("gc")
	st.GrantedLastMinute = int64(lastMinute(now, "granted", num) + inLastMinute(now, num("gm"))*float64(num("gc")) + 0.5)
	st.RateLimitedLastMinute = int64(lastMinute(now, "rate_limited", num) + 0.5)
	iv, burst := civ, cburst
	st.Source, st.Guard = "configured", cguard
	if b.policy.MeasureGuard && cguard != b.policy.Guard {
		st.GuardReason = fmt.Sprintf("measured: calls start within %s of their tick (tolerance), round trips spread %s",
			ctol.Round(100*time.Microsecond), b.meter.spread().Round(100*time.Microsecond))
	}
	rate := float64(b.policy.Limits[0].Rate)
	if r, err := strconv.ParseFloat(v["rate"], 64); err == nil && r > 0 {
		iv, burst = b.policy.withRate(r)
		st.RateSource = v["rate_source"]
		st.Source, rate = st.RateSource, r
	}
	// What else widens the tick, as the reserve script has it.
	widen := func(source string, r float64, guard time.Duration) {
		if w, bu := tickFor(b.policy.Limits[:1], burst, guard, r); w > iv {
			iv, burst, st.Source = w, bu, source
		}
	}
	if g := time.Duration(num("guard")) * time.Microsecond; g > st.Guard {
		st.Guard, st.GuardReason = g, v["guard_reason"]
		source := "margin"
		if st.RateSource == "learned" {
			source = "learned" // a learned rate comes with a wider guard
		}
		widen(source, rate, g)
	}
	if warm := num("warm"); b.policy.Warmup > 0 && warm > 0 && now-warm < b.policy.Warmup.Microseconds() {
		st.WarmingFor = time.Duration(b.policy.Warmup.Microseconds()-max(now-warm, 0)) * time.Microsecond
		from := min(b.policy.WarmupFrom, rate)
		widen("warmup", from+(rate-from)*float64(max(now-warm, 0))/float64(b.policy.Warmup.Microseconds()), st.Guard)
	}
	st.EffectiveRate = EffectiveRate(iv, burst, window)
	if last, ok := v["last"]; ok {
		l, _ := strconv.ParseInt(last, 10, 64)
		st.NextTick = max(time.Duration(l+iv.Microseconds()-now)*time.Microsecond, 0)
	}
	if b.hasQuota() {
		use, err := b.limitUse(ctx)
		if err != nil {
			return Stats{}, err
		}
		st.Limits = use
		for _, u := range use {
			if u.Quota {
				st.NextTick = max(st.NextTick, u.NextIn)
			}
		}
	}
	st.At = time.UnixMicro(now)
	if pu := num("paused_until"); pu > 0 {
		st.LastPauseUntil, st.LastPauseReason = time.UnixMicro(pu), v["pause_reason"]
	}
	if pu := num("paused_until"); pu > now {
		st.PausedFor = time.Duration(pu-now) * time.Microsecond
		st.NextTick = max(st.NextTick, st.PausedFor)
	} else {
		st.PauseReason = ""
	}
	return st, nil
}

// hasQuota reports whether the bucket's policy has a quota.
func (b *Bucket) hasQuota() bool {
	for i := range b.policy.Limits {
		if b.policy.Quota(i) {
			return true
		}
	}
	return false
}
