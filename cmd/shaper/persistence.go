package main

import (
	"context"
	"log/slog"
	"strconv"

	"github.com/redis/go-redis/v9"

	"github.com/shaper-dev/shaper/queue"
)

// checkPersistence warns, once at a worker's start, when the Redis it
// joins would lose queued calls in a restart or crash (G6 holds across
// one only as far as Redis's persistence goes), naming the settings to
// turn on. Not for the embedded Redis, which says at start that it is
// not durable.
func checkPersistence(ctx context.Context, rdb redis.UniversalClient, log *slog.Logger) {
	p, err := queue.ReadPersistence(ctx, rdb)
	if err != nil {
		log.Warn("cannot check Redis's persistence; make sure it has appendonly yes with appendfsync everysec (see docs/operations.md)", "err", err)
		return
	}
	if risk := p.Risk(); risk != "" {
		log.Warn("Redis may lose queued calls: "+risk, "appendonly", p.AOF, "appendfsync", p.AppendFsync, "save", strconv.Quote(p.Save))
	}
}
