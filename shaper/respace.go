package shaper

import (
	"context"
	"fmt"
	"time"

	"github.com/redis/go-redis/v9"
)

// respaceSlack is how far past Redis now a respaced bucket's line
// restarts: ticks granted before the respace and due within it may
// already be on their way (a gate hears of the respace a Pub/Sub message
// later), so the first tick at the new spacing comes one new interval
// after it.
const respaceSlack = 100 * time.Millisecond

// respaceScript brings a bucket's line of reserved ticks back to now.
//
// KEYS[1] gate hash.
// ARGV[1] Redis time override (µs; 0: TIME), ARGV[2] slack (µs), ARGV[3]
// respace channel, ARGV[4] bucket name.
// Returns 1 when ticks were reserved beyond now + slack (and the respace
// was published), else 0.
var respaceScript = redis.NewScript(nowLua + `
local now = now_us()
local at = now + tonumber(ARGV[2])
local last = tonumber(redis.call('HGET', KEYS[1], 'last'))
if last == nil or last <= at then return 0 end
-- n: the line's last tick is spent, the next comes one interval after.
redis.call('HSET', KEYS[1], 'last', string.format('%d', at), 'n', 1000000000, 'vt', string.format('%d', at))
redis.call('PUBLISH', ARGV[3], ARGV[4])
return 1
`)

// Respace makes a new spacing (a config edit, a lowered or raised rate)
// what the vendor sees at once, instead of after the ticks already
// reserved at the old spacing (up to Horizon of them): the bucket's line
// restarts a moment after now, and gates that Watch drop the ticks their
// callers were granted before, so those callers ask again and get ticks
// at the new spacing. Nothing is lost; the dropped ticks go unused.
func (c *Control) Respace(ctx context.Context) error {
	b := c.b
	n, err := respaceScript.Run(ctx, b.gate.rdb, []string{b.keys.gate}, b.gate.redisNow(),
		respaceSlack.Microseconds(), respaceChannel(b.gate.prefix), b.name).Int64()
	if err != nil {
		return fmt.Errorf("shaper: respace %q: %w", b.name, err)
	}
	if n == 1 {
		b.gate.noteRespace(b.name, b.gate.clock.Now())
	}
	return nil
}
