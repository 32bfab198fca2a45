package shaper

import (
	"context"
	"fmt"
	"strconv"
	"strings"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/shaper-dev/shaper/internal/redisonce"
)

// adaptedLua defines adapted(k_gate): the bucket's gate hash, if there
// is one, says that something beyond the common line shapes it (in its
// control hash a pause, a rate, a learned guard; in the gate hash a high
// call waiting, "hi_until", or costly calls, "costly_until"), so that the
// adapt grant reads those fields: the common (core) grant reads none of
// them, and hands the call to the adapt grant while the mark is there.
// Every writer of such a field calls it (the full reserve script writes
// the mark itself with the gate hash's fields); the full reserve script
// sets the mark again when it makes a gate hash anew while one is in
// force, and the adapt grant takes it away once nothing is.
//
// gate_kept(k_gate, now): until when the gate hash lives (µs; now when it
// does not exist or has no expiry). A writer of the control hash keeps it
// at least that long: grants extend the control hash with the gate's keys
// (keep_alive), once in many grants (reachLua), so a control hash written
// to live a keep from now would lapse before the next extension, and a
// rate set in it (announced, set) with it.
const adaptedLua = `
local function adapted(k_gate)
  if redis.call('EXISTS', k_gate) == 1 then redis.call('HSET', k_gate, 'adapted', '1') end
end
local function gate_kept(k_gate, now) return now + math.max(redis.call('PTTL', k_gate), 0) * 1000 end
`

// pauseLua defines pause(k_control, k_gate, k_stats, now, d, reason,
// channel, bucket, keep): it pauses a bucket for d (µs) from now, unless
// a longer pause is in force, and returns the pause remaining (µs). A new
// or longer pause is counted, and published as "<bucket>|<µs remaining>"
// so that watching gates drop the ticks their callers were granted before
// it; the control hash outlives the pause by keep.
const pauseLua = adaptedLua + `
local function pause(k_control, k_gate, k_stats, now, d, reason, channel, bucket, keep)
  local untilv = now + d
  local cur = tonumber(redis.call('HGET', k_control, 'paused_until')) or 0
  if untilv > cur then
    adapted(k_gate)
    if cur <= now then redis.call('HSET', k_control, 'pause_from', string.format('%d', now)) end
    redis.call('HSET', k_control, 'paused_until', string.format('%d', untilv), 'pause_reason', reason)
    redis.call('HINCRBY', k_stats, 'pauses', 1)
    redis.call('PUBLISH', channel, bucket .. '|' .. string.format('%d', untilv - now))
    cur = untilv
  end
  extend(k_control, math.max(cur + keep, gate_kept(k_gate, now)), now)
  return math.max(cur - now, 0)
end
`

// pauseScript pauses a bucket for every replica (see pauseLua).
//
// KEYS[1] control hash, KEYS[2] stats hash, KEYS[3] gate hash.
// ARGV[1] Redis time override (µs; 0: TIME), ARGV[2] pause length (µs)
// from Redis now, ARGV[3] reason, ARGV[4] pause channel, ARGV[5] bucket
// name, ARGV[6] keep (µs). Returns the pause remaining (µs). A pause only
// ever extends.
var pauseScript = redis.NewScript(nowLua + extendLua + pauseLua + `
local k_control, k_stats, k_gate = KEYS[1], KEYS[2], KEYS[3]
local a_pause, a_reason, a_channel, a_bucket, a_keep = tonumber(ARGV[2]), ARGV[3], ARGV[4], ARGV[5], tonumber(ARGV[6])
return pause(k_control, k_gate, k_stats, now_us(), a_pause, a_reason, a_channel, a_bucket, a_keep)
`)

// Pause stops the bucket's ticks for d on every replica, and records why.
// An existing longer pause is kept. Gates that Watch drop the ticks their
// callers were granted inside the pause; others let them go out (at most
// Horizon of them). It returns the pause now in force.
func (c *Control) Pause(ctx context.Context, d time.Duration, reason string) (time.Duration, error) {
	b := c.b
	if d < 0 {
		return 0, fmt.Errorf("shaper: pause %q for %s: a pause must not be negative", b.name, d)
	}
	left, err := redisonce.Run(ctx, b.gate.rdb, pauseScript, []string{b.keys.control, b.keys.stats, b.keys.gate}, b.gate.redisNow(),
		d.Microseconds(), reason, pauseChannel(b.gate.prefix), b.name, b.keep.Microseconds()).Int64()
	if err != nil {
		return 0, fmt.Errorf("shaper: pause %q: %w", b.name, err)
	}
	pause := time.Duration(left) * time.Microsecond
	b.gate.notePause(b.name, b.gate.clock.Now().Add(pause))
	return pause, nil
}

// Watch keeps the gate told of pauses set by any replica, until ctx ends,
// so that Acquire drops ticks granted before a pause began instead of
// calling a vendor that just said 429. It resubscribes after errors. Run
// it in a goroutine the caller owns and waits for.
func (g *Gate) Watch(ctx context.Context) {
	for ctx.Err() == nil {
		g.watchOnce(ctx)
		select {
		case <-ctx.Done():
		case <-time.After(time.Second): // Redis unreachable: try again
		}
	}
}

// watchOnce holds one subscription until it fails or ctx ends.
func (g *Gate) watchOnce(ctx context.Context) {
	sub := g.rdb.Subscribe(ctx, pauseChannel(g.prefix), respaceChannel(g.prefix))
	defer sub.Close()
	stop := context.AfterFunc(ctx, func() { _ = sub.Close() }) // unblocks ReceiveMessage
	defer stop()
	for range 2 { // the subscriptions' confirmations
		if _, err := sub.Receive(ctx); err != nil {
			return
		}
	}
	if g.testWatchedUp != nil {
		g.testWatchedUp()
	}
	for {
		msg, err := sub.ReceiveMessage(ctx)
		if err != nil {
			return
		}
		g.hear(msg.Channel, msg.Payload)
	}
}

// hear tells the gate of a message on its pause or respace channel (see
// watchOnce): the callers waiting here drop the ticks it takes away.
func (g *Gate) hear(channel, payload string) {
	if channel == respaceChannel(g.prefix) {
		g.noteRespace(payload, g.clock.Now())
		return
	}
	bucket, us, ok := strings.Cut(payload, "|")
	n, err := strconv.ParseInt(us, 10, 64)
	if !ok || err != nil {
		return
	}
	g.notePause(bucket, g.clock.Now().Add(time.Duration(n)*time.Microsecond))
}
