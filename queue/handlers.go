package queue

// Handled task types. Workers share vendor queues, and not every worker
// has a handler for every user task type (Worker.Handle): a program of
// the user's runs its own worker beside stock `shaper worker`s. So each
// worker advertises, with the heartbeat that says it is alive
// (aliveScript), the (vendor, task type) pairs it handles, in one sorted
// set scored by the Redis time of the last advertisement. A worker that
// takes a task it has no handler for leaves it for one that has (a
// deferral: back to the queue without using a retry) while some worker
// advertised the pair within aliveForget, which keeps a worker's tasks
// through a restart; once none has, it archives the task at once, with
// an error that says what to do. The set holds only pairs some worker
// advertised within aliveForget: every advertisement trims the rest, and
// the set expires aliveForget after the last one.

import (
	"context"
	"fmt"
	"strconv"
	"time"

	"github.com/hibiken/asynq"
	"github.com/redis/go-redis/v9"
)

// handlersKey is the sorted set of handled (vendor, task type) pairs
// (handlerMember), scored by the Redis time they were last advertised
// (µs). Its hash tag is the alive set's key, so that both are in one hash
// slot (the alive key has no tag of its own, or the prefix's, which
// comes first in both) and one script writes them on Redis Cluster.
func handlersKey(prefix string) string { return prefix + ":handlers{" + aliveKey(prefix) + "}" }

// handlerMember names a (vendor, task type) pair in the handlers' set:
// the vendor quoted, a space, the task type, so that no two pairs share
// a name whatever their characters.
func handlerMember(vendor, taskType string) string {
	return strconv.Quote(vendor) + " " + taskType
}

// advertised returns the pairs this worker handles: each vendor it
// serves, with each task type it has a handler for; nil without
// handlers. The heartbeat sends them (liveness.handled), so a handler
// registered by Handle is advertised at the next beat.
func (w *Worker) advertised() []string {
	w.mu.Lock()
	defer w.mu.Unlock()
	if len(w.handlers) == 0 {
		return nil
	}
	out := make([]string, 0, len(w.vendors)*len(w.handlers))
	for vendor := range w.vendors {
		for taskType := range w.handlers {
			out = append(out, handlerMember(vendor, taskType))
		}
	}
	return out
}

// handledScript says whether some worker advertised a pair lately.
//
// KEYS[1] the handlers' set; ARGV[1] Redis time override (µs; 0: TIME),
// ARGV[2] the pair (handlerMember), ARGV[3] aliveForget (µs). Returns 1
// when the pair was advertised within aliveForget, else 0.
var handledScript = redis.NewScript(`
local k_handlers = KEYS[1]
local a_now = tonumber(ARGV[1])
local a_member = ARGV[2]
local a_forget = tonumber(ARGV[3])
local at = tonumber(redis.call('ZSCORE', k_handlers, a_member))
if not at then
  return 0
end
local now = a_now
if now <= 0 then
  local t = redis.call('TIME')
  now = t[1] * 1000000 + t[2]
end
if at >= now - a_forget then
  return 1
end
return 0
`)

// handledElsewhere reports whether some worker advertised a handler of
// taskType on vendor's queue within aliveForget. It only reads: go-redis
// may send it again.
func (l *liveness) handledElsewhere(ctx context.Context, vendor, taskType string) (bool, error) {
	var override int64
	if l.now != nil {
		override = l.now()
	}
	n, err := handledScript.Run(ctx, l.rdb, []string{l.handlers}, override, handlerMember(vendor, taskType), aliveForget.Microseconds()).Int64()
	if err != nil {
		return false, fmt.Errorf("queue: look for a worker that handles task type %q on vendor %s's queue: %w", taskType, vendor, err)
	}
	return n == 1, nil
}

// leaveForHandler is how long a task this worker has no handler for goes
// back to its queue for (asynq schedules in whole seconds).
const leaveForHandler = time.Second

// noHandler is what a run of a task this worker has no handler for
// returns: a deferral while another worker handles its type on the
// task's vendor (it goes back to the queue for that one, without using a
// retry), else an error that archives it at once. A Redis that does not
// answer defers it too: a Redis blip archives nothing.
func (w *Worker) noHandler(ctx context.Context, rt *vendorRuntime, t *asynq.Task) error {
	vendor := rt.vendor.Name
	handled, err := w.live.handledElsewhere(ctx, vendor, t.Type())
	if err != nil {
		return &deferError{Wait: leaveForHandler, Cause: err}
	}
	if !handled {
		return fmt.Errorf("queue: no live worker handles task type %q on vendor %s's queue (none advertised a handler in the last %s): register it with Worker.Handle in a worker that serves vendor %s, then run the archived task again (asynqmon's Run, or asynq's Inspector.RunTask): %w",
			t.Type(), vendor, aliveForget, vendor, asynq.SkipRetry)
	}
	retried, _ := asynq.GetRetryCount(ctx)
	max, _ := asynq.GetMaxRetry(ctx)
	if retried >= max {
		// asynq archives a task with no retry left whatever it is told
		// (retry.go): say why, rather than that it goes back.
		return fmt.Errorf("queue: task type %q on vendor %s's queue came to a worker without its handler on its last attempt, with no retry left to go back to the queue with: run the archived task again: %w",
			t.Type(), vendor, asynq.SkipRetry)
	}
	id, _ := asynq.GetTaskID(ctx)
	w.log.Debug("a task this worker has no handler for goes back to its queue for a worker that has one", "task", id, "type", t.Type(), "vendor", vendor)
	return &deferError{Wait: leaveForHandler, Cause: fmt.Errorf("queue: this worker has no handler for task type %q; another worker serving vendor %s has one", t.Type(), vendor)}
}
