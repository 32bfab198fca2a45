package queue

import (
	"errors"
	"fmt"
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
