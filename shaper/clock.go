package shaper

import (
	"context"
	"time"
)

// Clock is the local time source of a Gate. Tests inject one; production
// uses the system clock. Sleep returns early with ctx.Err() when ctx ends.
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

// nowLua defines now_from(override): Redis TIME in microseconds, the
// authority for ticks, or override when it is positive (tests pass a time
// of their own, as asynq's scripts take now); and now_us(), now_from of
// ARGV[1]. Every script takes the override as ARGV[1].
const nowLua = nowFromLua + `
local function now_us() return now_from(tonumber(ARGV[1])) end
`

// nowFromLua defines now_from alone. TIME's two strings (seconds,
// microseconds) are made numbers by the arithmetic.
const nowFromLua = `
local function now_from(override)
  if override and override > 0 then return override end
  local t = redis.call('TIME')
  return t[1] * 1000000 + t[2]
end
`

// redisNow is ARGV[1] of every script: 0 (use Redis TIME) unless a test
// set a Redis time of its own.
func (g *Gate) redisNow() int64 {
	if g.testNow != nil {
		return g.testNow()
	}
	return 0
}
