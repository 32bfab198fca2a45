package main

import (
	"strings"
	"testing"
	"time"

	"github.com/shaper-dev/shaper/internal/redistest"
)

// TestOwnRedisWorkerWarnsWithoutPersistence: a worker joining a Redis
// that keeps nothing across a restart (--appendonly no --save "") warns
// once at start, naming the settings to turn on; on a Redis with an
// append-only file fsynced every second it says nothing of it.
func TestOwnRedisWorkerWarnsWithoutPersistence(t *testing.T) {
	t.Parallel()
	for _, sc := range []struct {
		args []string
		warn bool
	}{
		{[]string{"--appendonly", "no", "--save", ""}, true},
		{[]string{"--appendonly", "yes", "--appendfsync", "everysec"}, false},
	} {
		rs := redistest.Start(t, sc.args...)
		cfg := writeConfig(t, rs.Addr, "persist", "http://127.0.0.1:1", 10)
		cmd, log := startWorker(t, cfg)
		waitUntil(t, 20*time.Second, "the worker to start", func() bool { return strings.Contains(log.String(), "worker started") })
		time.Sleep(500 * time.Millisecond) // anything logged after the start shows too
		_ = cmd.Process.Kill()
		_ = cmd.Wait()
		out := log.String()
		n := strings.Count(out, "Redis may lose queued calls")
		switch {
		case sc.warn && n != 1:
			t.Errorf("%v: %d warnings about persistence, want 1:\n%s", sc.args, n, out)
		case sc.warn:
			for _, want := range []string{"has no persistence (appendonly no, no RDB save points)", "every queued call", "appendonly yes", "appendfsync everysec", "docs/operations.md"} {
				if !strings.Contains(out, want) {
					t.Errorf("%v: the warning does not say %q:\n%s", sc.args, want, out)
				}
			}
		case n != 0:
			t.Errorf("%v: a warning about persistence on a Redis with an append-only file:\n%s", sc.args, out)
		}
	}
}
