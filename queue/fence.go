package queue

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"time"

	"github.com/hibiken/asynq"
	"github.com/redis/go-redis/v9"

	"github.com/shaper-dev/shaper/internal/redisonce"
	"github.com/shaper-dev/shaper/shaper"
)

// Fencing (G6): a call reaches the vendor once, unless it was on the
// wire when its worker died.
//
// The live workers give a silent one's calls back to their queue when
// their tick came after its last heartbeat + startedWithin (recover.go),
// and a call under a lease nobody renewed when its tick is still ahead.
// A worker that was only cut off from Redis (or stalled) still holds
// those calls. Two rules keep it from sending them as well:
//
//   - At the permit (shaper.Request.Fence), a call whose tick is after
//     the worker's last heartbeat + startedWithin is not started until a
//     heartbeat answers: no one can have given back a call whose tick is
//     within startedWithin of a heartbeat Redis recorded.
//   - After a silence of judgedAfter or more (the others may have judged
//     it dead meanwhile), every run that began before it asks Redis
//     whether its task is still its own (ownerScript) before it starts
//     its call and before it hands the task back to asynq. A task given
//     back since the run began is void for that run: if it is still
//     pending, the run takes it back and goes on (nobody else holds it);
//     if another worker holds it, the run waits until that one is done
//     with it, so that asynq records nothing for the void run over the
//     other's (asynq writes a task's end by its id, whoever holds it);
//     if it ended elsewhere, the run ends without a word to asynq's
//     state (asynq's write then finds the task no longer active).
//
// The check confirms the run's lease (a newer one than a late give-back
// will move), so a worker that judged this one dead from a stale reading
// finds the task held under a newer lease and leaves it. One case stays
// open: a void run whose worker shuts down while another holds its
// task, where asynq writes the void run's end on shutdown.

// givenBackField is the task hash's field that records when the task
// was given back from a silent worker (Redis time, µs).
const givenBackField = "shaper_given_back"

// errGivenBack is a run's answer when its task was given to another
// worker while this one was silent: it starts nothing.
var errGivenBack = errors.New("queue: this call was given to another worker while this one was cut off from Redis; this worker does not send it")

// owner is ownerScript's answer.
type owner int64

const (
	ownerElsewhere owner = 0 // another worker holds the task, or it waits for its retry
	ownerThisRun   owner = 1 // the run holds the task
	ownerNone      owner = 2 // finished, archived or deleted elsewhere
)

// ownerScript tells a run whether its task is still its own after its
// worker was silent, and confirms its lease (see the package's fencing
// notes above). A task given back no later than a second after the run
// began was given back before it: the run took it from pending after.
//
// KEYS[1] asynq:{queue}:active, KEYS[2] asynq:{queue}:lease,
// KEYS[3] asynq:{queue}:pending, KEYS[4] asynq:{queue}:t:<id>.
// ARGV[1] the task id, ARGV[2] when the run began (Redis time, µs),
// ARGV[3] the give-back field, ARGV[4] the lease to hold it under (s
// from now).
// Returns ownerThisRun, ownerElsewhere or ownerNone.
var ownerScript = redis.NewScript(`
local k_active = KEYS[1]
local k_lease = KEYS[2]
local k_pending = KEYS[3]
local k_task = KEYS[4]
local a_id = ARGV[1]
local a_began = tonumber(ARGV[2])
local a_given_back = ARGV[3]
local a_lease_s = tonumber(ARGV[4])
local state, given = unpack(redis.call('HMGET', k_task, 'state', a_given_back))
if not state then return 2 end
local lease = redis.call('TIME')[1] + a_lease_s
if tonumber(given or '0') <= a_began + 1000000 then
  redis.call('ZADD', k_lease, 'XX', 'GT', lease, a_id)
  return 1
end
if state == 'completed' or state == 'archived' then return 2 end
if state == 'pending' and redis.call('LREM', k_pending, 0, a_id) > 0 then
  redis.call('LPUSH', k_active, a_id)
  redis.call('ZADD', k_lease, lease, a_id)
  redis.call('HSET', k_task, 'state', 'active', a_given_back, '0')
  redis.call('HDEL', k_task, 'pending_since')
  return 1
end
return 0
`)

// fenceRun is one run of a task, as the fence sees it.
type fenceRun struct {
	queue, id string
	began     time.Time // Redis time, as the worker reckoned it at the start

	mu       sync.Mutex
	verified time.Time // the latest silence's end the run was checked after
}

// newFenceRun returns the fence of the run of ctx's task; nil outside a
// run of asynq's.
func (w *Worker) newFenceRun(ctx context.Context) *fenceRun {
	q, ok1 := asynq.GetQueueName(ctx)
	id, ok2 := asynq.GetTaskID(ctx)
	if !ok1 || !ok2 {
		return nil
	}
	_, now, _ := w.health.heard()
	if now.IsZero() { // no heartbeat yet: the local clock is the best guess
		now = time.Now()
	}
	return &fenceRun{queue: q, id: id, began: now}
}

