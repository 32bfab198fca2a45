package queue

import (
	"context"
	"log/slog"
	"strings"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/shaper-dev/shaper/internal/logtest"
	"github.com/shaper-dev/shaper/internal/redistest"
	"github.com/shaper-dev/shaper/internal/vendorsim"
)

// TestOwnRedisPersistence: ReadPersistence and Risk against real
// redis-servers: none (--appendonly no --save ""), RDB snapshots only,
// AOF with appendfsync no, and AOF with everysec, the one that is quiet.
func TestOwnRedisPersistence(t *testing.T) {
	t.Parallel()
	for _, tt := range []struct {
		name string
		args []string
		want string // "" for no risk
	}{
		{"none", []string{"--appendonly", "no", "--save", ""}, "has no persistence (appendonly no, no RDB save points)"},
		{"rdb", []string{"--appendonly", "no", "--save", "3600 1"}, "persists by RDB snapshots only"},
		{"aof-no", []string{"--appendonly", "yes", "--appendfsync", "no"}, "appendfsync no"},
		{"aof", []string{"--appendonly", "yes", "--appendfsync", "everysec"}, ""},
	} {
		rs := redistest.Start(t, tt.args...)
		rdb := redis.NewClient(&redis.Options{Addr: rs.Addr})
		p, err := ReadPersistence(context.Background(), rdb)
		rdb.Close()
		if err != nil {
			t.Fatalf("%s: %v", tt.name, err)
		}
		risk := p.Risk()
		if tt.want == "" && risk != "" || tt.want != "" && (!strings.Contains(risk, tt.want) || !strings.Contains(risk, "appendonly yes") && tt.name != "aof-no") {
			t.Errorf("%s: %+v: Risk() = %q, want one saying %q", tt.name, p, risk, tt.want)
		}
	}
}

// TestOwnRedisSaysWhenRedisCameBackEmpty: a worker whose Redis restarts
// without persistence (killed, started again empty) says that Redis came
// back empty and calls may have been lost, and never that nothing is
// lost; with an append-only file the restart keeps the data, and the
// worker says so instead.
func TestOwnRedisSaysWhenRedisCameBackEmpty(t *testing.T) {
	t.Parallel()
	for _, durable := range []bool{false, true} {
		var rs *redistest.Server
		if durable {
			rs = redistest.StartDurable(t)
		} else {
			rs = redistest.Start(t)
		}
		e := newEnv(t)
		e.addr = rs.Addr
		e.vendor("kept", policy(5), 0, &vendorsim.Mock{Rate: 5, Window: time.Second})
		log := &logtest.Buffer{}
		rdb := e.rdb()
		w, err := NewWorker(rdb, WorkerConfig{Vendors: e.vendors, KeyPrefix: e.prefix,
			Logger: slog.New(slog.NewTextHandler(log, &slog.HandlerOptions{Level: slog.LevelInfo}))})
		if err != nil {
			t.Fatal(err)
		}
		ctx, cancel := context.WithCancel(context.Background())
		done := make(chan error, 1)
		go func() { done <- w.Run(ctx) }()
		// Up: the worker said it is alive, and checked its Redis (the
		// marker), which it does in the same step.
		deadline := time.Now().Add(20 * time.Second)
		for rdb.Exists(context.Background(), aliveKey(e.prefix)).Val() == 0 || rdb.Exists(context.Background(), keptKey(e.prefix)).Val() == 0 {
			if time.Now().After(deadline) {
				t.Fatalf("durable %v: the worker did not say it is alive and check its Redis in 20 s:\n%s", durable, log)
			}
			time.Sleep(20 * time.Millisecond)
		}
		rs.Kill()
		time.Sleep(2 * time.Second) // an outage the worker sees
		if err := rs.Restart(); err != nil {
			t.Fatal(err)
		}
		want, not := "Redis came back EMPTY", "came back with its data"
		if durable {
			want, not = not, want
		}
		deadline = time.Now().Add(30 * time.Second)
		for !strings.Contains(log.String(), want) {
			if time.Now().After(deadline) {
				t.Fatalf("durable %v: no %q within 30 s of the restart:\n%s", durable, want, log)
			}
			time.Sleep(50 * time.Millisecond)
		}
		cancel()
		<-done
		if s := log.String(); strings.Contains(s, not) || strings.Contains(s, "nothing is lost") {
			t.Errorf("durable %v: the log says %q or that nothing is lost:\n%s", durable, not, s)
		}
	}
}
