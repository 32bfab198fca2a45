// Package redisonce sends a Lua script or function that changes Redis
// state at most once per call.
//
// go-redis sends a command again (MaxRetries, 3 by default) when its
// reply times out or its connection breaks after the command was
// written: Redis may have run it already, so a script that changes state
// (grants a tick, takes a unit back from a quota, claims a task) would
// run twice for one call. The commands sent here say NoRetry, which
// go-redis v9.23 honours on every client redis.NewUniversalClient makes:
// the plain client and Sentinel's failover client (baseClient's retry
// loop) and the cluster client's own loop, which still follows a MOVED
// or ASK redirect and leaves a READONLY node (answers that say the
// command did not run). go-redis still sends a command again where it
// knows the command never left: the connection was closed before the
// write ("forced"), and its pool retries a failed dial. Anything else is
// an error for the caller, who cannot tell whether the script ran: a
// Redis blip, as the callers already treat errors.
//
// Scripts that only read keep redis.Script.Run and its retries.
//
// Unavailable tells such an error (Redis could not be reached or could
// not answer for now: ask again later) from one that asking again would
// not mend.
package redisonce

import (
	"context"

	"github.com/redis/go-redis/v9"
)

// Processor sends one command: a redis.UniversalClient, or any of the
// clients it stands for.
type Processor interface {
	Process(ctx context.Context, cmd redis.Cmder) error
}

// onceCmd is a command go-redis must not send again once it may have
// reached Redis.
type onceCmd struct{ *redis.Cmd }

// NoRetry tells go-redis not to retry the command.
func (onceCmd) NoRetry() bool { return true }

// Do sends the command args (name, then its arguments; the first key,
// if any, at index firstKey, for a cluster to route it by) once.
func Do(ctx context.Context, c Processor, firstKey int, args ...any) *redis.Cmd {
	cmd := redis.NewCmd(ctx, args...)
	if firstKey > 0 {
		cmd.SetFirstKeyPos(int8(firstKey))
	}
	_ = c.Process(ctx, onceCmd{cmd})
	return cmd
}

// Run runs s as s.Run does, once: EVALSHA, then EVAL where Redis answers
// NOSCRIPT (it has no copy of the script, so nothing ran).
func Run(ctx context.Context, c Processor, s *redis.Script, keys []string, args ...any) *redis.Cmd {
	return s.Run(ctx, scripter{c}, keys, args...)
}

// FCall calls the Redis function fn as c.FCall does, once.
func FCall(ctx context.Context, c Processor, fn string, keys []string, args ...any) *redis.Cmd {
	return eval(ctx, c, "fcall", fn, keys, args)
}

// scripter is the redis.Scripter that redis.Script runs on: its EVAL and
// EVALSHA are sent once. Scripts are not cached by hash here: Run sends
// EVALSHA with the hash NewScript computed, as go-redis does.
type scripter struct{ c Processor }

func (s scripter) Eval(ctx context.Context, script string, keys []string, args ...any) *redis.Cmd {
	return eval(ctx, s.c, "eval", script, keys, args)
}

func (s scripter) EvalSha(ctx context.Context, sha1 string, keys []string, args ...any) *redis.Cmd {
	return eval(ctx, s.c, "evalsha", sha1, keys, args)
}

func (s scripter) EvalRO(ctx context.Context, script string, keys []string, args ...any) *redis.Cmd {
	return eval(ctx, s.c, "eval_ro", script, keys, args)
}

func (s scripter) EvalShaRO(ctx context.Context, sha1 string, keys []string, args ...any) *redis.Cmd {
	return eval(ctx, s.c, "evalsha_ro", sha1, keys, args)
}

func (s scripter) ScriptExists(ctx context.Context, hashes ...string) *redis.BoolSliceCmd {
	args := []any{"script", "exists"}
	for _, h := range hashes {
		args = append(args, h)
	}
	cmd := redis.NewBoolSliceCmd(ctx, args...)
	_ = s.c.Process(ctx, cmd)
	return cmd
}

func (s scripter) ScriptLoad(ctx context.Context, script string) *redis.StringCmd {
	cmd := redis.NewStringCmd(ctx, "script", "load", script)
	_ = s.c.Process(ctx, cmd)
	return cmd
}

// eval sends name (EVAL, EVALSHA, FCALL and their read-only forms) with
// payload (the script, its hash, the function), keys and args, laid out
// as go-redis's methods of those names lay them out (a lone []string or
// []any argument is spread, as theirs spread it).
func eval(ctx context.Context, c Processor, name, payload string, keys []string, args []any) *redis.Cmd {
	if len(args) == 1 {
		switch a := args[0].(type) {
		case []any:
			args = a
		case []string:
			args = make([]any, len(a))
			for i, s := range a {
				args[i] = s
			}
		}
	}
	cmdArgs := make([]any, 0, 3+len(keys)+len(args))
	cmdArgs = append(cmdArgs, name, payload, len(keys))
	for _, k := range keys {
		cmdArgs = append(cmdArgs, k)
	}
	cmdArgs = append(cmdArgs, args...)
	firstKey := 0
	if len(keys) > 0 {
		firstKey = 3
	}
	return Do(ctx, c, firstKey, cmdArgs...)
}