type fenceRunKey struct{}

// withFenceRun returns ctx carrying the run's fence.
func withFenceRun(ctx context.Context, f *fenceRun) context.Context {
	if f == nil {
		return ctx
	}
	return context.WithValue(ctx, fenceRunKey{}, f)
}

// fenceRunOf returns the fence of ctx's run, or nil.
func fenceRunOf(ctx context.Context) *fenceRun {
	f, _ := ctx.Value(fenceRunKey{}).(*fenceRun)
	return f
}

// unsure reports whether the run must ask Redis whether its task is its
// own: a silence long enough to be judged dead ended after it began and
// after its last check.
func (f *fenceRun) unsure(gapEnd time.Time) bool {
	f.mu.Lock()
	defer f.mu.Unlock()
	return gapEnd.After(f.began) && gapEnd.After(f.verified)
}

// check runs ownerScript for the run; an ownerThisRun answer covers the
// silences up to gapEnd.
func (f *fenceRun) check(ctx context.Context, rdb redis.UniversalClient, gapEnd time.Time) (owner, error) {
	n, err := redisonce.Run(ctx, rdb, ownerScript, asynqKeys(f.queue, f.id), f.id, f.began.UnixMicro(), givenBackField,
		int64(asynqLease/time.Second)).Int64()
	if err != nil {
		return 0, fmt.Errorf("queue: is call %s still this worker's: %w: %w", f.id, shaper.ErrUnavailable, err)
	}
	if owner(n) == ownerThisRun {
		f.mu.Lock()
		if gapEnd.After(f.verified) {
			f.verified = gapEnd
		}
		f.mu.Unlock()
	}
	return owner(n), nil
}

// fence is the run's shaper.Request.Fence: a call starts only while no
// one can have given it to another worker (see above).
func (w *Worker) fence(f *fenceRun) func(context.Context, time.Time) error {
	if f == nil {
		return nil
	}
	return func(ctx context.Context, tick time.Time) error {
		last, _, gapEnd := w.health.heard()
		if !tick.After(last.Add(startedWithin)) && !f.unsure(gapEnd) {
			return nil // the common call: no round trip
		}
		// A heartbeat first: it records this worker as alive for the
		// others, and tells whether it was silent long enough to be
		// judged dead.
		now, err := w.live.alive(ctx)
		if err != nil {
			w.health.failed(err)
			return fmt.Errorf("queue: call %s waits for Redis before it starts (this worker may be judged dead meanwhile): %w: %w", f.id, shaper.ErrUnavailable, err)
		}
		w.health.answered(now)
		last, _, gapEnd = w.health.heard()
		if f.unsure(gapEnd) {
			c, err := f.check(ctx, w.rdb, gapEnd)
			if err != nil {
				w.health.failed(err)
				return err
			}
			if c != ownerThisRun {
				return errGivenBack
			}
		}
		if tick.After(last.Add(startedWithin)) {
			// A tick further ahead of the heartbeat than a permit ever
			// is: Redis's clock jumped. Ask again rather than guess.
			return fmt.Errorf("queue: call %s: its tick %s is after this worker's heartbeat %s: %w", f.id,
				tick.UTC().Format(time.RFC3339Nano), last.UTC().Format(time.RFC3339Nano), shaper.ErrUnavailable)
		}
		return nil
	}
}

// settle is what a run hands asynq once it ends with err. A run that
// may have been judged dead meanwhile checks that its task is still its
// own: a void run waits while another worker holds the task and ends
// without a word once it ended elsewhere; one that finds its task
// pending takes it back, and runs it again (again) when it had sent
// nothing.
func (w *Worker) settle(ctx context.Context, f *fenceRun, err error) (again bool, _ error) {
	if f == nil {
		return false, err
	}
	_, _, gapEnd := w.health.heard()
	if !errors.Is(err, errGivenBack) && !f.unsure(gapEnd) {
		return false, err
	}
	waited := false
	for {
		c, cerr := f.check(ctx, w.rdb, gapEnd)
		switch {
		case cerr != nil:
		case c == ownerThisRun && errors.Is(err, errGivenBack):
			w.log.Info("a call given to another worker while this one was cut off from Redis was still waiting: this worker took it back", "task", f.id, "queue", f.queue)
			return true, nil
		case c == ownerThisRun:
			return false, err
		case c == ownerNone:
			w.log.Info("a call given to another worker while this one was cut off from Redis was finished there; this worker sent nothing", "task", f.id, "queue", f.queue)
			return false, nil
		case !waited:
			waited = true
			w.log.Debug("a call given to another worker while this one was cut off from Redis is held there: waiting for it to end", "task", f.id, "queue", f.queue)
		}
		select {
		case <-ctx.Done():
			return false, ctx.Err()
		case <-time.After(aliveEvery):
		}
	}
}
