package shaper

import (
	"context"
	"fmt"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/shaper-dev/shaper/internal/redisonce"
)

// respaceSlack is how far past Redis now a respaced bucket's line
// restarts: ticks granted before the respace and due within it may
// already be on their way (a gate hears of the respace a Pub/Sub message
// later), so the first tick at the new spacing comes one new interval
// after it.
const respaceSlack = 100 * time.Millisecond

// respaceScript brings a bucket's line of reserved ticks back to now, and
// puts the replica's tick under its new policy in the widest tick's place
// wherever widest would let a caller under it take it (the place is this
// replica's under an older generation, free, stale, or held by a tick no
// wider): every replica's callers space by it from their next grant,
// those of a replica still under the old policy (a rolling edit) and this
// replica's own callers still under an older handle, instead of taking
// the place back with the old tick. A raised rate is not held back by
// this replica's old tick, and another replica's wider tick keeps its
// place.
//
// KEYS[1] gate hash.
// ARGV[1] Redis time override (µs; 0: TIME), ARGV[2] slack (µs), ARGV[3]
// respace channel, ARGV[4] bucket name, ARGV[5] the replica's tick under
// its current policy as widest keeps it ("interval|burst|replica|gen",
// Bucket.mine), ARGV[6] how long a replica's tick counts (µs,
// replicaLive).
// Returns 1 when ticks were reserved beyond now + slack (and the respace
// was published), else 0. When it writes a new 'wide', the line's entry
// of the widest tick is zeroed: the next grant reads 'wide' (see
// wide_entry).
var respaceScript = redis.NewScript(nowLua + fmtLua + lineFieldLua + widestLua + respaceLua + `
local k_gate = KEYS[1]
local a_slack, a_channel, a_bucket, a_mine, a_live = tonumber(ARGV[2]), ARGV[3], ARGV[4], ARGV[5], tonumber(ARGV[6])
local now = now_us()
local wide, wide_at = unpack(redis.call('HMGET', k_gate, 'wide', 'wide_at'))
local iv, b = string.match(a_mine, '^(%d+)|(%d+)|')
local _, _, wide_new = widest(wide, wide_at, a_mine, tonumber(iv), tonumber(b), a_live, now)
if wide_new then
  redis.call('HSET', k_gate, 'wide', wide_new, 'wide_at', fmt(now))
  local last, n, gm, gc, kept = read_line(redis.call('HGET', k_gate, 'line'))
  if last then redis.call('HSET', k_gate, 'line', line_of(last, n, gm, gc, kept)) end
end
return respace(k_gate, now, a_slack, a_channel, a_bucket)
`)

// respaceLua defines respace(k_gate, now, slack, channel, bucket): when
// the bucket's line of reserved ticks reaches beyond now + slack, it
// restarts there (the line's last tick is spent, the next comes one
// interval after), the respace is published, and it returns 1; else 0.
// It brings SPENT (spentLua) with it: the apply script respaces too.
const respaceLua = spentLua + `
local function respace(k_gate, now, slack, channel, bucket)
  local at = now + slack
  local last, _, gm, gc, kept = read_line(redis.call('HGET', k_gate, 'line'))
  if last == nil or last <= at then return 0 end
  redis.call('HSET', k_gate, 'line', line_of(at, SPENT, gm, gc, kept), 'vt', string.format('%d', at))
  redis.call('PUBLISH', channel, bucket)
  return 1
end
`

// Respace makes a new spacing (a config edit, a lowered or raised rate)
// what the vendor sees at once, instead of after the ticks already
// reserved at the old spacing (up to Horizon of them): the bucket's line
// restarts a moment after now, and gates that Watch drop the ticks their
// callers were granted before, so those callers ask again and get ticks
// at the new spacing. Nothing is lost; the dropped ticks go unused.
//
// Call it on the handle of the new policy: this process's callers still
// waiting under an older handle of the bucket carry on under this one, and
// the older policies' ticks stop counting for this replica at once (a
// raised rate applies now, not when the old tick's record ages out).
func (c *Control) Respace(ctx context.Context) error {
	b := c.b
	b.gen.Store(b.gate.edits.Add(1))
	b.gate.supersede(b)
	return b.respaceLine(ctx)
}

// respaceLine restarts the bucket's line a moment after now at the
// spacing in force in this process (see respaceScript), and drops this
// process's ticks granted before.
func (b *Bucket) respaceLine(ctx context.Context) error {
	iv, burst, _, _ := b.spacing()
	n, err := redisonce.Run(ctx, b.gate.rdb, respaceScript, []string{b.keys.gate}, b.gate.redisNow(),
		respaceSlack.Microseconds(), respaceChannel(b.gate.prefix), b.name,
		b.mine(iv.Microseconds(), burst), replicaLive.Microseconds()).Int64()
	if err != nil {
		return fmt.Errorf("shaper: respace %q: %w", b.name, unavailable(ctx, err))
	}
	if n == 1 {
		b.gate.noteRespace(b.name, b.gate.clock.Now())
	}
	return nil
}
