package queue

import (
	"context"
	"errors"
	"net/http"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/hibiken/asynq"

	"github.com/shaper-dev/shaper/internal/vendorsim"
	"github.com/shaper-dev/shaper/shaper"
)

// TestPlaceInLane pins what placeInLane reads of asynq: tasks are pushed
// on the left of the queue's pending list and taken from its right, so
// the place counts from the right. It fails when asynq changes either.
func TestPlaceInLane(t *testing.T) {
	e := newEnv(t)
	rdb := e.rdb()
	q := "explain-pin-" + e.prefix[5:]
	ac := asynq.NewClientFromRedisClient(rdb)
	ids := []string{"a", "b", "c"}
	for _, id := range ids {
		if _, err := ac.Enqueue(asynq.NewTask("pin", nil), asynq.Queue(q), asynq.TaskID(id)); err != nil {
			t.Fatal(err)
		}
	}
	ctx := context.Background()
	for i, id := range ids {
		if p, err := placeInLane(ctx, rdb, q, id); err != nil || p != int64(i+1) {
			t.Fatalf("place of %s = %d, %v; want %d (the order of enqueueing)", id, p, err, i+1)
		}
	}
	// asynq's own server takes them in that order.
	var mu sync.Mutex
	var order []string
	srv := asynq.NewServerFromRedisClient(rdb, asynq.Config{Concurrency: 1, Queues: map[string]int{q: 1}, LogLevel: asynq.ErrorLevel})
	if err := srv.Start(asynq.HandlerFunc(func(_ context.Context, t *asynq.Task) error {
		mu.Lock()
		defer mu.Unlock()
		order = append(order, t.ResultWriter().TaskID())
		return nil
	})); err != nil {
		t.Fatal(err)
	}
	waitFor(t, 30*time.Second, "asynq to run the three tasks", func() bool {
		mu.Lock()
		defer mu.Unlock()
		return len(order) == len(ids)
	})
	srv.Shutdown()
	if strings.Join(order, ",") != "a,b,c" {
		t.Fatalf("asynq ran %v; placeInLane assumes a,b,c", order)
	}
	if _, err := placeInLane(ctx, rdb, q, "a"); err == nil {
		t.Fatal("a task that is no longer pending has a place")
	}
}

func TestEstimateStart(t *testing.T) {
	now := time.Unix(1_800_000_000, 0)
	base := shaper.Stats{EffectiveRate: 20, Window: time.Second, Source: "configured"}
	for _, tc := range []struct {
		name    string
		st      func(shaper.Stats) shaper.Stats
		ahead   int64
		cap     int
		want    time.Duration
		binding string
		says    string
	}{
		{"backlog", nil, 100, 0, 5 * time.Second, BindBacklog, "a backlog of 100 calls ahead at the effective rate, 20/s"},
		{"next tick beyond the backlog", func(s shaper.Stats) shaper.Stats { s.NextTick = 2 * time.Second; return s }, 10, 0, 2 * time.Second, BindBacklog, "10 calls ahead"},
		{"pause", func(s shaper.Stats) shaper.Stats {
			s.PausedFor, s.PauseReason = 3*time.Second, "HTTP 429, Retry-After: 3"
			return s
		}, 20, 0, 4 * time.Second, BindPause, "paused for 3s (HTTP 429, Retry-After: 3)"},
		{"quota", func(s shaper.Stats) shaper.Stats {
			s.Limits = []shaper.LimitUse{{Limit: shaper.Limit{Rate: 1000, Window: time.Hour}, Quota: true, NextIn: 10 * time.Minute}}
			return s
		}, 0, 0, 10 * time.Minute, BindQuota, "the quota 1000 per 1h is spent for 10m0s"},
		{"in-flight cap", func(s shaper.Stats) shaper.Stats { s.InFlight = 4; return s }, 2, 4, 100 * time.Millisecond, BindInFlight, "in-flight cap (4) is full"},
		{"learned rate", func(s shaper.Stats) shaper.Stats { s.EffectiveRate, s.Source = 10, "learned"; return s }, 30, 0, 3 * time.Second, BindBacklog, "10/s (learned)"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			st := base
			if tc.st != nil {
				st = tc.st(st)
			}
			got := estimateStart(st, tc.ahead, tc.cap, now)
			if got.start.Sub(now) != tc.want || got.binding != tc.binding || !strings.Contains(got.reason, tc.says) {
				t.Fatalf("estimateStart = %s from now, %s, %q; want %s, %s, saying %q", got.start.Sub(now), got.binding, got.reason, tc.want, tc.binding, tc.says)
			}
		})
	}
}

// TestExplain explains a call behind a backlog, one that ran, and an
// unknown id, on a real queue.
func TestExplain(t *testing.T) {
	e := newEnv(t)
	vend := &vendorsim.Mock{Rate: 50, Window: time.Second}
	name := e.vendor("explain", shaper.Policy{Limits: []shaper.Limit{{Rate: 10, Window: time.Second}}}, 0, vend)
	c := e.newClient()
	ctx := context.Background()
	ids := enqueueN(t, c, name, 30)

	before := time.Now()
	ex, err := c.Explain(ctx, ids[20])
	took := time.Since(before)
	if err != nil {
		t.Fatal(err)
	}
	t.Logf("%+v", ex)
	if ex.State != "pending" || ex.Binding != BindBacklog || ex.Place != 21 || ex.Ahead != 20 || ex.Vendor != name || ex.Lane != "normal" {
		t.Fatalf("a call 21st in line: %+v", ex)
	}
	if !strings.Contains(ex.Reason, "backlog of 20 calls") {
		t.Errorf("the reason does not name the backlog: %q", ex.Reason)
	}
	// 20 ahead at the effective rate, from the moment Explain ran.
	want := time.Duration(20 / ex.Rate * float64(time.Second))
	if d := ex.EstimatedStart.Sub(before); ex.Rate < 9 || ex.Rate > 10 || d < want-time.Millisecond || d > want+took+time.Millisecond {
		t.Errorf("estimated start %s after asking, at %.4g/s; want %s (20 calls ahead at the rate) within the %s Explain took", d, ex.Rate, want, took)
	}

	if _, err := c.Explain(ctx, "no-such-task"); !errors.Is(err, ErrNoTask) {
		t.Fatalf("unknown id: %v; want ErrNoTask", err)
	}

	e.startWorker(nil)
	waitFor(t, time.Minute, "every call", func() bool { return vend.Summarize().DistinctKeys == len(ids) })
	waitFor(t, 10*time.Second, "the first call to be recorded as done", func() bool {
		ex, err = c.Explain(ctx, ids[0])
		return err == nil && ex.Binding == BindDone
	})
	if ex.State != "completed" || ex.Status != http.StatusOK || ex.CompletedAt == nil || !strings.Contains(ex.Reason, "HTTP 200") {
		t.Fatalf("a call that ran: %+v", ex)
	}
}
