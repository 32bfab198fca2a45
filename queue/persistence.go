package queue

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"strings"
	"sync"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/shaper-dev/shaper/internal/redisonce"
)

// Persistence is what a Redis keeps across a restart: queued calls live
// in Redis, so G6 (nothing accepted is lost) holds across a Redis crash
// only as far as its persistence goes.
type Persistence struct {
	// AOF: appendonly yes (INFO persistence aof_enabled:1).
	AOF bool
	// AppendFsync is appendfsync (always, everysec, no); "" when CONFIG
	// GET is refused.
	AppendFsync string
	// Save is the RDB save points ("" none); meaningful when SaveKnown.
	Save string
	// SaveKnown: CONFIG GET answered. It is asked only as the default
	// user: a least-privilege user (queue.ACLRules) may not run CONFIG,
	// and a refusal would fill the ACL log; a managed Redis may refuse it
	// too.
	SaveKnown bool
	// Server names the server read (a Cluster's worst master).
	Server string
}

// ReadPersistence reads the persistence of the Redis behind rdb (every
// master of a Cluster, returning the one that keeps least): aof_enabled
// from INFO persistence, which needs no CONFIG permission, and, as the
// default user only, the save points and appendfsync from CONFIG GET.
func ReadPersistence(ctx context.Context, rdb redis.UniversalClient) (Persistence, error) {
	read := func(ctx context.Context, c redis.UniversalClient, server, user string) (Persistence, error) {
		p := Persistence{Server: server}
		info, err := c.Info(ctx, "persistence").Result()
		if err != nil {
			return p, fmt.Errorf("queue: read Redis persistence (INFO persistence) from %s: %w", server, err)
		}
		p.AOF = infoField(info, "aof_enabled") == "1"
		if user != "" && user != "default" {
			return p, nil
		}
		if m, err := c.ConfigGet(ctx, "save").Result(); err == nil {
			p.Save, p.SaveKnown = strings.TrimSpace(m["save"]), true
		}
		if m, err := c.ConfigGet(ctx, "appendfsync").Result(); err == nil {
			p.AppendFsync = m["appendfsync"]
		}
		return p, nil
	}
	switch c := rdb.(type) {
	case *redis.ClusterClient:
		var worst Persistence
		first := true
		var mu sync.Mutex // ForEachMaster calls fn on every master at once
		err := c.ForEachMaster(ctx, func(ctx context.Context, n *redis.Client) error {
			p, err := read(ctx, n, serverName(n), n.Options().Username)
			mu.Lock()
			defer mu.Unlock()
			if err == nil && (first || p.keeps() < worst.keeps()) {
				worst, first = p, false
			}
			return err
		})
		return worst, err
	case *redis.Client:
		return read(ctx, c, serverName(c), c.Options().Username)
	default:
		return read(ctx, rdb, "Redis", "?")
	}
}

// keeps ranks p from keeps nothing (0) to every acknowledged write (3).
func (p Persistence) keeps() int {
	switch {
	case p.AOF && p.AppendFsync == "always":
		return 3
	case p.AOF && p.AppendFsync != "no":
		return 2
	case p.AOF || p.Save != "" || !p.SaveKnown:
		return 1
	default:
		return 0
	}
}

// Risk says what a crash of the Redis loses and what to turn on, or ""
// when it keeps the calls G6 needs: appendonly yes with appendfsync
// everysec (at most about a second of writes lost when the machine
// crashes; none when only Redis does) or always.
func (p Persistence) Risk() string {
	const fix = "turn on appendonly yes with appendfsync everysec (or always) and keep maxmemory-policy noeviction; see docs/operations.md"
	switch {
	case p.AOF && p.AppendFsync == "no":
		return fmt.Sprintf("%s has appendonly yes but appendfsync no: the OS writes the file when it likes (about every 30 s), so a crash of the machine loses the calls queued in that time; set appendfsync everysec (or always); see docs/operations.md", p.Server)
	case p.AOF:
		return ""
	case !p.SaveKnown:
		return fmt.Sprintf("%s has no append-only file (appendonly no; its RDB save points were not read: CONFIG is for the default user): a restart or crash loses every call queued since the last snapshot, or all of them without snapshots; %s", p.Server, fix)
	case p.Save == "":
		return fmt.Sprintf("%s has no persistence (appendonly no, no RDB save points): a restart or crash loses every queued call; %s", p.Server, fix)
	default:
		return fmt.Sprintf("%s persists by RDB snapshots only (save %q, appendonly no): a restart or crash loses the calls queued since the last snapshot; %s", p.Server, p.Save, fix)
	}
}

// redisKept tells whether Redis kept its data across a restart, so that
// a worker whose Redis comes back never says that nothing was lost when
// it came back empty. A marker key without expiry holds the run_id of
// the server it was first written on; a server that restarted with its
// data (or a replica that took over) still has the marker of an earlier
// server, and one that came back empty has none (or one that a worker
// wrote on it after the restart).
type redisKept struct {
	rdb   redis.UniversalClient
	key   string
	log   *slog.Logger
	runID string // the server last seen ("": none yet)
}

// keptEvery is how often a worker checks the server's run_id while
// Redis answers (a restart no ping saw fail), besides after each outage.
const keptEvery = 10 * time.Second

// newRedisKept returns the check of rdb's data under key prefix.
func newRedisKept(rdb redis.UniversalClient, prefix string, log *slog.Logger) *redisKept {
	if _, cluster := rdb.(*redis.ClusterClient); cluster {
		return nil // INFO's run_id is a random node's: nothing to compare
	}
	return &redisKept{rdb: rdb, key: keptKey(prefix), log: log}
}

// check compares the server's run_id with the last one seen and, when
// it changed, logs whether the data came back. It returns false when it
// could not tell (Redis refused or did not answer, or is still loading
// its data), for the caller to try again soon.
func (k *redisKept) check(ctx context.Context) bool {
	info, err := k.rdb.Info(ctx, "server").Result()
	if err != nil {
		return !redisonce.Unavailable(err) // INFO refused (an ACL, the embedded Redis): nothing to compare
	}
	now := infoField(info, "run_id")
	if now == "" {
		return true // INFO without a run_id: nothing to compare
	}
	marker, err := k.rdb.Get(ctx, k.key).Result()
	switch {
	case errors.Is(err, redis.Nil):
		if err := k.rdb.SetNX(ctx, k.key, now, 0).Err(); err != nil {
			return !redisonce.Unavailable(err)
		}
	case err != nil:
		return !redisonce.Unavailable(err) // LOADING: ask again at the next beat
	}
	before := k.runID
	k.runID = now
	switch {
	case before == "" || before == now:
	case marker == "" || marker == now:
		k.log.Error("Redis came back EMPTY: it restarted without the data it held (run_id changed and shaper's marker key was gone), so the calls queued in it before may have been lost; turn on persistence (appendonly yes, appendfsync everysec) so that a restart keeps them, see docs/operations.md",
			"run_id_before", before, "run_id_now", now, "marker", k.key)
	default:
		k.log.Warn("Redis restarted or failed over and came back with its data (run_id changed, shaper's marker key kept): queued calls are kept, except writes after its last fsync or snapshot",
			"run_id_before", before, "run_id_now", now)
	}
	return true
}
