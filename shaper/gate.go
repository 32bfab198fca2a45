package shaper

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"fmt"
	mrand "math/rand/v2"
	"sync"
	"time"

	"github.com/redis/go-redis/v9"
)

// Clock is the time source of a Gate. Tests inject one; production uses the
// system clock. Sleep returns early with ctx.Err() when ctx ends.
type Clock interface {
	Now() time.Time
	Sleep(ctx context.Context, d time.Duration) error
}

type systemClock struct{}

func (systemClock) Now() time.Time { return time.Now() }

func (systemClock) Sleep(ctx context.Context, d time.Duration) error {
	if d <= 0 {
		return ctx.Err()
	}
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-t.C:
		return nil
	case <-ctx.Done():
		return ctx.Err()
	}
}

// Config configures a Gate.
type Config struct {
	// KeyPrefix is the first part of every key; default "shaper". Tests
	// use a random prefix to share one Redis.
	KeyPrefix string
	// Clock is the local time source; default the system clock. Redis TIME
	// is the authority for ticks: the clock only measures waits, so replicas
	// with skewed clocks agree.
	Clock Clock
}

// Gate releases calls for any number of buckets, sharing each bucket's
// schedule with every other Gate on the same Redis.
type Gate struct {
	rdb    redis.UniversalClient
	prefix string
	clock  Clock

	mu     sync.Mutex
	paused map[string]time.Time     // bucket -> local end of a known pause
	asking map[string]chan struct{} // bucket -> slots for reservations in flight
}

// maxAsking bounds the reservations one gate has in flight to Redis for
// one bucket. Callers beyond it wait their turn in the process: a crowd of
// callers would otherwise queue inside Redis, and a slow round trip uses
// up the tolerance, so every grant would be given up.
const maxAsking = 16

func (g *Gate) askSlots(bucket string) chan struct{} {
	g.mu.Lock()
	defer g.mu.Unlock()
	c, ok := g.asking[bucket]
	if !ok {
		c = make(chan struct{}, maxAsking)
		g.asking[bucket] = c
	}
	return c
}

// NewGate returns a gate on rdb. The gate never closes rdb.
func NewGate(rdb redis.UniversalClient, cfg Config) *Gate {
	g := &Gate{rdb: rdb, prefix: cfg.KeyPrefix, clock: cfg.Clock, paused: map[string]time.Time{}, asking: map[string]chan struct{}{}}
	if g.prefix == "" {
		g.prefix = DefaultKeyPrefix
	}
	if g.clock == nil {
		g.clock = systemClock{}
	}
	return g
}

// Bucket is the handle of one bucket shaped by one policy. Handles are
// cheap: make a new one when the policy changes; the state lives in Redis.
type Bucket struct {
	gate     *Gate
	name     string
	policy   Policy
	interval time.Duration
	burst    int
	keys     []string
}

// Bucket returns the handle of bucket name shaped by p, or an error naming
// what is wrong with p.
func (g *Gate) Bucket(name string, p Policy) (*Bucket, error) {
	if err := checkBucket(name); err != nil {
		return nil, err
	}
	if err := p.Validate(); err != nil {
		return nil, fmt.Errorf("shaper: bucket %q: %w", name, err)
	}
	p = p.withDefaults()
	iv, burst := p.Tick()
	return &Bucket{
		gate: g, name: name, policy: p, interval: iv, burst: burst,
		keys: []string{
			gateKey(g.prefix, name), controlKey(g.prefix, name),
			statsKey(g.prefix, name), inFlightKey(g.prefix, name),
			replicasKey(g.prefix, name),
		},
	}, nil
}

// Name returns the bucket's name.
func (b *Bucket) Name() string { return b.name }

// Policy returns the bucket's policy with defaults applied.
func (b *Bucket) Policy() Policy { return b.policy }

// Tick returns the configured release interval and burst.
func (b *Bucket) Tick() (time.Duration, int) { return b.interval, b.burst }

// DeferReason says why a reservation was not granted.
type DeferReason int

