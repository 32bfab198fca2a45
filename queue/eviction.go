package queue

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"sync"

	"github.com/redis/go-redis/v9"
)

// ErrEvictingRedis means the Redis evicts keys that have no expiry when it
// is full (a maxmemory-policy of allkeys-*): queued calls, which asynq
// keeps without an expiry, could vanish without a trace. Set
// maxmemory-policy to noeviction (or run the worker with
// --allow-eviction to accept the risk).
var ErrEvictingRedis = errors.New("queue: Redis evicts keys without an expiry when full")

// EvictionPolicy reads maxmemory-policy from every master behind rdb (all
// of a Cluster's) through INFO, which needs no CONFIG permission, and
// returns the worst one found. It returns ErrEvictingRedis (wrapped, with
// the policy and the server) for an allkeys-* policy, which can drop
// queued calls; volatile-* policies evict only keys with an expiry —
// finished calls' results and the gate's state, which the gate treats as
// lost and recovers from (waiting out a horizon) — and are returned with
// a nil error, for the caller to warn about.
func EvictionPolicy(ctx context.Context, rdb redis.UniversalClient) (string, error) {
	var worst, where string
	var mu sync.Mutex // ForEachMaster calls check on every master at once
	check := func(ctx context.Context, c *redis.Client) error {
		info, err := c.Info(ctx, "memory").Result()
		if err != nil {
			return fmt.Errorf("queue: read maxmemory-policy (INFO memory) from %s: %w", serverName(c), err)
		}
		p := infoField(info, "maxmemory_policy")
		mu.Lock()
		defer mu.Unlock()
		if rank(p) > rank(worst) {
			worst, where = p, serverName(c)
		}
		return nil
	}
	var err error
	switch c := rdb.(type) {
	case *redis.ClusterClient:
		err = c.ForEachMaster(ctx, check)
	case *redis.Client:
		err = check(ctx, c)
	default:
		info, ierr := rdb.Info(ctx, "memory").Result()
		if ierr != nil {
			return "", fmt.Errorf("queue: read maxmemory-policy (INFO memory): %w", ierr)
		}
		worst = infoField(info, "maxmemory_policy")
	}
	if err != nil {
		return "", err
	}
	if strings.HasPrefix(worst, "allkeys-") {
		server := "Redis"
		if where != "" {
			server = where
		}
		return worst, fmt.Errorf("%w: %s has maxmemory-policy %s; set it to noeviction (CONFIG SET maxmemory-policy noeviction, or in redis.conf), or accept the risk with --allow-eviction", ErrEvictingRedis, server, worst)
	}
	return worst, nil
}

// rank orders eviction policies from safe to unsafe for queued calls.
func rank(policy string) int {
	switch {
	case policy == "":
		return 0
	case policy == "noeviction":
		return 1
	case strings.HasPrefix(policy, "volatile-"):
		return 2
	default:
		return 3
	}
}

// infoField returns the value of field in an INFO reply.
func infoField(info, field string) string {
	for _, line := range strings.Split(info, "\n") {
		if v, ok := strings.CutPrefix(strings.TrimSpace(line), field+":"); ok {
			return v
		}
	}
	return ""
}

// serverName names the server c talks to in a message: its address, or,
// for a Sentinel client (whose address go-redis reports as
// "FailoverClient"), the master it follows.
func serverName(c *redis.Client) string {
	if a := c.Options().Addr; a != "FailoverClient" {
		return a
	}
	return "the Sentinel master"
}
