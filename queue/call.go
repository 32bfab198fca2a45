package queue

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"slices"
	"strconv"
	"time"

	"github.com/hibiken/asynq"

	"github.com/shaper-dev/shaper/shaper"
	"github.com/shaper-dev/shaper/vendorclients"
)

// awaitRedis is the longest a handler waits for an unavailable Redis
// before it returns its task to asynq: less than asynq's 30 s lease, past
// which asynq no longer records the task's end.
const awaitRedis = 20 * time.Second

// handle is the asynq handler of every vendor's server: the built-in call
// type, or the user's handler of the task's type, looked up when the task
// runs so that handlers registered at any time serve every vendor,
// including vendors added by a reload.
func (w *Worker) handle(rt *vendorRuntime) asynq.HandlerFunc {
	run := w.handleRun(rt)
	return func(ctx context.Context, t *asynq.Task) error {
		// A run that may have been judged dead while it held the task
		// checks it is still its own before it starts a call (the fence)
		// and before asynq records its end (settle): see fence.go.
		f := w.newFenceRun(ctx)
		ctx = withFenceRun(ctx, f)
		for {
			again, err := w.settle(ctx, f, run(ctx, t))
			if !again {
				return err
			}
		}
	}
}

// handleRun is one run of a task (handle runs it again when it took back
// a task given away while it was cut off from Redis).
func (w *Worker) handleRun(rt *vendorRuntime) asynq.HandlerFunc {
	return func(ctx context.Context, t *asynq.Task) (err error) {
		// However the task ended, asynq must be able to record it.
		defer w.health.await(ctx, awaitRedis)
		ctx, run := w.startRun(ctx, rt, t)
		defer func() { run.end(ctx, err) }()
		if t.Type() == TypeCall {
			return w.handleCall(ctx, rt, t)
		}
		h := w.handler(t.Type())
		if h == nil {
			return w.noHandler(ctx, rt, t) // left for a worker that has one, or archived (handlers.go)
		}
		account := t.Headers()[accountHeader]
		client, err := rt.clientFor(account)
		if err != nil {
			return err
		}
		req := taskRequest(t)
		req.Tag = w.tagOf(ctx)
		req.Fence = w.fence(fenceRunOf(ctx))
		req.Order = orderOf(t)
		req.Backlogged = w.backlogged(ctx, rt, account, req.Lane)
		for {
			// An http.Client's *url.Error names the URL whole: its query
			// stays out of the stored error.
			err = safeError(h(vendorclients.WithRequest(ctx, req), t, client))
			d := w.asDeferral(ctx, rt, account, req.Lane, err)
			if d == nil {
				return spendRetry(ctx, t, err)
			}
			if !w.holdLastAttempt(ctx, d) {
				return d
			}
		}
	}
}

func (w *Worker) handleCall(ctx context.Context, rt *vendorRuntime, t *asynq.Task) error {
	var call Call
	if err := json.Unmarshal(t.Payload(), &call); err != nil {
		return fmt.Errorf("malformed call payload: %w: %w", err, asynq.SkipRetry)
	}
	id, _ := asynq.GetTaskID(ctx)
	client, err := rt.clientFor(call.Account)
	var res CallResult
	for err == nil {
		err = w.doCall(ctx, rt, client, t, id, call, &res)
		var d *deferError
		if !errors.As(err, &d) || !w.holdLastAttempt(ctx, d) {
			break
		}
		err = nil // waited out in place, with no retry left: ask again
	}
	if errors.Is(err, errGivenBack) {
		return err // a void run: the run that holds the call now ends it (see settle)
	}
	if err == nil && (call.Next != nil || call.Pull != nil) {
		err = w.nextPage(ctx, rt, t, id, call, &res)
	}
	err = spendRetry(ctx, t, err)
	q, _ := asynq.GetQueueName(ctx)
	w.endRun(ctx, asynqTaskKey(q, id), rt.vendor.Name, call.Export, id, res, err)
	if err != nil && len(call.Headers) > 0 {
		// The call's own headers (an Authorization per customer) stay out
		// of the error asynq stores and logs, like the vendor's.
		err = redactedError{err, call.secrets(rt.secrets)}
	}
	w.queueCallback(ctx, rt.vendor.Name, id, t, call, res, err)
	return err
}

// taskRequest reads what a task of the user's own type asks of its
// bucket from its headers (see EnqueueTask).
func taskRequest(t *asynq.Task) shaper.Request {
	var r shaper.Request
	if n, err := strconv.Atoi(t.Headers()[costHeader]); err == nil && n > 1 {
		r.Cost = n
	}
	if t.Headers()[laneHeader] == "high" {
		r.Lane = shaper.High
	}
	return r
}

// secrets returns the values to redact from what the call leaves
// behind: the vendor's header values (vendorSecrets), the call's own, and
// its query's.
func (c Call) secrets(vendorSecrets []string) []string {
	return slices.Concat(headerSecrets(c.Headers), querySecrets(c.Path), vendorSecrets)
}

// redactedError is err with secrets replaced in its message; errors.Is
// and errors.As still see err (a deferral, SkipRetry).
type redactedError struct {
	err     error
	secrets []string
}

func (e redactedError) Error() string { return string(redact([]byte(e.err.Error()), e.secrets)) }
func (e redactedError) Unwrap() error { return e.err }

