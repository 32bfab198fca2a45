package queue

import (
	"context"
	"fmt"
	"log/slog"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/shaper-dev/shaper/internal/redisonce"
)

// redisHealth is what a worker knows of its Redis: whether it is down
// (a ping or an operation found it unavailable, and no ping has worked
// since), and how many warnings were held back meanwhile (asynq logs
// every failed Redis operation, once per task and per poll).
type redisHealth struct {
	log      *slog.Logger
	down     atomic.Bool // read without mu; written with it
	heldBack atomic.Int64
	kept     *redisKept // whether Redis kept its data across a restart; nil: not checked

	mu      sync.Mutex
	since   time.Time     // when it went down
	up      chan struct{} // closed when it answers again; nil while up
	upSince time.Time     // Redis time of the first answer since it last went down (zero: none yet)
	// The latest answer's Redis time (a heartbeat Redis recorded), and
	// when (local clock) it came; gapEnd is the first answer after a
	// silence long enough for the others to judge this worker dead.
	lastRedis, lastLocal, gapEnd time.Time
}

// answering returns since when (Redis time) Redis has answered without
// a failure in between, and Redis time now (the latest answer's, moved on
// by the local clock); false while it is down or has not answered yet.
func (h *redisHealth) answering() (since, now time.Time, ok bool) {
	h.mu.Lock()
	defer h.mu.Unlock()
	return h.upSince, h.lastRedis.Add(time.Since(h.lastLocal)), !h.down.Load() && !h.upSince.IsZero()
}

// heard returns the last heartbeat Redis recorded (Redis time), Redis
// time now as this worker reckons it (that heartbeat moved on by the
// local clock; zero before the first), and the end of the latest silence
// after which the others may have judged this worker dead (zero: none).
func (h *redisHealth) heard() (last, now, gapEnd time.Time) {
	h.mu.Lock()
	defer h.mu.Unlock()
	if h.lastRedis.IsZero() {
		return time.Time{}, time.Time{}, h.gapEnd
	}
	return h.lastRedis, h.lastRedis.Add(time.Since(h.lastLocal)), h.gapEnd
}

// failed records that Redis did not answer; the first failure of an
// outage is logged, the rest are not.
func (h *redisHealth) failed(err error) {
	h.mu.Lock()
	defer h.mu.Unlock()
	if h.down.Load() {
		return
	}
	h.down.Store(true)
	h.since, h.up, h.upSince = time.Now(), make(chan struct{}), time.Time{}
	h.log.Error("Redis does not answer: calls wait for it (no retry is used); what it held comes back only if it keeps its data (a Redis without persistence that restarts comes back empty); warnings about it are held back until it answers", "err", err)
}

// answered records that Redis answered at Redis time now; the end of an
// outage is logged.
func (h *redisHealth) answered(now time.Time) {
	h.mu.Lock()
	defer h.mu.Unlock()
	if h.upSince.IsZero() {
		h.upSince = now
	}
	if !h.lastRedis.IsZero() && now.Sub(h.lastRedis) >= judgedAfter {
		h.gapEnd = now // the others may have judged this worker dead (fence.go)
	}
	if now.After(h.lastRedis) {
		h.lastRedis, h.lastLocal = now, time.Now()
	}
	if !h.down.Load() {
		return
	}
	h.down.Store(false)
	close(h.up)
	h.up = nil
	h.log.Info("Redis answers again: calls go on", "down_for", time.Since(h.since).Round(time.Millisecond),
		"warnings_held_back", h.heldBack.Swap(0))
}

// await waits, at most max, until Redis answers again when it is down.
// A handler calls it before returning its task to asynq: asynq records a
// task's end once, and when that write fails its retry of it never
// succeeds (asynq v0.26 retries with a context already canceled), so the
// task would come back only through its expired lease, 1-2 minutes
// later, and run again.
func (h *redisHealth) await(ctx context.Context, max time.Duration) {
	h.mu.Lock()
	up := h.up
	h.mu.Unlock()
	if up == nil {
		return
	}
	t := time.NewTimer(max)
	defer t.Stop()
	select {
	case <-up:
	case <-ctx.Done():
	case <-t.C:
	}
}

// quiet reports whether a warning about err is to be held back: err says
// Redis is unavailable, which is logged once per outage.
func (h *redisHealth) quiet(err error) bool {
	if !redisonce.Unavailable(err) {
		return false
	}
	h.failed(err)
	h.heldBack.Add(1)
	return true
}

// watchRedis tells Redis this worker is alive every aliveEvery until ctx
// ends (liveness.alive: its heartbeat, which the other workers read to
// tell a dead worker, see recover.go, and its Redis health check), so
// that the end of an outage (and one that no operation met) is seen and
// logged. Calls wait meanwhile (see asDeferral). After an outage, and
// every keptEvery, it checks that Redis kept its data (redisKept). On
// the way out it takes the worker out of the live set: it stopped, it
// did not die.
func watchRedis(ctx context.Context, live *liveness, h *redisHealth) {
	defer func() {
		lctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), time.Second)
		defer cancel()
		_ = live.leave(lctx)
	}()
	t := time.NewTicker(aliveEvery)
	defer t.Stop()
	var keptAt time.Time
	keptDue := false
	for {
		pctx, cancel := context.WithTimeout(ctx, time.Second)
		now, err := live.alive(pctx)
		cancel()
		switch {
		case ctx.Err() != nil:
			return
		case err != nil:
			h.failed(err)
		default:
			wasDown := h.down.Load()
			h.answered(now)
			if h.kept != nil && (wasDown || keptDue || time.Since(keptAt) >= keptEvery) {
				kctx, cancel := context.WithTimeout(ctx, time.Second)
				keptDue = !h.kept.check(kctx) // again at the next beat (a Redis still loading its data)
				cancel()
				keptAt = time.Now()
			}
		}
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
	}
}

// asynqLogger sends asynq's logs to slog; while Redis is known to be down
// it counts asynq's warnings and errors instead (see redisHealth).
type asynqLogger struct {
	l      *slog.Logger
	health *redisHealth
}

func (a asynqLogger) quiet() bool {
	if a.health != nil && a.health.down.Load() {
		a.health.heldBack.Add(1)
		return true
	}
	return false
}

func (a asynqLogger) Debug(args ...any) { a.l.Debug(fmt.Sprint(args...)) }
func (a asynqLogger) Info(args ...any)  { a.l.Info(fmt.Sprint(args...)) }
func (a asynqLogger) Warn(args ...any) {
	msg := fmt.Sprint(args...)
	switch {
	case strings.HasPrefix(msg, "recoverer: could not retry lease expired task") && strings.HasSuffix(msg, "NOT FOUND"):
		// Every replica's recoverer lists the same expired leases; the
		// first one takes the task, the others find it gone.
		a.l.Debug(msg)
	case !a.quiet():
		a.l.Warn(msg)
	}
}
func (a asynqLogger) Error(args ...any) {
	if !a.quiet() {
		a.l.Error(fmt.Sprint(args...))
	}
}
func (a asynqLogger) Fatal(args ...any) { a.l.Error(fmt.Sprint(args...)) }
