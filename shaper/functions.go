package shaper

import (
	"context"
	"crypto/sha1"
	"encoding/hex"
	"errors"
	"strings"

	"github.com/redis/go-redis/v9"

	"github.com/shaper-dev/shaper/internal/redisonce"
)

// The reserve scripts, the core and the full one, run as Redis functions
// where the server has them (Redis 7 and later): loaded once per server
// with FUNCTION LOAD, then called with FCALL. A script run by EVALSHA
// defines its helpers anew on every call, about a tenth of the common
// grant's Redis CPU and more of the full one's; a function's library
// defines them once, when it is loaded. Where Functions are
// missing (Redis before 7, the embedded Redis, an ACL that refuses them)
// the gate runs the same Lua as a script, as before: the grant is the
// same, only its cost differs.
//
// The function is named after its source's hash, so that two versions of
// shaper sharing a Redis (a rolling upgrade) each call their own. It is
// loaded where a call finds it missing: the first grant on a server, a
// server that lost its data, a promoted replica it never reached, another
// node of a cluster (loaded on the node that holds the bucket's keys).

// function is one Lua function in a library of its own.
type function struct {
	name    string // the function's name, and its library's
	library string // the FUNCTION LOAD source
	script  *redis.Script
}

// newFunction makes the function of a script's helper definitions (defs,
// defined once in the library) and body (run on each call, with KEYS and
// ARGV as a script has them); script runs the same where Functions are
// missing.
func newFunction(kind, defs, body string) *function {
	sum := sha1.Sum([]byte(defs + body))
	name := "shaper_" + kind + "_" + hex.EncodeToString(sum[:8])
	return &function{
		name: name,
		library: "#!lua name=" + name + "\n" + defs +
			"\nredis.register_function('" + name + "', function(KEYS, ARGV)\n" + body + "\nend)\n",
		script: redis.NewScript(defs + body),
	}
}

// run calls f on the gate's Redis: as a function, loading it where it is
// missing, or as a script where Functions are missing. Each is sent once
// (see redisonce): a grant is never run twice for one call.
func (g *Gate) run(ctx context.Context, f *function, keys []string, args ...any) *redis.Cmd {
	if !g.noFunctions.Load() {
		cmd := redisonce.FCall(ctx, g.rdb, f.name, keys, args...)
		err := cmd.Err()
		var rerr redis.Error
		switch {
		case err == nil || !errors.As(err, &rerr):
			return cmd // a grant, or Redis unreachable: as a script's would be
		case strings.Contains(err.Error(), "Function not found"):
			if err := g.load(ctx, f, keys[0]); err == nil {
				return redisonce.FCall(ctx, g.rdb, f.name, keys, args...)
			} else if functionsRefused(err) {
				g.noFunctions.Store(true)
			}
		case functionsRefused(err):
			g.noFunctions.Store(true)
		default:
			return cmd // the function's own error
		}
	}
	return redisonce.Run(ctx, g.rdb, f.script, keys, args...)
}

// functionsRefused reports whether err says the server has no Functions
// for this client: an unknown command (Redis before 7, the embedded
// Redis) or one its ACL refuses.
func functionsRefused(err error) bool {
	msg := err.Error()
	return strings.Contains(strings.ToLower(msg), "unknown command") || strings.HasPrefix(msg, "NOPERM")
}

// load loads f's library on the server that holds key. A library loaded
// meanwhile by another replica is as good.
func (g *Gate) load(ctx context.Context, f *function, key string) error {
	var on redis.Cmdable = g.rdb
	if c, ok := g.rdb.(*redis.ClusterClient); ok {
		node, err := c.MasterForKey(ctx, key)
		if err != nil {
			return err
		}
		on = node
	}
	err := on.FunctionLoad(ctx, f.library).Err()
	if err != nil && strings.Contains(err.Error(), "already exists") {
		return nil
	}
	return err
}