// Reasons a reservation is deferred.
const (
	Granted       DeferReason = iota // not deferred
	BeyondHorizon                    // the next tick is further than the horizon: backlog or pause
	InFlightFull                     // max_in_flight slots are all taken
	StateReset                       // the state was missing (first use or lost): waiting out the horizon
)

func (r DeferReason) String() string {
	switch r {
	case Granted:
		return "granted"
	case BeyondHorizon:
		return "beyond horizon"
	case InFlightFull:
		return "in-flight cap"
	case StateReset:
		return "state reset"
	}
	return fmt.Sprintf("DeferReason(%d)", int(r))
}

// Reservation is the answer of one round trip to the gate.
type Reservation struct {
	// OK is true when a tick was granted; the call may start Wait from
	// the moment of the reservation, and no later than Tolerance after.
	OK bool
	// Wait is the time until the tick when OK, else how long to wait
	// before asking again.
	Wait   time.Duration
	Reason DeferReason
	lease  string
}

// reserveScript reserves the next release tick of one bucket.
//
// KEYS[1] gate hash, KEYS[2] control hash, KEYS[3] stats hash,
// KEYS[4] in-flight sorted set, KEYS[5] replicas hash (see keys.go).
// ARGV[1] tick interval (µs) of the caller's policy
// ARGV[2] burst of the caller's policy
// ARGV[3] horizon (µs): no tick is reserved further ahead than this
// ARGV[4] max in flight (0: no cap)
// ARGV[5] lease TTL (µs), counted from the tick
// ARGV[6] lease id ("" without a cap)
// ARGV[7] the primary limit's window + guard (µs), to space a lowered rate
// Returns {granted (0|1), wait (µs), reason}: when granted, wait is the time
// from Redis now to the tick; when not, the time before asking again and
// reason says why (see DeferReason).
var reserveScript = redis.NewScript(minuteCounterLua + `
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000000 + tonumber(t[2])
local interval = tonumber(ARGV[1])
local burst = tonumber(ARGV[2])
local horizon = tonumber(ARGV[3])
local maxif = tonumber(ARGV[4])

-- While live replicas disagree on the config (a rolling edit), the most
-- conservative tick wins.
local peers = redis.call('HGETALL', KEYS[5])
for i = 2, #peers, 2 do
  local iv, b, seen = string.match(peers[i], '^(%d+)|(%d+)|(%d+)$')
  if iv and now - tonumber(seen) < 5000000 then
    if tonumber(iv) > interval then interval = tonumber(iv) end
    if tonumber(b) < burst then burst = tonumber(b) end
  end
end

local ctl = redis.call('HMGET', KEYS[2], 'paused_until', 'rate')
local paused = tonumber(ctl[1]) or 0
local rate = tonumber(ctl[2])
if rate and rate > 0 then
  -- The primary limit lowered to rate calls per window (see tickFor).
  local b = math.max(1, math.min(burst, math.floor(rate)))
  local k = rate / b
  if k >= 1 then k = math.floor(k) end
  local iv = math.ceil(tonumber(ARGV[7]) / k)
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
  redis.call('ZADD', KEYS[4], string.format('%d', tick + tonumber(ARGV[5])), ARGV[6])
end
redis.call('HSET', KEYS[1], 'last', string.format('%d', tick), 'n', n)
count(KEYS[3], 'granted', now)
return {1, tick - now, 0}
`)

// Reserve asks for the next release tick in one Redis round trip. Being
// deferred is not an error: errors mean Redis failed.
func (b *Bucket) Reserve(ctx context.Context) (Reservation, error) {
	var lease string
	if b.policy.MaxInFlight > 0 {
		lease = newLeaseID()
	}
	res, err := reserveScript.Run(ctx, b.gate.rdb, b.keys,
		b.interval.Microseconds(), b.burst, b.policy.Horizon.Microseconds(),
		b.policy.MaxInFlight, b.policy.LeaseTTL.Microseconds(), lease,
		(b.policy.Limits[0].Window + b.policy.Guard).Microseconds()).Int64Slice()
	if err != nil {
		return Reservation{}, fmt.Errorf("shaper: reserve a tick for %q: %w", b.name, err)
	}
	if len(res) != 3 {
		return Reservation{}, fmt.Errorf("shaper: reserve a tick for %q: unexpected reply %v", b.name, res)
	}
	r := Reservation{OK: res[0] == 1, Wait: time.Duration(res[1]) * time.Microsecond, Reason: DeferReason(res[2])}
	if r.OK {
		r.lease = lease
	}
	return r, nil
}

