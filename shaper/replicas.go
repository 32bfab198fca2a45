package shaper

import (
	"context"
	"fmt"
	"strings"
	"time"

	"github.com/redis/go-redis/v9"
)

// replicaForget is how long a silent replica stays in the replicas hash.
const replicaForget = time.Minute

// heartbeatScript records the tick of one live replica's config, and
// forgets replicas not heard from for replicaForget.
//
// KEYS[1] replicas hash.
// ARGV[1] Redis time override (µs; 0: TIME), ARGV[2] replica id, ARGV[3]
// interval (µs), ARGV[4] burst, ARGV[5] replicaForget (µs).
// Returns 0.
var heartbeatScript = redis.NewScript(nowLua + extendLua + `
local now = now_us()
redis.call('HSET', KEYS[1], ARGV[2], ARGV[3] .. '|' .. ARGV[4] .. '|' .. string.format('%d', now))
extend(KEYS[1], now + tonumber(ARGV[5]), now)
local all = redis.call('HGETALL', KEYS[1])
for i = 2, #all, 2 do
  local seen = tonumber(string.match(all[i], '|(%d+)$'))
  if seen and now - seen > tonumber(ARGV[5]) then redis.call('HDEL', KEYS[1], all[i - 1]) end
end
return 0
`)

// Heartbeat tells every replica this one's configured tick, so that while
// replicas disagree (a rolling config edit) the gate uses the most
// conservative live one. Workers call it about every half second; a
// replica silent for 5 s no longer counts.
func (c *Control) Heartbeat(ctx context.Context, replica string) error {
	b := c.b
	iv, burst, _, _ := b.spacing()
	err := heartbeatScript.Run(ctx, b.gate.rdb, []string{b.keys.replicas}, b.gate.redisNow(), replica,
		iv.Microseconds(), burst, replicaForget.Microseconds()).Err()
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
func (c *Control) Replicas(ctx context.Context) ([]ReplicaTick, error) {
	b := c.b
	all, err := b.gate.rdb.HGetAll(ctx, b.keys.replicas).Result()
	if err != nil {
		return nil, fmt.Errorf("shaper: replicas of %q: %w", b.name, err)
	}
	nowUS := b.gate.redisNow()
	if nowUS == 0 {
		now, err := b.gate.rdb.Time(ctx).Result()
		if err != nil {
			return nil, fmt.Errorf("shaper: replicas of %q: %w", b.name, err)
		}
		nowUS = now.UnixMicro()
	}
	var out []ReplicaTick
	for field, v := range all {
		id, _, _ := strings.Cut(field, "|") // grants record "replica|interval|burst"
		var iv, burst, seen int64
		if _, err := fmt.Sscanf(v, "%d|%d|%d", &iv, &burst, &seen); err != nil {
			continue
		}
		if nowUS-seen < replicaLive.Microseconds() {
			out = append(out, ReplicaTick{Replica: id, Interval: time.Duration(iv) * time.Microsecond, Burst: int(burst)})
		}
	}
	return out, nil
}