// asDeferral turns a long wait, a rate-limited answer or a gate that
// cannot reach Redis into a deferral:
// back to the queue without using a retry. Long waits also pause the
// vendor's asynq queue, unless the wait is one account's (its other
// accounts' calls share the queue). It returns nil for other errors.
func (w *Worker) asDeferral(ctx context.Context, rt *vendorRuntime, account string, lane shaper.Lane, err error) *deferError {
	var we *vendorclients.WaitError
	var rl *vendorclients.RateLimitedError
	switch {
	case errors.As(err, &we):
		if account == "" {
			w.pauseQueue(ctx, rt, we.Wait, lane)
		}
		return &deferError{Wait: we.Wait}
	case errors.As(err, &rl):
		return &deferError{Wait: max(rl.RetryAfter, time.Second)}
	case ctx.Err() == nil && errors.Is(err, shaper.ErrUnavailable):
		// Redis is failing over, restarting or stalled: the call never
		// started. Ask again soon, without using a retry (asynq's backoff
		// would leave it for minutes once Redis is back).
		w.health.failed(err)
		return &deferError{Wait: time.Second, Cause: err}
	}
	return nil
}

// backlogged is what a call does when its place in a backlog is further
// than max_wait (shaper.Request.Backlogged): it keeps its place and waits,
// since sent back to the queue it would come back behind the calls
// enqueued after it (G3), and the vendor's asynq queue is paused, as for
// a long wait, so that no replica takes more calls only to hold them. An
// account's backlog does not pause the queue its other accounts share.
func (w *Worker) backlogged(ctx context.Context, rt *vendorRuntime, account string, lane shaper.Lane) func(time.Duration) {
	return func(wait time.Duration) {
		if account == "" {
			w.pauseQueue(ctx, rt, wait, lane)
		}
	}
}

// doCall makes the call, through the gate, and reads the vendor's answer
// into *res.
func (w *Worker) doCall(ctx context.Context, rt *vendorRuntime, client *vendorclients.Client, t *asynq.Task, id string, call Call, res *CallResult) error {
	for attempt := 1; ; attempt++ {
		var body io.Reader
		if len(call.Body) > 0 {
			body = bytes.NewReader(call.Body)
		}
		req, err := client.NewRequest(vendorclients.WithRequest(ctx, shaper.Request{Cost: call.Cost, Lane: call.lane(), Tag: w.tagOf(ctx), Fence: w.fence(fenceRunOf(ctx)), Order: orderOf(t),
			Backlogged: w.backlogged(ctx, rt, call.Account, call.lane())}), call.Method, call.Path, body)
		if err != nil {
			return fmt.Errorf("%w: %w", err, asynq.SkipRetry)
		}
		for k, v := range call.Headers {
			req.Header.Set(k, v)
		}
		if len(call.Body) > 0 && req.Header.Get("Content-Type") == "" {
			req.Header.Set("Content-Type", "application/json")
		}
		req.Header.Set("Idempotency-Key", id)
		req, sent := traceSent(req)
		resp, err := client.Do(req)
		var rl *vendorclients.RateLimitedError
		if errors.As(err, &rl) && attempt < 10 {
			// The vendor is paused for every replica: wait for the next
			// tick after the pause, in this goroutine while it is short.
			continue
		}
		if d := w.asDeferral(ctx, rt, call.Account, call.lane(), err); d != nil {
			return d
		}
		if err != nil {
			if ctx.Err() != nil {
				return err
			}
			return fmt.Errorf("%s %s: %w", call.Method, safePath(call.Path), safeError(err))
		}
		keep := answerKeepOf(rt.applied.Load(), call.secrets(rt.secrets))
		keep.need = pullNeed(call)
		*res = readAnswer(resp, keep)
		resp.Body.Close()
		res.SentAt = sent().UTC()
		excerpt := res.BodyExcerpt(excerptBytes)
		switch {
		case resp.StatusCode >= 200 && resp.StatusCode < 300:
			return nil
		case resp.StatusCode == http.StatusRequestTimeout || resp.StatusCode >= 500:
			return fmt.Errorf("%s %s: HTTP %d: %s", call.Method, safePath(call.Path), resp.StatusCode, excerpt)
		default:
			return fmt.Errorf("%s %s: HTTP %d (not retried): %s: %w", call.Method, safePath(call.Path), resp.StatusCode, excerpt, asynq.SkipRetry)
		}
	}
}

// redact replaces the vendor's header values (secrets) in b: a vendor that
// echoes a request's headers must not leak them into task results.
func redact(b []byte, secrets []string) []byte {
	for _, s := range secrets {
		b = bytes.ReplaceAll(b, []byte(s), []byte("[redacted]"))
	}
	return b
}

// answerBytes is a call's answer as its task's result: JSON, a JSON
// body kept as the vendor wrote it but for the white space between its
// tokens (no HTML escaping). Nil when the run has no answer (an attempt
// answered with a 429 has none).
func (w *Worker) answerBytes(vendor, id string, res CallResult) []byte {
	if res.Status == 0 {
		return nil
	}
	var b bytes.Buffer
	enc := json.NewEncoder(&b)
	enc.SetEscapeHTML(false)
	if err := enc.Encode(res); err != nil {
		w.log.Warn("could not store the call's answer", "vendor", vendor, "task", id, "err", err)
		return nil
	}
	return bytes.TrimSuffix(b.Bytes(), []byte("\n"))
}

// throughOutage runs write, a write to Redis as a call ends; when Redis
// goes away as it runs, it waits for it (up to awaitRedis, or until ctx
// ends) and tries again, three tries in all, and returns the last error.
// The handler waits for Redis so before it returns, as asynq must record
// the call's end too.
func (w *Worker) throughOutage(ctx context.Context, write func() error) error {
	for try := 1; ; try++ {
		err := write()
		if err == nil || !w.health.quiet(err) || try == 3 {
			return err
		}
		w.health.await(ctx, awaitRedis)
	}
}
