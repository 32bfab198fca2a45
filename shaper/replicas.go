package shaper

import (
	"context"
	"fmt"
	"strconv"
	"strings"
	"time"

	"github.com/shaper-dev/shaper/internal/gatehook"
)

// widest returns the most conservative tick a replica asked under in the
// last 5 s (replicaLive), which every replica spaces by while replicas
// disagree on the config (a rolling edit); ok is false when none is live.
func (c *Control) widest(ctx context.Context) (t gatehook.ReplicaTick, ok bool, err error) {
	b := c.b
	vals, err := b.gate.rdb.HMGet(ctx, b.keys.gate, "wide", "wide_at").Result()
	if err != nil {
		return gatehook.ReplicaTick{}, false, fmt.Errorf("shaper: widest tick of %q: %w", b.name, err)
	}
	nowUS := b.gate.redisNow()
	if nowUS == 0 {
		now, err := b.gate.rdb.Time(ctx).Result()
		if err != nil {
			return gatehook.ReplicaTick{}, false, fmt.Errorf("shaper: widest tick of %q: %w", b.name, err)
		}
		nowUS = now.UnixMicro()
	}
	wide, _ := vals[0].(string)
	at, _ := vals[1].(string)
	var iv int64
	var burst int
	var replica string
	seen, err := strconv.ParseInt(at, 10, 64)
	if _, serr := fmt.Sscanf(wide, "%d|%d|%s", &iv, &burst, &replica); serr != nil || err != nil || nowUS-seen >= replicaLive.Microseconds() {
		return gatehook.ReplicaTick{}, false, nil
	}
	if i := strings.LastIndex(replica, "|"); i >= 0 {
		replica = replica[:i] // its policy's generation follows (see Bucket.mine)
	}
	return gatehook.ReplicaTick{Replica: replica, Interval: time.Duration(iv) * time.Microsecond, Burst: burst}, true, nil
}
