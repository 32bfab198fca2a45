package shaper

import (
	"context"
	"fmt"
	"strconv"
	"strings"
	"time"

	"github.com/redis/go-redis/v9"
)

// pauseScript pauses a bucket for every replica.
//
// KEYS[1] control hash, KEYS[2] stats hash.
// ARGV[1] Redis time override (µs; 0: TIME), ARGV[2] pause length (µs)
// from Redis now, ARGV[3] reason, ARGV[4] pause channel, ARGV[5] bucket
// name, ARGV[6] keep (µs): the control hash outlives the pause by this.
// Returns the pause remaining (µs): the longer of the existing pause and
// the new one. A pause only ever extends. A new or longer pause is
// published as "<bucket>|<µs remaining>" so that watching gates drop the
// ticks their callers were granted before it.
var pauseScript = redis.NewScript(nowLua + extendLua + `
local now = now_us()
local untilv = now + tonumber(ARGV[2])
local cur = tonumber(redis.call('HGET', KEYS[1], 'paused_until')) or 0
if untilv > cur then
  if cur <= now then redis.call('HSET', KEYS[1], 'pause_from', string.format('%d', now)) end
  redis.call('HSET', KEYS[1], 'paused_until', string.format('%d', untilv), 'pause_reason', ARGV[3])
  redis.call('HINCRBY', KEYS[2], 'pauses', 1)
  redis.call('PUBLISH', ARGV[4], ARGV[5] .. '|' .. string.format('%d', untilv - now))
  cur = untilv
end
extend(KEYS[1], cur + tonumber(ARGV[6]), now)
return math.max(cur - now, 0)
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
	left, err := pauseScript.Run(ctx, b.gate.rdb, []string{b.keys.control, b.keys.stats}, b.gate.redisNow(),
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
	respaces := respaceChannel(g.prefix)
	for {
		msg, err := sub.ReceiveMessage(ctx)
		if err != nil {
			return
		}
		if msg.Channel == respaces {
			g.noteRespace(msg.Payload, g.clock.Now())
			continue
		}
		bucket, us, ok := strings.Cut(msg.Payload, "|")
		n, err := strconv.ParseInt(us, 10, 64)
		if !ok || err != nil {
			continue
		}
		g.notePause(bucket, g.clock.Now().Add(time.Duration(n)*time.Microsecond))
	}
}
