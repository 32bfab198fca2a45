package shaper

import (
	"context"
	"fmt"
	"math"
	"strconv"
	"strings"
	"time"

	"github.com/redis/go-redis/v9"
)

// pauseScript pauses a bucket for every replica.
//
// KEYS[1] control hash, KEYS[2] stats hash.
// ARGV[1] pause length (µs) from Redis now, ARGV[2] reason,
// ARGV[3] pause channel, ARGV[4] bucket name.
// Returns the pause remaining (µs): the longer of the existing pause and
// the new one. A pause only ever extends. A new or longer pause is
// published as "<bucket>|<µs remaining>" so that watching gates drop the
// ticks they already hold.
var pauseScript = redis.NewScript(`
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000000 + tonumber(t[2])
local untilv = now + tonumber(ARGV[1])
local cur = tonumber(redis.call('HGET', KEYS[1], 'paused_until')) or 0
if untilv > cur then
  redis.call('HSET', KEYS[1], 'paused_until', string.format('%d', untilv), 'pause_reason', ARGV[2])
  redis.call('HINCRBY', KEYS[2], 'pauses', 1)
  redis.call('PUBLISH', ARGV[3], ARGV[4] .. '|' .. string.format('%d', untilv - now))
  cur = untilv
end
return math.max(cur - now, 0)
`)

// Pause stops releases of the bucket for d on every replica, and records
// why. An existing longer pause is kept. Gates that Watch drop the ticks
// they already reserved inside the pause; others let them go out (at most
// Horizon of them). It returns the pause now in force.
func (b *Bucket) Pause(ctx context.Context, d time.Duration, reason string) (time.Duration, error) {
	if d < 0 {
		return 0, fmt.Errorf("shaper: pause %q for %s: a pause must not be negative", b.name, d)
	}
	left, err := pauseScript.Run(ctx, b.gate.rdb, []string{b.keys[1], b.keys[2]}, d.Microseconds(), reason,
		pauseChannel(b.gate.prefix), b.name).Int64()
	if err != nil {
		return 0, fmt.Errorf("shaper: pause %q: %w", b.name, err)
	}
	pause := time.Duration(left) * time.Microsecond
	b.gate.notePause(b.name, b.gate.clock.Now().Add(pause))
	return pause, nil
}

// Watch keeps the gate told of pauses set by any replica, until ctx ends,
// so that Acquire drops ticks it reserved before a pause began instead of
// calling a vendor that just said 429. It resubscribes after errors.
func (g *Gate) Watch(ctx context.Context) {
	for ctx.Err() == nil {
		sub := g.rdb.Subscribe(ctx, pauseChannel(g.prefix))
		stop := context.AfterFunc(ctx, func() { _ = sub.Close() }) // unblocks ReceiveMessage
		for {
			msg, err := sub.ReceiveMessage(ctx)
			if err != nil {
				break
			}
			bucket, us, ok := strings.Cut(msg.Payload, "|")
			n, err := strconv.ParseInt(us, 10, 64)
			if !ok || err != nil {
				continue
			}
			g.notePause(bucket, g.clock.Now().Add(time.Duration(n)*time.Microsecond))
		}
		stop()
		_ = sub.Close()
		select {
		case <-ctx.Done():
		case <-time.After(time.Second):
		}
	}
}

func (g *Gate) notePause(bucket string, until time.Time) {
	g.mu.Lock()
	defer g.mu.Unlock()
	if cur, ok := g.paused[bucket]; !ok || until.After(cur) {
		g.paused[bucket] = until
	}
}

// pausedAt reports whether bucket is known to be paused at t.
func (g *Gate) pausedAt(bucket string, t time.Time) bool {
	g.mu.Lock()
	defer g.mu.Unlock()
	until, ok := g.paused[bucket]
	return ok && t.Before(until)
}

// SetRate lowers the bucket's effective rate to rate calls per window of
// its primary limit, for every replica, and records why. A rate above the
// configured one is capped to it. Fractions below 1 are allowed (0.5 is one
// call every two windows). Rates set here are not changed by Recover.
func (b *Bucket) SetRate(ctx context.Context, rate float64, reason string) error {
	return b.setRate(ctx, rate, reason, "set")
}

