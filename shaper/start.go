package shaper

import (
	"context"
	"fmt"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/shaper-dev/shaper/internal/redisonce"
)

// Spacing by actual starts. A vendor that enforces spacing (nginx
// limit_req without burst) refuses a call that comes closer than its
// spacing to the one it accepted before. Ticks keep their spacing, but a
// call may start up to its tolerance after its tick: a late call followed
// by one on time reaches the vendor too close. For such a bucket (a
// policy with StrictSpacing, or a margin lesson in force: refusals at the
// full spacing) each call stamps its start in Redis just before it starts,
// and waits first when the call before it started late: the least gap
// between two starts is the spacing less a quarter of the guard's share
// of it (startGap), so a late start moves the next one and lateness
// drains by that quarter at every call. It costs a second round trip per call, for
// such buckets only.

// startArgs is the start script's ARGV, in order (see startLua).
type startArgs struct {
	Now  int64 `lua:"now"`  // Redis time override (µs; 0: TIME)
	Gap  int64 `lua:"gap"`  // the least gap between two starts (µs)
	Wait int64 `lua:"wait"` // the longest this call may wait for it (µs)
	Keep int64 `lua:"keep"` // the stamp outlives the start by this (µs)
}

func (a startArgs) argv() []any { return []any{a.Now, a.Gap, a.Wait, a.Keep} }

// startKeyNames are the start script's KEYS, in order.
var startKeyNames = []string{"start"}

// startLua stamps a call's start: the moment it may start (now, or gap
// after the last start when that is later) becomes the last start.
//
// KEYS: the bucket's start stamp (startKeyNames); ARGV: startArgs.
// Returns how long to wait before starting (µs), or -1 when that is
// longer than the call may wait (nothing is stamped: it gives its tick
// up).
const startLua = `
local k_start = KEYS[1]
local a_now = tonumber(ARGV[1])
local a_gap = tonumber(ARGV[2])
local a_wait = tonumber(ARGV[3])
local a_keep = tonumber(ARGV[4])
local now = now_from(a_now)
local at = math.max(now, (tonumber(redis.call('GET', k_start)) or 0) + a_gap)
if at - now > a_wait then return -1 end
redis.call('SET', k_start, string.format('%d', at), 'PX', math.max(math.ceil((at - now + a_keep) / 1000), 1))
return at - now
`

var startScript = redis.NewScript(nowFromLua + startLua)

// startGap is the least gap between two starts for calls spaced iv
// apart whose spacing without the guard is bare: three quarters of the
// guard's share of a tick cover how differently two calls travel to the
// vendor after their start (a goroutine woken late, a GC pause between
// the stamp and the request written), the last quarter lets a late
// start drain. The grants reply iv and bare (see replyHeader); this is
// the one place the rule is written.
func startGap(iv, bare time.Duration) time.Duration {
	if iv <= bare {
		return iv
	}
	return bare + (iv-bare)*3/4
}

// stampStart stamps the start of a call whose gap to the call before it
// must be at least gap, waiting at most wait for it. It returns how long
// to wait before starting, or ok false when that would be longer than
// wait (nothing is stamped).
func (b *Bucket) stampStart(ctx context.Context, gap, wait time.Duration) (time.Duration, bool, error) {
	args := startArgs{Now: b.gate.redisNow(), Gap: gap.Microseconds(), Wait: wait.Microseconds(), Keep: b.policy.Limits[0].Window.Microseconds()}
	v, err := redisonce.Run(ctx, b.gate.rdb, startScript, []string{b.keys.start}, args.argv()...).Int64()
	if err != nil {
		return 0, false, fmt.Errorf("shaper: stamp a call's start for %q: %w", b.name, unavailable(ctx, err))
	}
	if v < 0 {
		return 0, false, nil
	}
	return time.Duration(v) * time.Microsecond, true, nil
}
