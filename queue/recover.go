package queue

import (
	"context"
	"fmt"
	"strconv"
	"strings"
	"time"

	"github.com/hibiken/asynq"
	"github.com/redis/go-redis/v9"

	"github.com/shaper-dev/shaper/internal/gatehook"
	"github.com/shaper-dev/shaper/internal/redisonce"
)

// A worker that dies holds calls in asynq's active set under a lease
// that nobody renews: asynq gives them back once the lease is 30 s past
// due, in a recoverer that runs every minute (asynq v0.26 recoverer.go),
// 1-2 minutes after the death. Most of them are calls waiting for their
// tick, which never started. Here the live workers give those back in
// seconds:
//
//   - Every worker says it is alive every aliveEvery (liveness.alive,
//     its Redis health check: one round trip); one silent for deadAfter
//     is dead to the others.
//   - Every grant of a tick records who holds the call, in the same
//     round trip: the call's tag (shaper.Request.Tag, see tagOf) names
//     the worker, the task's queue and its id, and the gate keeps it
//     with the tick (gatehook.Tagged).
//   - A worker that lived to see its last heartbeat L sends a call no
//     sooner than its tick, and would have said it is alive again by
//     L+aliveEvery: a call whose tick is after L+startedWithin never
//     started. Those go back to their queue at once (requeueScript); the
//     others may be at the vendor and wait for asynq's lease, as before,
//     and are sent again with the same Idempotency-Key if asynq's
//     recoverer finds them unfinished.
//
// The calls a dead worker took but was not granted a tick for (waiting
// to ask the gate again within max_wait), and those whose end asynq
// could not record while Redis was away, have no heartbeat to miss: they
// are found by their lease. A lease no worker renewed for staleAfter
// (asynq renews a live worker's every 5 s) belongs to no live worker; a
// call under it that the gate never granted a tick (no record in the last
// 30 s), or whose tick is still ahead, never started and goes back to its
// queue (sweepStale), while the record still covers every grant since
// the lease's last renewal (sweepWithin). A call whose tick has passed
// may have started and waits for asynq's lease.
//
// A worker that was not dead but cut off or stalled (no heartbeat for
// deadAfter while it held granted calls) is fenced (fence.go): it starts
// no call whose tick is after its last heartbeat + startedWithin, and
// after such a silence it starts nothing it held until Redis says the
// call is still its own. So a call reaches the vendor exactly once,
// unless it was on the wire when its worker died (then it is sent again
// with the same Idempotency-Key once asynq's lease expires).
//
// The tasks given back carry the Redis time of it in their hash
// (givenBackField), which is how a fenced worker tells them.
const (
	aliveEvery = 250 * time.Millisecond
	deadAfter  = 3 * time.Second
	// judgedAfter is the silence after which a worker treats the calls it
	// held as possibly given back: deadAfter less a second for the
	// others' reckoning of Redis time running ahead of it.
	judgedAfter = deadAfter - time.Second
	// startedWithin: a call whose tick is after a worker's last
	// heartbeat + startedWithin never started (the fence holds its worker
	// to that). Four heartbeats: a worker whose heartbeat is late by less
	// fences nothing; one later asks Redis (fence.go) before it starts.
	startedWithin = 4 * aliveEvery
	// recoverEvery is how often a worker looks for dead ones.
	recoverEvery = time.Second
	// staleAfter is how long a lease goes without a renewal before its
	// call belongs to no live worker: three of asynq's 5 s renewals.
	staleAfter = 15 * time.Second
	// sweepWithin bounds the leases swept: one last renewed longer ago
	// may have had its grant leave the gate's record (30 s after the
	// tick), so a call without a record may yet have started; it waits
	// for asynq's lease.
	sweepWithin = 25 * time.Second
	// upFor is how long this worker must have reached Redis before it
	// judges others: after an outage every worker was silent, and every
	// lease went without a renewal.
	upFor = 5 * time.Second
)