func (b *Bucket) setRate(ctx context.Context, rate float64, reason, source string) error {
	if !(rate > 0) || math.IsInf(rate, 0) {
		return fmt.Errorf("shaper: set rate of %q to %v: the rate must be positive", b.name, rate)
	}
	rate = min(rate, float64(b.policy.Limits[0].Rate))
	err := b.gate.rdb.HSet(ctx, b.keys[1], "rate", strconv.FormatFloat(rate, 'f', -1, 64),
		"rate_reason", reason, "rate_source", source).Err()
	if err != nil {
		return fmt.Errorf("shaper: set rate of %q: %w", b.name, err)
	}
	return nil
}

// ClearRate restores the configured rate.
func (b *Bucket) ClearRate(ctx context.Context) error {
	if err := b.gate.rdb.HDel(ctx, b.keys[1], "rate", "rate_reason", "rate_source", "hi", "lo").Err(); err != nil {
		return fmt.Errorf("shaper: clear rate of %q: %w", b.name, err)
	}
	return nil
}

// Announce applies a limit the vendor announced (rate-limit headers), as
// calls per window of the primary limit: below the configured rate it
// becomes the effective rate; at or above it, an earlier announcement is
// cleared. Learned rates are replaced.
func (b *Bucket) Announce(ctx context.Context, rate float64, reason string) error {
	if rate < float64(b.policy.Limits[0].Rate) {
		return b.setRate(ctx, rate, reason, "announced")
	}
	src, err := b.gate.rdb.HGet(ctx, b.keys[1], "rate_source").Result()
	if err != nil && err != redis.Nil {
		return fmt.Errorf("shaper: announce a rate for %q: %w", b.name, err)
	}
	if src == "announced" {
		return b.ClearRate(ctx)
	}
	return nil
}

// throttleScript records a rate-limited answer and lowers the effective
// rate multiplicatively, at most once per cooldown, never below the last
// rate that stayed quiet (lo) when the failure came above it.
//
// KEYS[1] control hash.
// ARGV[1] configured rate, ARGV[2] decrease factor (0..1), ARGV[3] floor
// rate, ARGV[4] cooldown (µs), ARGV[5] reason.
// Returns the effective rate after the call, as a string.
var throttleScript = redis.NewScript(`
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000000 + tonumber(t[2])
local c = redis.call('HMGET', KEYS[1], 'rate', 'last_decrease', 'lo')
redis.call('HSET', KEYS[1], 'last_throttle', string.format('%d', now))
local cur = tonumber(c[1]) or tonumber(ARGV[1])
if now - (tonumber(c[2]) or 0) < tonumber(ARGV[4]) then
  return tostring(cur)
end
local new = math.max(cur * tonumber(ARGV[2]), tonumber(ARGV[3]))
local lo = tonumber(c[3])
if lo and lo < cur and lo > new then
  new = lo
elseif lo then
  redis.call('HDEL', KEYS[1], 'lo') -- failed at or below the old safe rate: the limit moved
end
redis.call('HSET', KEYS[1], 'rate', tostring(new), 'hi', tostring(cur), 'last_change', string.format('%d', now),
  'last_decrease', string.format('%d', now), 'rate_reason', ARGV[5], 'rate_source', 'learned')
return tostring(new)
`)

// Adapt says how a bucket learns from rate-limited answers that carry no
// limit: multiplicative decrease, additive recovery after quiet periods.
type Adapt struct {
	Decrease float64       // factor applied on a 429; default 0.7
	Increase float64       // share of the configured rate added per quiet period; default 0.05
	Quiet    time.Duration // time without 429s before a step up; default 10s
	Probe    time.Duration // time without 429s after which the rate that failed is forgotten; default 1m
	Floor    float64       // lowest rate, as a share of the configured rate; default 0.02
}

func (a Adapt) withDefaults() Adapt {
	if a.Decrease <= 0 || a.Decrease >= 1 {
		a.Decrease = 0.7
	}
	if a.Increase <= 0 {
		a.Increase = 0.05
	}
	if a.Quiet <= 0 {
		a.Quiet = 10 * time.Second
	}
	if a.Probe <= 0 {
		a.Probe = time.Minute
	}
	if a.Floor <= 0 || a.Floor > 1 {
		a.Floor = 0.02
	}
	return a
}

// Throttled records that the vendor rate-limited a call without saying
// its limit, and lowers the effective rate for every replica (at most once
// per window). It returns the effective rate now in force.
func (b *Bucket) Throttled(ctx context.Context, reason string) (float64, error) {
	a := b.policy.Adapt.withDefaults()
	cfg := float64(b.policy.Limits[0].Rate)
	cooldown := b.policy.Limits[0].Window + b.policy.Guard
	s, err := throttleScript.Run(ctx, b.gate.rdb, []string{b.keys[1]}, cfg, a.Decrease, cfg*a.Floor,
		cooldown.Microseconds(), reason).Text()
	if err != nil {
		return 0, fmt.Errorf("shaper: throttle %q: %w", b.name, err)
	}
	return strconv.ParseFloat(s, 64)
}