// minuteCounterLua defines count(key, name, now): it adds one to the
// counter name of hash key, and to its count for the current clock minute
// (two slots, name_m0/name_c0 and name_m1/name_c1, by minute parity), so
// that stats can tell the last minute from the total in constant space.
const minuteCounterLua = `
local function count(key, name, now)
  local m = math.floor(now / 60000000)
  local slot = tostring(m % 2)
  if tonumber(redis.call('HGET', key, name .. '_m' .. slot)) ~= m then
    redis.call('HSET', key, name .. '_m' .. slot, string.format('%d', m), name .. '_c' .. slot, 0)
  end
  redis.call('HINCRBY', key, name .. '_c' .. slot, 1)
  redis.call('HINCRBY', key, name, 1)
end
`

// heartbeatScript records the tick of one live replica's config, and
// forgets replicas not heard from for a minute.
//
// KEYS[1] replicas hash. ARGV[1] replica id, ARGV[2] interval (µs),
// ARGV[3] burst. Returns 0.
var heartbeatScript = redis.NewScript(`
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000000 + tonumber(t[2])
redis.call('HSET', KEYS[1], ARGV[1], ARGV[2] .. '|' .. ARGV[3] .. '|' .. string.format('%d', now))
local all = redis.call('HGETALL', KEYS[1])
for i = 2, #all, 2 do
  local seen = tonumber(string.match(all[i], '|(%d+)$'))
  if seen and now - seen > 60000000 then redis.call('HDEL', KEYS[1], all[i - 1]) end
end
return 0
`)

// Heartbeat tells every replica this one's configured tick, so that while
// replicas disagree (a rolling config edit) the gate uses the most
// conservative live one. Workers call it about every half second; a
// replica silent for 5 s no longer counts.
func (b *Bucket) Heartbeat(ctx context.Context, replica string) error {
	err := heartbeatScript.Run(ctx, b.gate.rdb, []string{b.keys[4]}, replica, b.interval.Microseconds(), b.burst).Err()
	if err != nil {
		return fmt.Errorf("shaper: heartbeat for %q: %w", b.name, err)
	}
	return nil
}

// ReplicaTick is one live replica's configured tick.
type ReplicaTick struct {
	Replica  string
	Interval time.Duration
	Burst    int
}

// Replicas returns the ticks of the replicas heard from in the last 5 s.
func (b *Bucket) Replicas(ctx context.Context) ([]ReplicaTick, error) {
	all, err := b.gate.rdb.HGetAll(ctx, b.keys[4]).Result()
	if err != nil {
		return nil, fmt.Errorf("shaper: replicas of %q: %w", b.name, err)
	}
	now, err := b.gate.rdb.Time(ctx).Result()
	if err != nil {
		return nil, fmt.Errorf("shaper: replicas of %q: %w", b.name, err)
	}
	var out []ReplicaTick
	for id, v := range all {
		var iv, burst, seen int64
		if _, err := fmt.Sscanf(v, "%d|%d|%d", &iv, &burst, &seen); err != nil {
			continue
		}
		if now.UnixMicro()-seen < 5_000_000 {
			out = append(out, ReplicaTick{Replica: id, Interval: time.Duration(iv) * time.Microsecond, Burst: int(burst)})
		}
	}
	return out, nil
}

// releaseScript frees an in-flight lease and counts a tick given up.
//
// KEYS[1] in-flight sorted set, KEYS[2] stats hash.
// ARGV[1] lease id ("" for none), ARGV[2] the counter to add one to
// ("late", "dropped") or "".
// Returns 0.
var releaseScript = redis.NewScript(`
if ARGV[1] ~= '' then redis.call('ZREM', KEYS[1], ARGV[1]) end
if ARGV[2] ~= '' then redis.call('HINCRBY', KEYS[2], ARGV[2], 1) end
return 0
`)