// requeueScript puts a task a dead worker held back at the head of its
// queue, as asynq's own Requeue does (asynq v0.26 internal/rdb
// requeueCmd: the same keys and writes; TestRequeueHeldTask pins them
// against asynq's Inspector and server): out of the active list and the
// lease set, onto the pending list's dequeue end, state pending. A task
// no longer active (finished, or already given back) is left alone.
//
// The task goes back only while its lease is the one the dead worker
// held (at most ARGV[2]): several live workers may look at the same dead
// one, and a task one of them gave back and another took since has a
// newer lease, which keeps it where it is.
//
// The task's hash records when it was given back (givenBackField, Redis
// time in µs): the worker that held it, if it was cut off rather than
// dead, finds there that its run of the call is void (fence.go).
//
// KEYS[1] asynq:{queue}:active, KEYS[2] asynq:{queue}:lease,
// KEYS[3] asynq:{queue}:pending, KEYS[4] asynq:{queue}:t:<id>.
// ARGV[1] the task id, ARGV[2] the newest lease it may have (Unix s),
// ARGV[3] the hash field of the give-back.
// Returns 1 when the task went back, 0 when it was not active or is
// held under a newer lease.
var requeueScript = redis.NewScript(`
local k_active = KEYS[1]
local k_lease = KEYS[2]
local k_pending = KEYS[3]
local k_task = KEYS[4]
local a_id = ARGV[1]
local a_max_lease = tonumber(ARGV[2])
local a_given_back = ARGV[3]
local lease = tonumber(redis.call('ZSCORE', k_lease, a_id))
if not lease or lease > a_max_lease then return 0 end
if redis.call('LREM', k_active, 0, a_id) == 0 then return 0 end
local t = redis.call('TIME')
redis.call('ZREM', k_lease, a_id)
redis.call('RPUSH', k_pending, a_id)
redis.call('HSET', k_task, 'state', 'pending', a_given_back, string.format('%d', t[1] * 1000000 + t[2]))
return 1
`)

// tagOf is the tag of the call of a handler's ctx in its bucket's record
// (shaper.Request.Tag): "worker|queue|task id", the worker being this
// one (worker ids hold no "|").
func (w *Worker) tagOf(ctx context.Context) string {
	q, ok1 := asynq.GetQueueName(ctx)
	id, ok2 := asynq.GetTaskID(ctx)
	if !ok1 || !ok2 {
		return ""
	}
	return w.live.worker + "|" + q + "|" + id
}

// taskOfTag splits a tag (see tagOf) into its worker and its task
// ("queue|task id").
func taskOfTag(tag string) (worker, task string) {
	worker, task, _ = strings.Cut(tag, "|")
	return worker, task
}

// requeueHeld puts task holder ("queue|id") back in its queue if it is
// still active under a lease no newer than maxLease; it reports whether
// it went back.
func requeueHeld(ctx context.Context, rdb redis.UniversalClient, holder string, maxLease time.Time) (bool, error) {
	q, id, ok := strings.Cut(holder, "|")
	if !ok {
		return false, nil
	}
	n, err := redisonce.Run(ctx, rdb, requeueScript, asynqKeys(q, id), id, maxLease.Unix(), givenBackField).Int()
	return n == 1, err
}

// recoverDead looks for dead workers every recoverEvery until ctx ends
// and gives back their calls that never started (see above).
func (w *Worker) recoverDead(ctx context.Context) {
	t := time.NewTicker(recoverEvery)
	defer t.Stop()
	swept := map[string]time.Time{} // dead replica -> its last heartbeat, swept
	for {
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
		since, now, ok := w.health.answering() // this worker's heartbeat
		if !ok {
			continue
		}
		// After an outage every worker was silent: judge others only once
		// this one has been heard for upFor.
		if now.Sub(since) < upFor {
			continue
		}
		silent, err := w.live.silent(ctx, now, deadAfter)
		if err != nil {
			continue
		}
		seen := make(map[string]bool, len(silent))
		for _, s := range silent {
			seen[s.worker] = true
			if last, done := swept[s.worker]; done && last.Equal(s.lastSeen) {
				continue
			}
			swept[s.worker] = s.lastSeen
			w.giveBack(ctx, s, now)
		}
		for r := range swept {
			if !seen[r] { // forgotten, or alive again
				delete(swept, r)
			}
		}
	}
}

