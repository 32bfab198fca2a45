// Package recipes is the usual way teams rate-limit vendor calls from
// asynq workers, for the demo and the benchmark to measure shaper against:
// each replica an asynq.Server whose handler asks its own limiter, defers
// refused tasks with asynq's retry (not counted as a failure), defers
// 429s by Retry-After, and stores each answer's body with the task's
// ResultWriter, kept as long as shaper keeps a call (Retention): the
// same work shaper does, so that the benchmark's overhead ratio compares
// like with like.
package recipes

import (
	"context"
	"errors"
	"io"
	"net/http"
	"strconv"
	"time"

	"github.com/hibiken/asynq"
	"github.com/redis/go-redis/v9"
	"golang.org/x/time/rate"
)

// Retention is how long a finished task and its stored answer are kept
// (shaper's default, queue.DefaultRetention), and MaxAnswer the most of
// a body stored (shaper's default max_answer).
const (
	Retention = 24 * time.Hour
	MaxAnswer = 1 << 20
)

// Admit says whether a call may go now, or how long to defer it.
type Admit func(ctx context.Context) (bool, time.Duration)

// TokenBucket is asynq's documented recipe: a token bucket per worker
// (golang.org/x/time/rate) with burst = rate.
func TokenBucket(perSecond float64, burst int) func() Admit {
	return func() Admit {
		lim := rate.NewLimiter(rate.Limit(perSecond), burst)
		return func(context.Context) (bool, time.Duration) {
			if lim.Allow() {
				return true, 0
			}
			r := lim.Reserve()
			d := r.Delay()
			r.Cancel()
			return false, d
		}
	}
}

type deferred struct{ after time.Duration }

func (d *deferred) Error() string { return "deferred " + d.after.String() }

// Run enqueues calls tasks on queue q (ids q-0, q-1, ...) and starts
// replicas servers, each with its own Redis client from newClient and its
// own limiter from newAdmit, POSTing to vendorURL. Shut the servers down
// when done.
func Run(ctx context.Context, newClient func() *redis.Client, q, vendorURL string, calls, replicas int, newAdmit func() Admit) ([]*asynq.Server, error) {
	ac := asynq.NewClientFromRedisClient(newClient())
	defer ac.Close()
	for i := range calls {
		if _, err := ac.EnqueueContext(ctx, asynq.NewTask("call", nil), asynq.Queue(q), asynq.TaskID(q+"-"+strconv.Itoa(i)), asynq.MaxRetry(10000),
			asynq.Retention(Retention)); err != nil {
			return nil, err
		}
	}
	var servers []*asynq.Server
	for range replicas {
		ok := newAdmit()
		srv := asynq.NewServerFromRedisClient(newClient(), asynq.Config{
			Concurrency: 20, Queues: map[string]int{q: 1}, LogLevel: asynq.FatalLevel, Logger: nopLogger{},
			IsFailure: func(err error) bool { var d *deferred; return !errors.As(err, &d) },
			RetryDelayFunc: func(n int, err error, t *asynq.Task) time.Duration {
				var d *deferred
				errors.As(err, &d)
				return max(d.after, time.Second)
			},
		})
		mux := asynq.NewServeMux()
		mux.HandleFunc("call", func(ctx context.Context, t *asynq.Task) error {
			if allowed, after := ok(ctx); !allowed {
				return &deferred{after: after}
			}
			id, _ := asynq.GetTaskID(ctx)
			req, _ := http.NewRequestWithContext(ctx, "POST", vendorURL+"/orders", nil)
			req.Header.Set("Idempotency-Key", id)
			resp, err := http.DefaultClient.Do(req)
			if err != nil {
				return err
			}
			body, err := io.ReadAll(io.LimitReader(resp.Body, MaxAnswer))
			resp.Body.Close()
			if err != nil {
				return err
			}
			if resp.StatusCode == http.StatusTooManyRequests {
				ra, _ := strconv.Atoi(resp.Header.Get("Retry-After"))
				return &deferred{after: time.Duration(ra) * time.Second}
			}
			_, err = t.ResultWriter().Write(body)
			return err
		})
		if err := srv.Start(mux); err != nil {
			for _, s := range servers {
				s.Shutdown()
			}
			return nil, err
		}
		servers = append(servers, srv)
	}
	return servers, nil
}

type nopLogger struct{}

func (nopLogger) Debug(...any) {}
func (nopLogger) Info(...any)  {}
func (nopLogger) Warn(...any)  {}
func (nopLogger) Error(...any) {}
func (nopLogger) Fatal(...any) {}
