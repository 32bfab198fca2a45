package shaper

import (
	"context"
	"fmt"
	"strconv"
	"time"

	"github.com/redis/go-redis/v9"
)

// pauseScript pauses a bucket for every replica.
//
// KEYS[1] control hash, KEYS[2] stats hash.
// ARGV[1] pause length (µs) from Redis now, ARGV[2] reason.
// Returns the pause remaining (µs): the longer of the existing pause and
// the new one. A pause only ever extends.
var pauseScript = redis.NewScript(`
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000000 + tonumber(t[2])
local untilv = now + tonumber(ARGV[1])
local cur = tonumber(redis.call('HGET', KEYS[1], 'paused_until')) or 0
if untilv > cur then
  redis.call('HSET', KEYS[1], 'paused_until', string.format('%d', untilv), 'pause_reason', ARGV[2])
  redis.call('HINCRBY', KEYS[2], 'pauses', 1)
  cur = untilv
end
return math.max(cur - now, 0)
`)

// Pause stops releases of the bucket for d on every replica (ticks already
// reserved still go out, at most Horizon of them), and records why. An
// existing longer pause is kept. It returns the pause now in force.
func (b *Bucket) Pause(ctx context.Context, d time.Duration, reason string) (time.Duration, error) {
	if d < 0 {
		return 0, fmt.Errorf("shaper: pause %q for %s: a pause must not be negative", b.name, d)
	}
	left, err := pauseScript.Run(ctx, b.gate.rdb, []string{b.keys[1], b.keys[2]}, d.Microseconds(), reason).Int64()
	if err != nil {
		return 0, fmt.Errorf("shaper: pause %q: %w", b.name, err)
	}
	return time.Duration(left) * time.Microsecond, nil
}

// SetRate lowers the bucket's effective rate to rate calls per window of
// its primary limit, for every replica, and records why. A rate above the
// configured one is capped to it. Fractions below 1 are allowed (0.5 is one
// call every two windows).
func (b *Bucket) SetRate(ctx context.Context, rate float64, reason string) error {
	if !(rate > 0) {
		return fmt.Errorf("shaper: set rate of %q to %v: the rate must be positive", b.name, rate)
	}
	rate = min(rate, float64(b.policy.Limits[0].Rate))
	iv, burst := b.policy.WithRate(rate)
	err := b.gate.rdb.HSet(ctx, b.keys[1],
		"min_interval", iv.Microseconds(), "max_burst", burst,
		"rate", strconv.FormatFloat(rate, 'f', -1, 64), "rate_reason", reason).Err()
	if err != nil {
		return fmt.Errorf("shaper: set rate of %q: %w", b.name, err)
	}
	return nil
}

// ClearRate restores the configured rate.
func (b *Bucket) ClearRate(ctx context.Context) error {
	if err := b.gate.rdb.HDel(ctx, b.keys[1], "min_interval", "max_burst", "rate", "rate_reason").Err(); err != nil {
		return fmt.Errorf("shaper: clear rate of %q: %w", b.name, err)
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
	Pauses   int64 // pauses set or extended
	Resets   int64 // times the state was found missing (first use, Redis data loss)
}

// statsScript reads a bucket's state against Redis time.
//
// KEYS[1] gate hash, KEYS[2] control hash, KEYS[3] stats hash,
// KEYS[4] in-flight sorted set.
// Returns {now, last, paused_until, pause_reason, min_interval, max_burst,
// rate_reason, granted, deferred, late, pauses, resets, in_flight}, with
// missing values as "" (strings) so that Go tells them from zero.
var statsScript = redis.NewScript(`
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000000 + tonumber(t[2])
local g = redis.call('HMGET', KEYS[1], 'last')
local c = redis.call('HMGET', KEYS[2], 'paused_until', 'pause_reason', 'min_interval', 'max_burst', 'rate_reason')
local s = redis.call('HMGET', KEYS[3], 'granted', 'deferred', 'late', 'pauses', 'resets')
local inflight = redis.call('ZCOUNT', KEYS[4], '(' .. string.format('%d', now), '+inf')
local out = {string.format('%d', now), g[1] or ''}
for i = 1, 5 do out[#out + 1] = c[i] or '' end
for i = 1, 5 do out[#out + 1] = s[i] or '' end
out[#out + 1] = tostring(inflight)
return out
`)

// Stats reads the bucket's state.
func (b *Bucket) Stats(ctx context.Context) (Stats, error) {
	vals, err := statsScript.Run(ctx, b.gate.rdb, b.keys).StringSlice()
	if err != nil {
		return Stats{}, fmt.Errorf("shaper: stats of %q: %w", b.name, err)
	}
	if len(vals) != 13 {
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
		InFlight:       num(vals[12]),
	}
	iv, burst := b.interval, b.burst
	if mi := time.Duration(num(vals[4])) * time.Microsecond; mi > iv {
		iv = mi
	}
	if mb := int(num(vals[5])); mb > 0 && mb < burst {
		burst = mb
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