// recoverScript raises a learned effective rate one step after a quiet
// period, capped just below the rate that last failed (hi) until that
// failure is old, and clears it once back at the configured rate.
//
// KEYS[1] control hash.
// ARGV[1] configured rate, ARGV[2] step (calls per window), ARGV[3] quiet
// period (µs), ARGV[4] probe age (µs).
// Returns "" when nothing changed, else the new rate ("0" when cleared).
var recoverScript = redis.NewScript(`
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000000 + tonumber(t[2])
local c = redis.call('HMGET', KEYS[1], 'rate', 'last_change', 'last_throttle', 'hi', 'rate_source')
local cur = tonumber(c[1])
if not cur or c[5] ~= 'learned' then return '' end
local quiet = tonumber(ARGV[3])
local sinceThrottle = now - (tonumber(c[3]) or 0)
if now - (tonumber(c[2]) or 0) < quiet or sinceThrottle < quiet then return '' end
local cfg = tonumber(ARGV[1])
local hi = tonumber(c[4]) or cfg
if sinceThrottle >= tonumber(ARGV[4]) then hi = cfg * 2 end
local new = math.min(cur + tonumber(ARGV[2]), hi * 0.97)
if new <= cur then
  redis.call('HSET', KEYS[1], 'lo', tostring(cur), 'last_change', string.format('%d', now))
  return ''
end
if new >= cfg then
  redis.call('HDEL', KEYS[1], 'rate', 'rate_reason', 'rate_source', 'hi', 'lo')
  redis.call('HSET', KEYS[1], 'last_change', string.format('%d', now))
  return '0'
end
redis.call('HSET', KEYS[1], 'rate', tostring(new), 'lo', tostring(cur), 'last_change', string.format('%d', now),
  'rate_reason', 'recovering after a quiet period')
return tostring(new)
`)

// Recover raises a learned effective rate by one step when the vendor has
// been quiet for a quiet period. Replicas may all call it: a step happens
// once per period. It reports the new rate (0: back to the configured one)
// and whether anything changed.
func (b *Bucket) Recover(ctx context.Context) (float64, bool, error) {
	a := b.policy.Adapt.withDefaults()
	cfg := float64(b.policy.Limits[0].Rate)
	s, err := recoverScript.Run(ctx, b.gate.rdb, []string{b.keys[1]}, cfg, cfg*a.Increase,
		a.Quiet.Microseconds(), a.Probe.Microseconds()).Text()
	if err != nil {
		return 0, false, fmt.Errorf("shaper: recover %q: %w", b.name, err)
	}
	if s == "" {
		return 0, false, nil
	}
	r, err := strconv.ParseFloat(s, 64)
	return r, err == nil, err
}

// noteThrottledScript counts a rate-limited answer.
//
// KEYS[1] stats hash. Returns 0.
var noteThrottledScript = redis.NewScript(minuteCounterLua + `
local t = redis.call('TIME')
count(KEYS[1], 'throttled', tonumber(t[1]) * 1000000 + tonumber(t[2]))
return 0
`)

// NoteThrottled counts one rate-limited answer (429) for the stats.
func (b *Bucket) NoteThrottled(ctx context.Context) error {
	if err := noteThrottledScript.Run(ctx, b.gate.rdb, []string{b.keys[2]}).Err(); err != nil {
		return fmt.Errorf("shaper: count a 429 for %q: %w", b.name, err)
	}
	return nil
}

// Stats is a snapshot of one bucket, read in one round trip.
type Stats struct {
	Bucket string
	// ConfiguredRate is the primary limit's rate per Window after burst
	// and guard; EffectiveRate is what the gate releases now (lower after
	// SetRate).
	ConfiguredRate float64
	EffectiveRate  float64
	Window         time.Duration
	RateReason     string
	RateSource     string // "learned" (429s), "announced" (headers), "set" (SetRate), "" (configured)
	// NextTick is how long until the next free tick (0: now).
	NextTick time.Duration
	// PausedFor is the pause remaining, with its reason.
	PausedFor   time.Duration
	PauseReason string
	InFlight    int64
	// Counters since the state was created.
	Granted  int64 // ticks granted
	Deferred int64 // reservations deferred (horizon or in-flight cap)
	Late     int64 // ticks given up by callers that woke too late
	Dropped  int64 // ticks dropped because a pause began after they were reserved
	Pauses   int64 // pauses set or extended
	Resets   int64 // times the state was found missing (first use, Redis data loss)
	// Throttled counts rate-limited answers (NoteThrottled); the LastMinute
	// figures estimate the last 60 s from per-clock-minute counts.
	Throttled           int64
	GrantedLastMinute   int64
	ThrottledLastMinute int64
}

