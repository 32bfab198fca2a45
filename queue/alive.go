package queue

import (
	"context"
	"fmt"
	"strconv"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/shaper-dev/shaper/internal/redisonce"
	"github.com/shaper-dev/shaper/shaper"
)

// liveness is the set of live workers, which every worker writes to and
// reads (see recover.go): a worker says it is alive every aliveEvery, and
// one silent for deadAfter is dead to the others.
type liveness struct {
	rdb    redis.UniversalClient
	key    string       // the sorted set: worker -> Redis time last heard (µs)
	worker string       // this worker (its gate's replica id: no "|")
	now    func() int64 // tests: Redis time (µs); nil: Redis TIME
}

// newLiveness returns the liveness of worker under the key prefix.
func newLiveness(rdb redis.UniversalClient, prefix, worker string) *liveness {
	if prefix == "" {
		prefix = shaper.DefaultKeyPrefix
	}
	return &liveness{rdb: rdb, key: aliveKey(prefix), worker: worker}
}

// aliveForget is how long a silent worker stays in the set.
const aliveForget = time.Minute

// aliveScript records that a worker is alive now.
//
// KEYS[1] the set of live workers; ARGV[1] Redis time override (µs; 0:
// TIME), ARGV[2] the worker, ARGV[3] aliveForget (µs). Returns Redis now
// (µs).
var aliveScript = redis.NewScript(`
local k_alive = KEYS[1]
local a_now = tonumber(ARGV[1])
local a_worker = ARGV[2]
local a_forget = tonumber(ARGV[3])
local now = a_now
if now <= 0 then
  local t = redis.call('TIME')
  now = t[1] * 1000000 + t[2]
end
redis.call('ZADD', k_alive, string.format('%d', now), a_worker)
redis.call('ZREMRANGEBYSCORE', k_alive, '-inf', '(' .. string.format('%d', now - a_forget))
redis.call('PEXPIRE', k_alive, math.ceil(a_forget / 1000))
return now
`)

// alive records that this worker is alive, in one round trip (its Redis
// health check too), and returns Redis time.
func (l *liveness) alive(ctx context.Context) (time.Time, error) {
	var override int64
	if l.now != nil {
		override = l.now()
	}
	now, err := redisonce.Run(ctx, l.rdb, aliveScript, []string{l.key}, override, l.worker, aliveForget.Microseconds()).Int64()
	if err != nil {
		return time.Time{}, fmt.Errorf("queue: say the worker is alive: %w", err)
	}
	return time.UnixMicro(now), nil
}

// leave takes this worker out of the set: it stopped, and is not dead to
// the others.
func (l *liveness) leave(ctx context.Context) error {
	if err := l.rdb.ZRem(ctx, l.key, l.worker).Err(); err != nil {
		return fmt.Errorf("queue: take the worker out of the live ones: %w", err)
	}
	return nil
}

// silence is a worker not heard from since lastSeen (Redis time).
type silence struct {
	worker   string
	lastSeen time.Time
}

// silent returns the workers other than this one silent for at least d
// at Redis time now (heard at most aliveForget ago: older ones are
// forgotten).
func (l *liveness) silent(ctx context.Context, now time.Time, d time.Duration) ([]silence, error) {
	zs, err := l.rdb.ZRangeByScoreWithScores(ctx, l.key, &redis.ZRangeBy{
		Min: "-inf", Max: strconv.FormatInt(now.Add(-d).UnixMicro(), 10)}).Result()
	if err != nil {
		return nil, fmt.Errorf("queue: silent workers: %w", err)
	}
	var out []silence
	for _, z := range zs {
		if id, _ := z.Member.(string); id != l.worker {
			out = append(out, silence{worker: id, lastSeen: time.UnixMicro(int64(z.Score))})
		}
	}
	return out, nil
}
