package queue

import (
	"context"
	"errors"
	"fmt"
	"maps"
	"strconv"
	"time"

	"github.com/hibiken/asynq"
)

// deferError sends a task back to its queue for Wait without counting a
// failure: waiting and rate-limited answers never use up the retry
// budget.
type deferError struct {
	Wait  time.Duration
	Cause error // why, when it is not the vendor's tick (Redis unavailable)
}

// The starts of deferError's messages (isDeferral reads them back from
// asynq's last error).
const (
	deferRetryPrefix = "retrying in "
	deferWaitPrefix  = "waiting for the vendor's next tick in "
)

func (e *deferError) Error() string {
	if e.Cause != nil {
		return fmt.Sprintf(deferRetryPrefix+"%s without using a retry: %v", e.Wait.Round(time.Millisecond), e.Cause)
	}
	return deferWaitPrefix + e.Wait.Round(time.Millisecond).String()
}

func (e *deferError) Unwrap() error { return e.Cause }

// isFailure is asynq's IsFailure: deferrals are not failures.
func isFailure(err error) bool {
	var d *deferError
	return !errors.As(err, &d)
}

// retryDelay is asynq's RetryDelayFunc.
func (w *Worker) retryDelay(n int, err error, t *asynq.Task) time.Duration {
	var d *deferError
	if errors.As(err, &d) {
		// asynq schedules in whole seconds; never earlier than asked.
		return max(time.Second, d.Wait.Truncate(time.Second)+time.Second)
	}
	if errors.Is(err, asynq.ErrLeaseExpired) {
		// Its worker died: the call never failed, it only needs a worker.
		return time.Second
	}
	if w.cfg.RetryBackoff != nil {
		return w.cfg.RetryBackoff(n)
	}
	return asynq.DefaultRetryDelayFunc(n, err, t)
}

// The retry budget. asynq archives a task whose Retried has reached its
// MaxRetry whatever the error, a deferral included ("not a failure" only
// keeps Retried unchanged). So the tasks Client queues (calls, and tasks
// of the user's own type that carry shaper's headers) are given one retry
// of headroom: asynq's MaxRetry is the budget plus one, the budget itself
// rides in retriesHeader, and the handler turns a failure once the budget
// is spent into SkipRetry (spendRetry). A deferral then always finds room,
// on any attempt (G6). A task without the header (queued before this
// scheme, or a user task queued bare, whose asynq.NewTask options shaper
// cannot read back and so does not rebuild) has no headroom: on its last
// attempt a deferral is waited out in place instead (holdLastAttempt).

// retriesHeader carries a task's retry budget: how many failures asynq
// retries (asynq's MaxRetry is one more).
const retriesHeader = "shaper-retries"

// withRetryHeadroom gives t the headroom above: the budget is the last
// MaxRetry in opts; opts gain MaxRetry(budget+1), after the others so
// that it wins. t is rebuilt with its headers: call it only for a task
// whose asynq.NewTask options nothing needs (calls, and tasks rebuilt
// anyway).
func withRetryHeadroom(t *asynq.Task, opts []asynq.Option) (*asynq.Task, []asynq.Option) {
	budget := -1
	for _, o := range opts {
		if o.Type() == asynq.MaxRetryOpt {
			budget, _ = o.Value().(int)
		}
	}
	if budget < 0 {
		return t, opts
	}
	if budget == DefaultMaxRetry {
		// The default budget goes without the header (retryBudget reads
		// it from asynq's MaxRetry): 20 bytes less in every queued call.
		return t, append(opts, asynq.MaxRetry(budget+1))
	}
	h := maps.Clone(t.Headers())
	if h == nil {
		h = map[string]string{}
	}
	h[retriesHeader] = strconv.Itoa(budget)
	return asynq.NewTaskWithHeaders(t.Type(), t.Payload(), h), append(opts, asynq.MaxRetry(budget+1))
}

// retryBudget returns the failures task t may retry: its retriesHeader,
// or asynq's MaxRetry for a task without headroom (max is asynq's).
func retryBudget(headers map[string]string, max int) int {
	if n, err := strconv.Atoi(headers[retriesHeader]); err == nil && n >= 0 && n < max {
		return n
	}
	if _, ok := headers[retriesHeader]; !ok && max == DefaultMaxRetry+1 {
		return DefaultMaxRetry // the default budget, with its headroom
	}
	return max
}

// spendRetry turns a failure of a task whose retry budget is spent into
// SkipRetry, so that asynq archives it (with its error) where it would
// have without the headroom; other errors pass through.
func spendRetry(ctx context.Context, t *asynq.Task, err error) error {
	if err == nil || !isFailure(err) || errors.Is(err, asynq.SkipRetry) {
		return err
	}
	retried, _ := asynq.GetRetryCount(ctx)
	max, _ := asynq.GetMaxRetry(ctx)
	if retried < retryBudget(t.Headers(), max) {
		return err
	}
	return retriesSpent{err}
}

// retriesSpent is a failure past the retry budget: asynq.SkipRetry to
// errors.Is, with the failure's own message.
type retriesSpent struct{ err error }

func (e retriesSpent) Error() string        { return e.err.Error() }
func (e retriesSpent) Unwrap() error        { return e.err }
func (e retriesSpent) Is(target error) bool { return target == asynq.SkipRetry }

// holdMargin is how long before its deadline a task held in place
// (holdLastAttempt) must be back with asynq.
const holdMargin = 2 * time.Second

// holdLastAttempt waits out deferral d in the handler when the task has
// no retry left (a task without headroom, or one whose worker died or
// timed out on its last attempt): returned to asynq, it would be
// archived unsent. asynq renews the lease of a running task; on shutdown
// it gives the task back to its queue. It reports whether it waited (the
// caller then tries again); false means the task has room (return d), or
// d's wait outlasts the task's deadline or ctx ended (d goes back to
// asynq, which archives it: logged).
func (w *Worker) holdLastAttempt(ctx context.Context, d *deferError) bool {
	retried, _ := asynq.GetRetryCount(ctx)
	max, _ := asynq.GetMaxRetry(ctx)
	if retried < max {
		return false
	}
	id, _ := asynq.GetTaskID(ctx)
	if dl, ok := ctx.Deadline(); ok && time.Until(dl) < d.Wait+holdMargin {
		w.log.Warn("a task with no retry left must wait longer than its deadline allows: asynq archives it unsent; queue it through Client with its options (not asynq.NewTask's), which leaves it a retry of headroom",
			"task", id, "wait", d.Wait.Round(time.Millisecond), "deadline_in", time.Until(dl).Round(time.Second), "err", d)
		return false
	}
	timer := time.NewTimer(d.Wait)
	defer timer.Stop()
	select {
	case <-timer.C:
		return true
	case <-ctx.Done():
		return false
	}
}