// giveBack requeues dead worker s's calls whose tick came after it
// could last have sent one, and those waiting in a bucket's line (no
// tick yet), in every vendor of this worker.
func (w *Worker) giveBack(ctx context.Context, s silence, now time.Time) {
	after := s.lastSeen.Add(startedWithin)
	// The newest lease the dead worker can have given its calls: one
	// renewed by its last moment, within a heartbeat or two of its last
	// one; a worker that took a call since did so after deadAfter, under
	// a lease at least that much newer (asynq's lease scores are whole
	// seconds, by each worker's clock).
	maxLease := s.lastSeen.Add(asynqLease + time.Second)
	back, gone := 0, 0
	for _, rt := range w.runtimes(nil) {
		bucket := rt.bucket()
		tagged, err := gatehook.Tagged(ctx, bucket, after)
		if err != nil {
			w.log.Warn("could not read a dead worker's calls; they come back when asynq's lease expires", "vendor", rt.vendor.Name, "worker", s.worker, "err", err)
			continue
		}
		var done []string
		for _, t := range tagged {
			worker, task := taskOfTag(t.Tag)
			if worker != s.worker {
				continue
			}
			ok, err := requeueHeld(ctx, w.rdb, task, maxLease)
			if err != nil {
				w.log.Warn("could not give a dead worker's call back to its queue; it comes back when asynq's lease expires", "vendor", rt.vendor.Name, "worker", s.worker, "err", err)
				break
			}
			done = append(done, t.Tag)
			if ok {
				back++
			} else {
				gone++
			}
		}
		if err := gatehook.Untag(ctx, bucket, done...); err != nil {
			w.log.Debug("could not release a dead worker's held calls", "vendor", rt.vendor.Name, "err", err)
		}
		// Its calls waiting in the bucket's line were granted no tick:
		// none started. (A per-account vendor's lines are its accounts':
		// those come back by their lease, sweepStale.)
		lined, err := gatehook.Lined(ctx, bucket)
		if err != nil {
			continue
		}
		var unlined []string
		for _, m := range lined {
			worker, task := taskOfTag(m)
			if worker != s.worker {
				continue
			}
			ok, err := requeueHeld(ctx, w.rdb, task, maxLease)
			if err != nil {
				break
			}
			unlined = append(unlined, m)
			if ok {
				back++
			} else {
				gone++
			}
		}
		_ = gatehook.Unline(ctx, bucket, unlined...)
	}
	if back > 0 {
		w.log.Info(fmt.Sprintf("a worker went silent %s ago: %d of its calls that had not started are back in their queues (calls that may have started come back when asynq's lease expires)",
			now.Sub(s.lastSeen).Round(100*time.Millisecond), back), "worker", s.worker, "last_seen", s.lastSeen.UTC().Format(time.RFC3339Nano))
	} else {
		w.log.Debug("a worker went silent; none of its calls waited for a tick", "worker", s.worker, "finished_or_taken", gone)
	}
}

// sweepStale gives back the calls of rt's queues under a lease nobody
// renewed for staleAfter that never started (see above). It returns how
// many went back.
func (w *Worker) sweepStale(ctx context.Context, rt *vendorRuntime) (int, error) {
	since, now, ok := w.health.answering()
	if !ok || now.Sub(since) < upFor {
		return 0, nil
	}
	// Leases last renewed between staleAfter and sweepWithin ago: the
	// record of grants still covers every grant since their renewal.
	// asynq writes a lease's score by its worker's clock; they are read
	// here against Redis time (now), the one clock the workers share,
	// not this worker's own: a worker whose clock ran ahead would sweep
	// leases others renewed a moment ago. (Workers' clocks must agree
	// with Redis's within a few seconds, as asynq's leases assume.)
	staleBefore := now.Add(asynqLease - staleAfter)
	lo := strconv.FormatInt(now.Add(asynqLease-sweepWithin).Unix(), 10)
	hi := strconv.FormatInt(staleBefore.Unix(), 10)
	var stale []string
	for _, q := range []string{rt.queue, rt.high} {
		ids, err := w.rdb.ZRangeByScore(ctx, asynqKey(q, "lease"), &redis.ZRangeBy{Min: "(" + lo, Max: "(" + hi}).Result()
		if err != nil {
			return 0, err
		}
		for _, id := range ids {
			stale = append(stale, q+"|"+id)
		}
	}
	if len(stale) == 0 {
		return 0, nil
	}
	tagged, err := gatehook.Tagged(ctx, rt.bucket(), time.Time{})
	if err != nil {
		return 0, err
	}
	ticks := make(map[string]time.Time, len(tagged)) // task -> its latest tick, whichever worker holds it
	for _, t := range tagged {
		if _, task := taskOfTag(t.Tag); t.Tick.After(ticks[task]) {
			ticks[task] = t.Tick
		}
	}
	back, started := 0, 0
	for _, h := range stale {
		if tick, ok := ticks[h]; ok && !tick.After(now) {
			started++ // granted a tick that has passed: it may be at the vendor
			continue
		}
		ok, err := requeueHeld(ctx, w.rdb, h, staleBefore)
		if err != nil {
			return back, err
		}
		if ok {
			back++
		}
	}
	if back > 0 {
		w.log.Info(fmt.Sprintf("%d calls under a lease no worker renewed for %s had not started: back in their queue (%d may have started: they come back when asynq's lease expires)",
			back, staleAfter, started), "vendor", rt.vendor.Name)
	}
	return back, nil
}
