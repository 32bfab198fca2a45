package queue

import (
	"context"
	"fmt"
	"log/slog"
	"strconv"
	"strings"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/shaper-dev/shaper/internal/redisonce"
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
		back: time.Second + rt.applied.Load().forwardEvery()}
	var last, counted, idleSince, stallChecked time.Time
	stalls := stallLog{log: w.log.With("vendor", rt.vendor.Name)}
	others := &otherPauseLog{log: w.log.With("vendor", rt.vendor.Name)}
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
		if err := w.superviseOnce(ctx, rt, problems, waits, others); err != nil && ctx.Err() != nil {
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

// A queue shaper pauses says so in asynq's own paused key: asynq's
// PauseQueue writes the Unix time there, shaper writes pausedByShaper and
// the Unix time (asynq and asynqmon only ask whether the key exists). So
// a worker can tell its own pauses from an operator's (asynqmon's Pause)
// with nothing else to keep in step, and heals any queue shaper paused
// once the gate no longer asks for the pause, whether or not the vendor's
// mark (queuePausedKey) is still there: a mark expires (a longer wait
// came, or every worker was down for longer than its TTL), a paused key
// never does. A queue an operator paused is theirs: shaper leaves it
// paused, and says so once.
const pausedByShaper = "shaper "

// unpauseScript deletes asynq's paused key of a queue if shaper paused
// it (an operator may have resumed and paused it again meanwhile).
//
// KEYS[1] asynq's paused key. ARGV[1] pausedByShaper. Returns 1 when it
// deleted the key.
var unpauseScript = redis.NewScript(`
local k_paused = KEYS[1]
local by_shaper = ARGV[1]
local v = redis.call('GET', k_paused)
if v and string.sub(v, 1, #by_shaper) == by_shaper then
	return redis.call('DEL', k_paused)
end
return 0`)

// queuePauses reads, in one round trip, shaper's mark of the vendor's
// pause (markKey: the lanes it paused, "" without one) and asynq's paused
// keys of the vendor's queues (both lanes): those shaper paused, and
// those paused otherwise (an operator).
func (w *Worker) queuePauses(ctx context.Context, rt *vendorRuntime, markKey string) (lanes string, byShaper, byOther []string, err error) {
	qs := []string{rt.queue, rt.high}
	cmds := make([]*redis.StringCmd, len(qs))
	pipe := w.rdb.Pipeline()
	mark := pipe.Get(ctx, markKey)
	for i, q := range qs {
		cmds[i] = pipe.Get(ctx, asynqKey(q, "paused"))
	}
	if _, err := pipe.Exec(ctx); err != nil && err != redis.Nil {
		return "", nil, nil, err
	}
	if lanes, err = mark.Result(); err == redis.Nil {
		lanes, err = "", nil
	}
	if err != nil {
		return "", nil, nil, err
	}
	for i, c := range cmds {
		v, err := c.Result()
		switch {
		case err == redis.Nil:
		case err != nil:
			return "", nil, nil, err
		case strings.HasPrefix(v, pausedByShaper):
			byShaper = append(byShaper, qs[i])
		default:
			byOther = append(byOther, qs[i])
		}
	}
	return lanes, byShaper, byOther, nil
}

func (w *Worker) superviseOnce(ctx context.Context, rt *vendorRuntime, problems *problemLog, waits *waitLog, others *otherPauseLog) error {
	key := queuePausedKey(w.cfg.KeyPrefix, rt.vendor.Name)
	lanes, held, other, err := w.queuePauses(ctx, rt, key)
	problems.check("reading whether the vendor's queue is paused", err)
	if err != nil {
		return err
	}
	others.check(other) // an operator's pause is theirs: said, never undone
	if lanes == "" && len(held) == 0 {
		rt.pausedHere.Store(false)
		return nil
	}
	rt.pausedHere.Store(true) // paused (here or by a replica that may be gone): watch it closely
	st, err := rt.bucket().Stats(ctx)
	problems.check("reading the vendor's gate", err)
	if err != nil {
		return err
	}
	waits.paused(time.Now(), st)
	if st.NextTick > w.cfg.MaxWait {
		return nil // the gate still asks for the pause, mark or no mark
	}
	// The asynq queues first, then the mark. A pause (pauseQueue) marks
	// first, so a replica pausing anew while this one unpauses either
	// finds the mark (and pauses nothing more) or marks after it is
	// gone; either way no queue stays paused with no one to unpause it,
	// since a queue shaper paused is unpaused here whatever its mark.
	// Only the queues shaper paused: an operator's pause of a lane in the
	// mark stays. One key a call: each queue has a hash tag of its own.
	for _, q := range held {
		if err = redisonce.Run(ctx, w.rdb, unpauseScript, []string{asynqKey(q, "paused")}, pausedByShaper).Err(); err != nil {
			break
		}
	}
	if err == nil && lanes != "" {
		err = w.rdb.Del(ctx, key).Err()
	}
	problems.check("unpausing the vendor's queue", err)
	if err != nil {
		return err // the pause stays: the next round tries again
	}
	// Debug: while a backlog lasts this comes every few ticks; waits
	// says when the backlog begins and ends.
	w.log.Debug("vendor's next tick is near: its queue is unpaused", "vendor", rt.vendor.Name, "queue", rt.queue, "next_tick", st.NextTick.Round(time.Millisecond))
	return nil
}

// otherPauseLog says once when a vendor's queue is paused by someone
// other than shaper (an operator, in asynqmon), whose calls then wait
// until they resume it, and once when it is not any more.
type otherPauseLog struct {
	log    *slog.Logger
	paused []string
}

func (l *otherPauseLog) check(queues []string) {
	switch {
	case len(queues) > 0 && len(l.paused) == 0:
		l.log.Warn("the vendor's queue is paused, not by shaper (asynqmon's Pause?): its calls wait until it is resumed (asynqmon's Run, or Inspector.UnpauseQueue)", "queues", queues)
	case len(queues) == 0 && len(l.paused) > 0:
		l.log.Info("the vendor's queue is no longer paused by an operator", "queues", l.paused)
	}
	l.paused = queues
}

// pauseMarkScript marks the vendor's queue as paused by shaper for lanes,
// for at least ttl: a new mark, or one that covers more lanes ("both"
// over "normal"), or lasts longer, than the mark that stood (SETNX would
// keep a shorter expiry than the wait that came after it).
//
// KEYS[1] the vendor's queuePausedKey. ARGV[1] lanes ("normal" or
// "both"), ARGV[2] ttl in ms. Returns the lanes the caller must pause
// now: ARGV[1] when the mark is new or wider, else "".
var pauseMarkScript = redis.NewScript(`
local k_mark = KEYS[1]
local lanes = ARGV[1]
local ttl = tonumber(ARGV[2])
local cur = redis.call('GET', k_mark)
if not cur then
	redis.call('SET', k_mark, lanes, 'PX', ttl)
	return lanes
end
local wider = cur ~= lanes and lanes == 'both'
if wider then
	redis.call('SET', k_mark, lanes, 'KEEPTTL')
end
if redis.call('PTTL', k_mark) < ttl then
	redis.call('PEXPIRE', k_mark, ttl)
end
if wider then return lanes end
return ''`)

// pauseQueue pauses the vendor's asynq queue through a long wait, so that
// no replica dequeues tasks only to send them back; a supervisor unpauses
// it when the wait is nearly over, and logs why the wait is long (a pause
// the vendor asked for, or a backlog) once per state, not at each pause.
// A queue another replica paused is watched here too; a longer wait keeps
// the mark for longer.
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
	pause, err := redisonce.Run(ctx, w.rdb, pauseMarkScript, []string{key}, lanes, (wait + time.Minute).Milliseconds()).Text()
	if err != nil {
		return // Redis is failing (the task is deferred either way)
	}
	if pause == "" {
		rt.pausedHere.Store(true) // paused by a replica: the supervisor watches it (and logs the wait)
		return
	}
	by := pausedByShaper + strconv.FormatInt(time.Now().Unix(), 10)
	for _, q := range pausedQueues(rt, pause) {
		// asynq's PauseQueue, saying who paused it; a queue paused
		// already (by an operator, or a replica) stays as it is.
		if err := w.rdb.SetNX(ctx, asynqKey(q, "paused"), by, 0).Err(); err != nil {
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
