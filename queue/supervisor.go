package queue

import (
	"context"
	"fmt"
	"log/slog"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/shaper-dev/shaper/shaper"
)

// supervisorEvery is how often a vendor's supervisor looks at a queue
// this process paused; supervisorIdleEvery how often it looks otherwise
// (in case the replica that paused it died).
const (
	supervisorEvery     = 500 * time.Millisecond
	supervisorIdleEvery = 10 * time.Second
)

// supervise runs while the vendor's server does: it unpauses the vendor's
// asynq queue when the wait that paused it is nearly over, and tells Run
// when the queue has held nothing for idleStopAfter, so that its server
// stops. (Heartbeats and the recovery of learned rates ride on the gate's
// grants: no polling for them.) Redis errors are logged once per failure
// streak, and long waits once per state (waitLog), not at each pause and
// unpause.
func (w *Worker) supervise(ctx context.Context, rt *vendorRuntime) {
	t := time.NewTicker(supervisorEvery)
	defer t.Stop()
	problems := newProblemLog(w.log.With("vendor", rt.vendor.Name), &w.health)
	waits := &waitLog{log: w.log.With("vendor", rt.vendor.Name, "queue", rt.queue), maxWait: w.cfg.MaxWait,
		back: time.Second + rt.vendor.forwardEvery()}
	var last, counted, idleSince, stallChecked time.Time
	stalls := stallLog{log: w.log.With("vendor", rt.vendor.Name)}
	for {
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
		if time.Since(counted) >= min(idleCheckEvery, w.idleStop/2) {
			counted = time.Now()
			n, err := waitingCounts(ctx, w.rdb, []string{rt.vendor.Name})
			problems.check("counting the vendor's queue", err)
			switch {
			case err != nil || n[0] > 0 || rt.pausedHere.Load():
				idleSince = time.Time{}
			case idleSince.IsZero():
				idleSince = counted
			case counted.Sub(idleSince) >= w.idleStop:
				idleSince = time.Time{}
				select {
				case w.idlec <- rt:
				case <-ctx.Done():
					return
				}
			}
		}
		if time.Since(stallChecked) >= stallCheckEvery {
			stallChecked = time.Now()
			qs, err := readQueueStats(ctx, w.rdb, rt.vendor.Name, queueStalls)
			if err == nil && qs.Stalled > 0 {
				if n, serr := w.sweepStale(ctx, rt); serr == nil && n > 0 {
					qs, err = readQueueStats(ctx, w.rdb, rt.vendor.Name, queueStalls)
				}
			}
			if err == nil {
				stalls.check(qs)
			}
		}
		if !rt.pausedHere.Load() {
			waits.running(time.Now())
			if time.Since(last) < supervisorIdleEvery {
				continue // no Redis call for a queue nobody here paused
			}
		}
		last = time.Now()
		if err := w.superviseOnce(ctx, rt, problems, waits); err != nil && ctx.Err() != nil {
			return
		}
	}
}

// stallCheckEvery is how often a vendor's supervisor looks for stalled
// calls (QueueStats.Stalled).
const stallCheckEvery = 2 * time.Second

// stallLog says once when a vendor's queue has stalled calls (active
// under a lease nobody renews: a worker died or lost Redis), and once
// when it has none again.
type stallLog struct {
	log     *slog.Logger
	stalled bool
}

func (s *stallLog) check(qs QueueStats) {
	switch {
	case qs.Stalled > 0 && !s.stalled:
		s.stalled = true
		s.log.Warn(fmt.Sprintf("%d calls are stalled: a worker holds them and has not renewed their lease for %s (it died, or lost Redis); they may have started, and asynq gives them back once their lease is 30 s past due (up to 2 minutes), sent again with the same Idempotency-Key",
			qs.Stalled, qs.StalledFor), "stalled", qs.Stalled, "for", qs.StalledFor)
	case qs.Stalled == 0 && s.stalled:
		s.stalled = false
		s.log.Info("no call is stalled any more")
	}
}