// statsScript reads a bucket's state against Redis time.
//
// KEYS[1] gate hash, KEYS[2] control hash, KEYS[3] stats hash,
// KEYS[4] in-flight sorted set.
// Returns {now, last, paused_until, pause_reason, rate, rate_source,
// rate_reason, granted, deferred, late, pauses, resets, dropped, in_flight}, with
// missing values as "" (strings) so that Go tells them from zero.
var statsScript = redis.NewScript(`
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000000 + tonumber(t[2])
local g = redis.call('HMGET', KEYS[1], 'last')
local c = redis.call('HMGET', KEYS[2], 'paused_until', 'pause_reason', 'rate', 'rate_source', 'rate_reason')
local s = redis.call('HMGET', KEYS[3], 'granted', 'deferred', 'late', 'pauses', 'resets', 'dropped',
  'throttled', 'granted_m0', 'granted_c0', 'granted_m1', 'granted_c1', 'throttled_m0', 'throttled_c0', 'throttled_m1', 'throttled_c1')
local inflight = redis.call('ZCOUNT', KEYS[4], '(' .. string.format('%d', now), '+inf')
local out = {string.format('%d', now), g[1] or ''}
for i = 1, 5 do out[#out + 1] = c[i] or '' end
for i = 1, 15 do out[#out + 1] = s[i] or '' end
out[#out + 1] = tostring(inflight)
return out
`)

// lastMinute estimates the count of the last 60 s from the counts of the
// current clock minute and the previous one (m0, c0, m1, c1), weighting
// the previous minute by the part of it still inside the last 60 s.
func lastMinute(nowUS int64, v []string, num func(string) int64) int64 {
	m := nowUS / 60_000_000
	frac := float64(nowUS%60_000_000) / 60_000_000
	var cur, prev int64
	for i := 0; i < 4; i += 2 {
		switch num(v[i]) {
		case m:
			cur = num(v[i+1])
		case m - 1:
			prev = num(v[i+1])
		}
	}
	return cur + int64(float64(prev)*(1-frac)+0.5)
}

// Stats reads the bucket's state.
func (b *Bucket) Stats(ctx context.Context) (Stats, error) {
	vals, err := statsScript.Run(ctx, b.gate.rdb, b.keys).StringSlice()
	if err != nil {
		return Stats{}, fmt.Errorf("shaper: stats of %q: %w", b.name, err)
	}
	if len(vals) != 23 {
		return Stats{}, fmt.Errorf("shaper: stats of %q: unexpected reply %q", b.name, vals)
	}
	num := func(s string) int64 { n, _ := strconv.ParseInt(s, 10, 64); return n }
	now := num(vals[0])
	window := b.policy.Limits[0].Window
	st := Stats{
		Bucket:         b.name,
		Window:         window,
		ConfiguredRate: EffectiveRate(b.interval, b.burst, window),
		PauseReason:    vals[3],
		RateReason:     vals[6],
		Granted:        num(vals[7]),
		Deferred:       num(vals[8]),
		Late:           num(vals[9]),
		Pauses:         num(vals[10]),
		Resets:         num(vals[11]),
		Dropped:        num(vals[12]),
		Throttled:      num(vals[13]),
		InFlight:       num(vals[22]),
	}
	st.GrantedLastMinute = lastMinute(now, vals[14:18], num)
	st.ThrottledLastMinute = lastMinute(now, vals[18:22], num)
	iv, burst := b.interval, b.burst
	if r, err := strconv.ParseFloat(vals[4], 64); err == nil && r > 0 {
		iv, burst = b.policy.WithRate(r)
		st.RateSource = vals[5]
	}
	st.EffectiveRate = EffectiveRate(iv, burst, window)
	if vals[1] != "" {
		st.NextTick = max(time.Duration(num(vals[1])+iv.Microseconds()-now)*time.Microsecond, 0)
	}
	if pu := num(vals[2]); pu > now {
		st.PausedFor = time.Duration(pu-now) * time.Microsecond
		st.NextTick = max(st.NextTick, st.PausedFor)
	} else {
		st.PauseReason = ""
	}
	return st, nil
}
