package redisonce_test

import (
	"context"
	"os"
	"testing"

	"github.com/redis/go-redis/v9"

	"github.com/shaper-dev/shaper/internal/redisonce"
	"github.com/shaper-dev/shaper/internal/redistest"
)

func TestMain(m *testing.M) { os.Exit(redistest.Main(m)) }

// TestLostReplyRunsOnce loses the reply to a script that adds one to a
// counter, after Redis ran it: the connection closes (EOF) or the reply
// never comes (a read timeout). A client with go-redis's default retries
// runs a redis.Script twice (the counter reads 2); redisonce runs it
// once and returns the error (1), through EVALSHA, through EVAL after
// NOSCRIPT, and as a function (FCALL).
func TestLostReplyRunsOnce(t *testing.T) {
	ctx := context.Background()
	direct := redistest.Client(t)
	proxy := redistest.StartLostReply(t, redistest.Addr(t))
	prefix := redistest.Prefix(t)
	// The script is the test's own (the prefix in a comment), so that no
	// other test has loaded it: the first run meets NOSCRIPT.
	src := "-- " + prefix + "\nreturn redis.call('INCR', KEYS[1])"
	fn := "once_" + prefix[len("test-"):]
	if err := direct.FunctionLoad(ctx, "#!lua name="+fn+"\nredis.register_function('"+fn+"', function(keys) return redis.call('INCR', keys[1]) end)").Err(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = direct.FunctionDelete(context.Background(), fn).Err() })

	for _, tc := range []struct {
		name   string
		stall  bool   // no reply (read timeout) rather than EOF
		loaded bool   // the script is in Redis's cache: EVALSHA runs it
		marker string // the bytes of the command whose reply is lost
		run    func(ctx context.Context, c redis.UniversalClient, s *redis.Script, key string) *redis.Cmd
		want   int64 // runs
	}{
		{"Script.Run/EOF", false, true, "sha", scriptRun, 2},
		{"Script.Run/timeout", true, true, "sha", scriptRun, 2},
		{"Run/EOF", false, true, "sha", onceRun, 1},
		{"Run/timeout", true, true, "sha", onceRun, 1},
		{"Run/NOSCRIPT then EVAL/EOF", false, false, "-- Run/NOSCRIPT", onceRun, 1},
		{"FCall/EOF", false, false, fn, onceFCall(fn), 1},
		{"FCall/timeout", true, false, fn, onceFCall(fn), 1},
	} {
		t.Run(tc.name, func(t *testing.T) {
			// Each case runs its own copy of the script (a different
			// comment), so that it is loaded or not as the case says.
			s := redis.NewScript(src + " -- " + tc.name)
			key := prefix + ":" + tc.name
			if tc.loaded {
				if err := s.Load(ctx, direct).Err(); err != nil {
					t.Fatal(err)
				}
			}
			// go-redis's defaults: 3 retries, a 3 s read timeout (a
			// stalled reply costs that; a shorter one timed out unarmed
			// round trips through the proxy on a busy machine).
			c := redis.NewClient(&redis.Options{Addr: proxy.Addr()})
			defer c.Close()
			// Unarmed, it runs and answers (a copy of the script of its
			// own, which leaves s as loaded or not as the case says).
			if n, err := tc.run(ctx, c, redis.NewScript(src+" -- plain"), key+":plain").Int64(); n != 1 || err != nil {
				t.Fatalf("unarmed: %d, %v; want 1, nil", n, err)
			}
			marker := tc.marker
			if marker == "sha" {
				marker = s.Hash()
			}
			proxy.Arm(marker, tc.stall)
			lost := proxy.Lost()
			err := tc.run(ctx, c, s, key).Err()
			if proxy.Lost() != lost+1 {
				t.Fatalf("the proxy lost %d replies, want 1", proxy.Lost()-lost)
			}
			runs, rerr := direct.Get(ctx, key).Int64()
			if rerr != nil {
				t.Fatal(rerr)
			}
			t.Logf("reply lost: the script ran %d times; the caller got %v", runs, err)
			if runs != tc.want {
				t.Errorf("the script ran %d times for one call, want %d", runs, tc.want)
			}
			if tc.want == 1 && err == nil {
				t.Error("the caller got no error for a lost reply: it cannot know whether the script ran")
			}
			direct.Del(ctx, key, key+":plain")
		})
	}
}

func scriptRun(ctx context.Context, c redis.UniversalClient, s *redis.Script, key string) *redis.Cmd {
	return s.Run(ctx, c, []string{key})
}

func onceRun(ctx context.Context, c redis.UniversalClient, s *redis.Script, key string) *redis.Cmd {
	return redisonce.Run(ctx, c, s, []string{key})
}

func onceFCall(fn string) func(ctx context.Context, c redis.UniversalClient, s *redis.Script, key string) *redis.Cmd {
	return func(ctx context.Context, c redis.UniversalClient, _ *redis.Script, key string) *redis.Cmd {
		return redisonce.FCall(ctx, c, fn, []string{key})
	}
}
