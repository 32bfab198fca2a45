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
// one silent for deadAfter is dead to the others. The same heartbeat
// advertises the user task types the worker handles (handlers.go).
type liveness struct {
	rdb      redis.UniversalClient
	key      string       // the sorted set: worker -> Redis time last heard (µs)
	handlers string       // the sorted set: (vendor, task type) -> Redis time last advertised (µs)
	worker   string       // this worker (its gate's replica id: no "|")
	now      func() int64 // tests: Redis time (µs); nil: Redis TIME
	// handled returns the (vendor, task type) members this worker
	// advertises (handlerMember); nil: none.
	handled func() []string
}

// newLiveness returns the liveness of worker under the key prefix.
func newLiveness(rdb redis.UniversalClient, prefix, worker string) *liveness {
	if prefix == "" {
		prefix = shaper.DefaultKeyPrefix
	}
	return &liveness{rdb: rdb, key: aliveKey(prefix), handlers: handlersKey(prefix), worker: worker}
}

// aliveForget is how long a silent worker stays in the set, and a task
// type no worker advertises any more in the handlers' set.
const aliveForget = time.Minute

// aliveScript records that a worker is alive now, and that it handles
// the (vendor, task type) members given, if any: those no worker
// advertised for aliveForget leave the handlers' set in the same step.
// A worker without handlers of its own leaves that set alone (it expires
// aliveForget after the last worker that had some stops).
//
// KEYS[1] the set of live workers, KEYS[2] the handlers' set (same hash
// slot); ARGV[1] Redis time override (µs; 0: TIME), ARGV[2] the worker,
// ARGV[3] aliveForget (µs), ARGV[4..] the members it handles. Returns
// Redis now (µs).
var aliveScript = redis.NewScript(`
local k_alive = KEYS[1]
local k_handlers = KEYS[2]
local a_now = tonumber(ARGV[1])
local a_worker = ARGV[2]
local a_forget = tonumber(ARGV[3])
local now = a_now
if now <= 0 then
  local t = redis.call('TIME')
  now = t[1] * 1000000 + t[2]
end
local stamp = string.format('%d', now)
local stale = '(' .. string.format('%d', now - a_forget)
local ttl = math.ceil(a_forget / 1000)
redis.call('ZADD', k_alive, stamp, a_worker)
redis.call('ZREMRANGEBYSCORE', k_alive, '-inf', stale)
redis.call('PEXPIRE', k_alive, ttl)
if #ARGV > 3 then
  for i = 4, #ARGV do
    redis.call('ZADD', k_handlers, stamp, ARGV[i])
  end
  redis.call('ZREMRANGEBYSCORE', k_handlers, '-inf', stale)
  redis.call('PEXPIRE', k_handlers, ttl)
end
return now
`)

// alive records that this worker is alive, and the task types it
// handles, in one round trip (its Redis health check too), and returns
// Redis time.
func (l *liveness) alive(ctx context.Context) (time.Time, error) {
	var override int64
	if l.now != nil {
		override = l.now()
	}
	args := []any{override, l.worker, aliveForget.Microseconds()}
	if l.handled != nil {
		for _, m := range l.handled() {
			args = append(args, m)
		}
	}
	now, err := redisonce.Run(ctx, l.rdb, aliveScript, []string{l.key, l.handlers}, args...).Int64()
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
