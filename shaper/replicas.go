package shaper

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/redis/go-redis/v9"
)

// ReplicaTick is the configured tick of a replica that asked for a tick
// of the bucket lately.
type ReplicaTick struct {
	Replica  string
	Interval time.Duration
	Burst    int
}

// Widest returns the most conservative tick a replica asked under in the
// last 5 s (replicaLive), which every replica spaces by while replicas
// disagree on the config (a rolling edit); ok is false when none is live.
func (c *Control) Widest(ctx context.Context) (t ReplicaTick, ok bool, err error) {
	b := c.b
	wide, err := b.gate.rdb.HGet(ctx, b.keys.gate, "wide").Result()
	if errors.Is(err, redis.Nil) {
		return ReplicaTick{}, false, nil
	}
	if err != nil {
		return ReplicaTick{}, false, fmt.Errorf("shaper: widest tick of %q: %w", b.name, err)
	}
	nowUS := b.gate.redisNow()
	if nowUS == 0 {
		now, err := b.gate.rdb.Time(ctx).Result()
		if err != nil {
			return ReplicaTick{}, false, fmt.Errorf("shaper: widest tick of %q: %w", b.name, err)
		}
		nowUS = now.UnixMicro()
	}
	var iv, seen int64
	var burst int
	var replica string
	if _, err := fmt.Sscanf(wide, "%d|%d|%d|%s", &iv, &burst, &seen, &replica); err != nil || nowUS-seen >= replicaLive.Microseconds() {
		return ReplicaTick{}, false, nil
	}
	return ReplicaTick{Replica: replica, Interval: time.Duration(iv) * time.Microsecond, Burst: burst}, true, nil
}