// Why a tick was given up, for the stats.
const (
	gaveUpLate    = "late"
	gaveUpDropped = "dropped"
)

func (b *Bucket) release(ctx context.Context, lease string, counter string) error {
	if lease == "" && counter == "" {
		return nil
	}
	if err := releaseScript.Run(ctx, b.gate.rdb, []string{b.keys[3], b.keys[2]}, lease, counter).Err(); err != nil {
		return fmt.Errorf("shaper: release for %q: %w", b.name, err)
	}
	return nil
}

// Permit is the right to start one call now.
type Permit struct {
	// Tick is the local time of the granted tick; Late is how long after
	// it the permit was handed out (at most the policy's Tolerance).
	Tick time.Time
	Late time.Duration

	bucket *Bucket
	lease  string
}

// Release frees the permit's in-flight slot when the bucket has a
// max_in_flight cap; call it when the call has finished. Without a cap it
// does nothing. A permit never released frees its slot after LeaseTTL.
func (p *Permit) Release(ctx context.Context) error {
	if p == nil || p.lease == "" {
		return nil
	}
	lease := p.lease
	p.lease = ""
	return p.bucket.release(ctx, lease, "")
}

// Acquire blocks until the caller may start one call, and returns a permit
// for it. It keeps the bucket's contract: a call starts within Tolerance of
// its tick or not at all; a caller that wakes later gives the tick up and
// asks again. It returns an error when ctx ends or Redis fails.
func (b *Bucket) Acquire(ctx context.Context) (*Permit, error) {
	p, _, err := b.AcquireWithin(ctx, 0)
	return p, err
}

// AcquireWithin is Acquire for callers that must not hold a goroutine
// through a long wait (a pause of an hour): when the next chance to call
// is further away than maxWait, it returns no permit and how long to wait
// before trying again. maxWait <= 0 means no bound.
func (b *Bucket) AcquireWithin(ctx context.Context, maxWait time.Duration) (*Permit, time.Duration, error) {
	clock := b.gate.clock
	slots := b.gate.askSlots(b.name)
	for {
		select {
		case slots <- struct{}{}:
		case <-ctx.Done():
			return nil, 0, ctx.Err()
		}
		sent := clock.Now()
		r, err := b.Reserve(ctx)
		recv := clock.Now()
		<-slots
		if err != nil {
			return nil, 0, err
		}
		if !r.OK {
			wait := r.Wait
			if r.Reason == InFlightFull { // the others come back one tick apart already
				wait += time.Duration(mrand.Int64N(int64(min(b.interval, time.Second)) + 1))
			}
			if maxWait > 0 && wait > maxWait {
				return nil, wait, nil
			}
			if err := clock.Sleep(ctx, wait); err != nil {
				return nil, 0, err
			}
			continue
		}
		// Redis read its clock somewhere between sent and recv, so the tick
		// is somewhere in [sent+Wait, recv+Wait]. Start no earlier than the
		// latest and no later than Tolerance after the earliest: a slow
		// round trip uses up tolerance.
		earliest := sent.Add(r.Wait)
		tick := recv.Add(r.Wait)
		if err := clock.Sleep(ctx, tick.Sub(clock.Now())); err != nil {
			_ = b.release(context.WithoutCancel(ctx), r.lease, "")
			return nil, 0, err
		}
		now := clock.Now()
		if late := now.Sub(earliest); late > b.policy.Tolerance {
			if err := b.release(ctx, r.lease, gaveUpLate); err != nil {
				return nil, 0, err
			}
			continue
		}
		if b.gate.pausedAt(b.name, now) {
			// Reserved before a pause began: the vendor just said stop.
			if err := b.release(ctx, r.lease, gaveUpDropped); err != nil {
				return nil, 0, err
			}
			continue
		}
		late := now.Sub(earliest)
		return &Permit{Tick: tick, Late: max(late, 0), bucket: b, lease: r.lease}, 0, nil
	}
}

func newLeaseID() string {
	var buf [12]byte
	_, _ = rand.Read(buf[:])
	return hex.EncodeToString(buf[:])
}