func (w *Worker) superviseOnce(ctx context.Context, rt *vendorRuntime, problems *problemLog, waits *waitLog) error {
	key := queuePausedKey(w.cfg.KeyPrefix, rt.vendor.Name)
	lanes, err := w.rdb.Get(ctx, key).Result()
	if err == redis.Nil {
		rt.pausedHere.Store(false)
		return nil
	}
	problems.check("reading whether the vendor's queue is paused", err)
	if err != nil {
		return err
	}
	rt.pausedHere.Store(true) // paused (here or by a replica that may be gone): watch it closely
	st, err := rt.bucket().Stats(ctx)
	problems.check("reading the vendor's gate", err)
	if err != nil {
		return err
	}
	waits.paused(time.Now(), st)
	if st.NextTick > w.cfg.MaxWait {
		return nil
	}
	// The asynq queues first, then the mark: a queue paused without its
	// mark would never be unpaused (a failover that refused the second
	// write left 1,713 calls pending for good). A pause (pauseQueue)
	// marks first, with SETNX, so a replica pausing anew while this one
	// unpauses either fails to mark (and pauses nothing) or marks after
	// the mark is gone. Deleting asynq's paused key is UnpauseQueue
	// without its error for a queue already unpaused (replicas may do
	// this side by side).
	for _, q := range pausedQueues(rt, lanes) {
		if err = w.rdb.Del(ctx, asynqKey(q, "paused")).Err(); err != nil { // one key a call: each queue has a hash tag of its own
			break
		}
	}
	if err == nil {
		err = w.rdb.Del(ctx, key).Err()
	}
	problems.check("unpausing the vendor's queue", err)
	if err != nil {
		return err // the mark stays: the next round tries again
	}
	// Debug: while a backlog lasts this comes every few ticks; waits
	// says when the backlog begins and ends.
	w.log.Debug("vendor's next tick is near: its queue is unpaused", "vendor", rt.vendor.Name, "queue", rt.queue, "next_tick", st.NextTick.Round(time.Millisecond))
	return nil
}

// pauseQueue pauses the vendor's asynq queue through a long wait, so that
// no replica dequeues tasks only to send them back; a supervisor unpauses
// it when the wait is nearly over, and logs why the wait is long (a pause
// the vendor asked for, or a backlog) once per state, not at each pause.
// A queue another replica paused is watched here too.
//
// A wait of the high lane (a pause, a spent quota: every lane waits)
// pauses both lanes' queues; a wait of the normal lane (a backlog the high
// lane goes ahead of) only the normal one.
func (w *Worker) pauseQueue(ctx context.Context, rt *vendorRuntime, wait time.Duration, lane shaper.Lane) {
	key := queuePausedKey(w.cfg.KeyPrefix, rt.vendor.Name)
	lanes := "normal"
	if lane == shaper.High {
		lanes = "both"
	}
	ok, err := w.rdb.SetNX(ctx, key, lanes, wait+time.Minute).Result()
	if err != nil {
		return // Redis is failing (the task is deferred either way)
	}
	if !ok {
		rt.pausedHere.Store(true) // paused by a replica: the supervisor watches it (and logs the wait)
		return
	}
	for _, q := range pausedQueues(rt, lanes) {
		if err := w.insp.PauseQueue(q); err != nil {
			w.log.Warn("could not pause the vendor's queue", "vendor", rt.vendor.Name, "queue", q, "err", err)
			return
		}
	}
	rt.pausedHere.Store(true)
	w.log.Debug("vendor's next tick is beyond max_wait: its queue is paused", "vendor", rt.vendor.Name, "queue", rt.queue,
		"next_tick", wait.Round(time.Millisecond), "max_wait", w.cfg.MaxWait)
}

// pausedQueues are the queues a pause of lanes ("normal" or "both", the
// value of the vendor's queuePausedKey) paused.
func pausedQueues(rt *vendorRuntime, lanes string) []string {
	if lanes == "both" {
		return []string{rt.queue, rt.high}
	}
	return []string{rt.queue}
}
