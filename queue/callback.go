package queue

// Callbacks: a call that names a callback URL has its outcome POSTed
// there when it ends (completed, or archived after its retries), signed
// with HMAC-SHA256 over a timestamp and the body, the way Stripe signs
// webhooks. The delivery is a task of its own, on a queue of its own
// (CallbackQueueName), retried with backoff until it is answered 2xx: a
// failing receiver never repeats the vendor call, and the call's id is
// the delivery's Idempotency-Key.

import (
	"bytes"
	"context"
	"crypto/hmac"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"math/rand/v2"
	"net/http"
	"net/url"
	"strconv"
	"strings"
	"time"

	"github.com/hibiken/asynq"
	"go.opentelemetry.io/otel"
	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/codes"
	"go.opentelemetry.io/otel/propagation"
	"go.opentelemetry.io/otel/trace"
)

// Callback delivery: its task type, and defaults of CallbackConfig.
const (
	TypeCallback            = "shaper:callback"
	DefaultCallbackAttempts = 20
	DefaultCallbackTimeout  = 10 * time.Second
	// DefaultCallbackConcurrency is how many deliveries a worker makes at
	// once.
	DefaultCallbackConcurrency = 20
	// maxCallbackBackoff caps the delay between two delivery attempts:
	// 1s, 2s, 4s ... 5m, so 20 attempts span about an hour.
	maxCallbackBackoff = 5 * time.Minute
	// SignatureHeader carries "t=UNIX,v1=HEX": HMAC-SHA256, keyed by the
	// secret, of "UNIX.BODY" (see Sign).
	SignatureHeader = "Shaper-Signature"
)

// CallbackQueueName is the asynq queue of callback deliveries of the
// workers with key prefix prefix (default "shaper": "shaper:callbacks").
func CallbackQueueName(prefix string) string { return prefix + ":callbacks" }

// Callback asks for a call's outcome to be POSTed to URL when it ends.
type Callback struct {
	URL string `json:"url"`
}

// CallbackConfig is the [callbacks] table. Allow lists the URL prefixes a
// callback may name (scheme, host and port exactly, then a path prefix):
// no callback goes to a host it does not name, and with none, callbacks
// are refused at enqueue.
type CallbackConfig struct {
	Allow []string
	// Secret keys the HMAC-SHA256 signature (workers only; enqueueing
	// needs none).
	Secret      string
	Timeout     time.Duration // one delivery attempt; default 10s
	Attempts    int           // delivery attempts before the callback is archived; default 20
	Concurrency int           // deliveries at once per worker; default 20
}

// ErrCallbackNotAllowed is returned for a callback URL outside
// CallbackConfig.Allow.
var ErrCallbackNotAllowed = errors.New("queue: callback URL not allowed")

// checkCallbackURL checks that raw is an absolute http(s) URL whose path
// is plain (plainPath).
func checkCallbackURL(raw string) (*url.URL, error) {
	u, err := url.Parse(raw)
	switch {
	case err != nil:
		return nil, fmt.Errorf("callback url %q: %v", raw, err)
	case u.Scheme != "http" && u.Scheme != "https" || u.Host == "":
		return nil, fmt.Errorf("callback url %q: want an absolute http or https URL, e.g. https://hooks.example.com/shaper", raw)
	case u.User != nil:
		return nil, fmt.Errorf("callback url %q: no user info in a callback URL (its requests are signed instead)", raw)
	case u.Fragment != "":
		return nil, fmt.Errorf("callback url %q: no #fragment in a callback URL", raw)
	}
	if err := plainPath(u); err != nil {
		return nil, fmt.Errorf("callback url %q: %w", raw, err)
	}
	return u, nil
}

// plainPath refuses a URL path that a receiver could resolve to another
// path than the one the allow-list checks: a "." or ".." segment, also
// percent-encoded (%2e%2e) or with ;parameters (..;), and an encoded
// slash (%2f) or a backslash, raw or encoded (%5c), which some servers
// take for a slash.
func plainPath(u *url.URL) error {
	escaped := u.EscapedPath()
	lower := strings.ToLower(escaped)
	if strings.Contains(lower, "%2f") || strings.Contains(lower, "%5c") || strings.ContainsAny(u.Path, "\\\x00") {
		return errors.New("an encoded slash (%2f) or a backslash in its path could be read as a slash by the receiver; write the path with plain slashes")
	}
	for _, seg := range strings.Split(u.Path, "/") {
		seg, _, _ = strings.Cut(seg, ";")
		if seg == "." || seg == ".." {
			return fmt.Errorf("its path has a %q segment (dot-segments, also percent-encoded, could leave an allowed prefix); write the path without them", seg)
		}
	}
	return nil
}

// CheckCallbackAllow checks the entries of an allow-list, for the config.
func CheckCallbackAllow(allow []string) error {
	for _, a := range allow {
		u, err := checkCallbackURL(a)
		if err != nil {
			return err
		}
		if u.RawQuery != "" {
			return fmt.Errorf("%q: an allowed prefix has no ?query", a)
		}
	}
	return nil
}

// allowed reports whether u is under one of the allow-list's prefixes
// (underPrefix); a URL whose path is not plain (plainPath) is under none.
func allowed(allow []string, u *url.URL) bool {
	if plainPath(u) != nil {
		return false
	}
	for _, a := range allow {
		if _, ok := underPrefix(a, u); ok {
			return true
		}
	}
	return false
}

// underPrefix reports whether u is under the allowed prefix a: the same
// scheme and host (with port, case-insensitive), and a path that is the
// prefix's path or below it (a prefix ending in a name, /hooks, allows
// /hooks and /hooks/..., never /hooks-evil), compared decoded, the way
// the receiver reads them (so /hoo%6bs is /hooks). n is the length of the
// prefix's path: the longest match names a receiver (secretFor). u's path
// must be plain (plainPath).
func underPrefix(a string, u *url.URL) (n int, ok bool) {
	p, err := url.Parse(a)
	if err != nil || !strings.EqualFold(p.Scheme, u.Scheme) || !strings.EqualFold(p.Host, u.Host) || plainPath(p) != nil {
		return 0, false
	}
	prefix := strings.TrimSuffix(p.Path, "/")
	if prefix == "" || u.Path == prefix || strings.HasPrefix(u.Path, prefix+"/") {
		return len(prefix), true
	}
	return 0, false
}

// checkCallback checks a call's callback against allow.
func checkCallback(allow []string, cb *Callback) error {
	if cb == nil {
		return nil
	}
	u, err := checkCallbackURL(cb.URL)
	if err != nil {
		if len(allow) > 0 {
			return fmt.Errorf("%w: %w (allowed prefixes, [callbacks] allow: %s)", ErrBadCall, err, strings.Join(allow, ", "))
		}
		return fmt.Errorf("%w: %w", ErrBadCall, err)
	}
	if len(allow) == 0 {
		return fmt.Errorf("%w: callback url %s: callbacks are off in this config; list the receivers' URL prefixes in [callbacks] allow (and set its secret)", ErrBadCall, cb.URL)
	}
	if !allowed(allow, u) {
		return fmt.Errorf("%w: %w: %s is not under any prefix of [callbacks] allow (%s); add its origin there, or call back to an allowed host",
			ErrBadCall, ErrCallbackNotAllowed, cb.URL, strings.Join(allow, ", "))
	}
	return nil
}

// Outcome is the body POSTed to a call's callback.
type Outcome struct {
	ID      string `json:"id"`
	Vendor  string `json:"vendor"`
	Account string `json:"account,omitempty"`
	// State is "completed" (the vendor answered 2xx) or "archived" (the
	// call failed for good: an answer not retried, or its retries spent).
	State string `json:"state"`
	// Status is the vendor's HTTP status of the last attempt (0 when no
	// answer came: a timeout, a refused connection).
	Status int `json:"status,omitempty"`
	// Body is the start of the vendor's answer as stored for the call
	// (CallResult: 512 bytes, with header secrets redacted).
	Body     string `json:"body,omitempty"`
	Error    string `json:"error,omitempty"`
	Attempts int    `json:"attempts"` // vendor calls made, the last one included (waits and 429s aside)
	// EnqueuedAt is when the call was queued (by the enqueuer's clock;
	// absent for a call queued before shaper stamped it).
	EnqueuedAt time.Time `json:"enqueued_at,omitzero"`
	// SentAt is when the last attempt's request was sent to the vendor,
	// after its tick (absent when no answer came: a timeout, a refused
	// connection).
	SentAt time.Time `json:"sent_at,omitzero"`
	// FinishedAt is when the last attempt ended.
	FinishedAt time.Time `json:"finished_at"`
}

// callbackTask is the payload of a delivery.
type callbackTask struct {
	URL  string          `json:"url"`
	Body json.RawMessage `json:"body"` // the Outcome, as signed and sent
}

// callEnded reports whether a call's handler ending with err ends the
// call: success, or a failure asynq archives (not retried, or its
// retries spent). A deferral never ends it.
func callEnded(ctx context.Context, err error) bool {
	switch {
	case err == nil || errors.Is(err, asynq.SkipRetry):
		return true
	case !isFailure(err):
		return false
	}
	n, _ := asynq.GetRetryCount(ctx)
	maxRetry, _ := asynq.GetMaxRetry(ctx)
	return n >= maxRetry
}

// queueCallback queues the delivery of a call's outcome when err ends the
// call and the call asked for one. The delivery's task id is the vendor
// and call id: a call run twice (a worker killed after its vendor call)
// queues one delivery while the first is kept.
func (w *Worker) queueCallback(ctx context.Context, vendor, id string, t *asynq.Task, call Call, res CallResult, err error) {
	if call.Callback == nil || !callEnded(ctx, err) {
		return
	}
	n, _ := asynq.GetRetryCount(ctx)
	o := Outcome{ID: id, Vendor: vendor, Account: call.Account, State: "completed", Status: res.Status, Body: res.Excerpt,
		Attempts: n + 1, EnqueuedAt: enqueuedAt(t), SentAt: res.SentAt, FinishedAt: time.Now().UTC()}
	if err != nil {
		o.State, o.Error = "archived", err.Error()
	}
	body, _ := json.Marshal(o)
	payload, _ := json.Marshal(callbackTask{URL: call.Callback.URL, Body: body})
	attempts := w.cfg.Callbacks.Attempts
	if attempts <= 0 {
		attempts = DefaultCallbackAttempts
	}
	ctx = context.WithoutCancel(ctx)
	delivery := traced(ctx, asynq.NewTask(TypeCallback, payload)) // the delivery joins the call's trace
	// Redis may be failing over: try for as long as asynq's lease lets
	// the call's end be recorded, then leave it to the call being run
	// again.
	deadline := time.Now().Add(awaitRedis)
	for wait := 50 * time.Millisecond; ; wait = min(2*wait, 2*time.Second) {
		_, e := w.aq.EnqueueContext(ctx, delivery, asynq.Queue(CallbackQueueName(w.cfg.KeyPrefix)), asynq.TaskID(vendor+":"+id),
			asynq.MaxRetry(attempts-1), asynq.Retention(w.cfg.Retention))
		if e == nil || errors.Is(e, asynq.ErrTaskIDConflict) {
			return
		}
		if time.Now().Add(wait).After(deadline) {
			w.log.Error("could not queue a call's callback: it is not delivered", "vendor", vendor, "task", id, "url", call.Callback.URL, "err", e)
			return
		}
		time.Sleep(wait)
	}
}

// Sign returns the signature header of body sent at t, keyed by secret:
// "t=UNIX,v1=HEX", HEX being HMAC-SHA256 of "UNIX.BODY".
func Sign(secret string, t time.Time, body []byte) string {
	ts := strconv.FormatInt(t.Unix(), 10)
	return "t=" + ts + ",v1=" + signature(secret, ts, body)
}

func signature(secret, ts string, body []byte) string {
	m := hmac.New(sha256.New, []byte(secret))
	m.Write([]byte(ts))
	m.Write([]byte("."))
	m.Write(body)
	return hex.EncodeToString(m.Sum(nil))
}

// ErrBadSignature is returned by Verify.
var ErrBadSignature = errors.New("queue: bad callback signature")

// Verify checks a callback's signature header against body and secret,
// and that it was signed within tolerance of now (a replayed delivery is
// refused), for receivers written in Go.
func Verify(secret, header string, body []byte, tolerance time.Duration, now time.Time) error {
	var ts string
	var sigs []string
	for _, part := range strings.Split(header, ",") {
		k, v, _ := strings.Cut(strings.TrimSpace(part), "=")
		switch k {
		case "t":
			ts = v
		case "v1":
			sigs = append(sigs, v)
		}
	}
	sec, err := strconv.ParseInt(ts, 10, 64)
	if err != nil || len(sigs) == 0 {
		return fmt.Errorf("%w: want %s: t=UNIX,v1=HEX", ErrBadSignature, SignatureHeader)
	}
	if d := now.Sub(time.Unix(sec, 0)); d > tolerance || d < -tolerance {
		return fmt.Errorf("%w: signed %s from now, beyond the tolerance of %s", ErrBadSignature, d.Round(time.Second), tolerance)
	}
	want := []byte(signature(secret, ts, body))
	for _, s := range sigs {
		if hmac.Equal([]byte(s), want) {
			return nil
		}
	}
	return fmt.Errorf("%w: no v1 signature matches the body and secret", ErrBadSignature)
}

// deliver is the handler of callback deliveries: one signed POST, retried
// by asynq (callbackDelay) until it is answered 2xx.
func (w *Worker) deliver(client *http.Client) asynq.HandlerFunc {
	cfg := w.cfg.Callbacks
	return func(ctx context.Context, t *asynq.Task) error {
		defer w.health.await(ctx, awaitRedis)
		var ct callbackTask
		if err := json.Unmarshal(t.Payload(), &ct); err != nil {
			return fmt.Errorf("malformed callback payload: %w: %w", err, asynq.SkipRetry)
		}
		// The worker checks too: a task queued by an older config, or not
		// through a Client, goes nowhere its own allow-list does not name.
		u, err := checkCallbackURL(ct.URL)
		if err == nil && !allowed(cfg.Allow, u) {
			err = fmt.Errorf("%w: %s is not under any prefix of this worker's [callbacks] allow", ErrCallbackNotAllowed, ct.URL)
		}
		if err != nil {
			return fmt.Errorf("%w: %w", err, asynq.SkipRetry)
		}
		id, _ := asynq.GetTaskID(ctx)
		callID := id
		if _, after, ok := strings.Cut(id, ":"); ok {
			callID = after
		}
		req, err := http.NewRequestWithContext(ctx, http.MethodPost, ct.URL, bytes.NewReader(ct.Body))
		if err != nil {
			return fmt.Errorf("%w: %w", err, asynq.SkipRetry)
		}
		req.Header.Set("Content-Type", "application/json")
		req.Header.Set("User-Agent", "shaper-callback")
		req.Header.Set("Idempotency-Key", callID)
		req.Header.Set(SignatureHeader, Sign(cfg.Secret, time.Now(), ct.Body))
		ctx, span := w.deliverySpan(ctx, t, req)
		defer span.End()
		resp, err := client.Do(req.WithContext(ctx))
		if err != nil {
			span.RecordError(err)
			span.SetStatus(codes.Error, err.Error())
			return fmt.Errorf("callback %s: %w", ct.URL, err)
		}
		span.SetAttributes(attribute.Int("http.response.status_code", resp.StatusCode))
		excerpt, _ := io.ReadAll(io.LimitReader(resp.Body, 256))
		_, _ = io.Copy(io.Discard, io.LimitReader(resp.Body, 1<<20))
		resp.Body.Close()
		if resp.StatusCode < 200 || resp.StatusCode > 299 {
			span.SetStatus(codes.Error, "HTTP "+strconv.Itoa(resp.StatusCode))
			return fmt.Errorf("callback %s: HTTP %d: %s", ct.URL, resp.StatusCode, excerpt)
		}
		return nil
	}
}

// deliverySpan starts the span of one delivery attempt (shaper.callback),
// in the trace of the call whose outcome it carries, and puts its
// traceparent on req.
func (w *Worker) deliverySpan(ctx context.Context, t *asynq.Task, req *http.Request) (context.Context, trace.Span) {
	if h := t.Headers(); h[traceparentHeader] != "" {
		ctx = traceW3C.Extract(ctx, propagation.MapCarrier(h))
	}
	tp := w.cfg.TracerProvider
	if tp == nil {
		tp = otel.GetTracerProvider()
	}
	n, _ := asynq.GetRetryCount(ctx)
	ctx, span := tp.Tracer(tracerName).Start(ctx, "shaper.callback", trace.WithSpanKind(trace.SpanKindClient),
		trace.WithAttributes(attribute.String("http.request.method", http.MethodPost), attribute.String("url.full", req.URL.Redacted()), attrRetry.Int(n)))
	if span.SpanContext().IsValid() {
		traceW3C.Inject(ctx, propagation.HeaderCarrier(req.Header))
	}
	return ctx, span
}

// callbackDelay is the delivery's RetryDelayFunc: 1s, 2s, 4s ... capped
// at maxCallbackBackoff, less up to a fifth at random so that deliveries
// failed together come back spread.
func callbackDelay(n int, _ error, _ *asynq.Task) time.Duration {
	d := maxCallbackBackoff
	if n < 20 {
		d = min(time.Second<<max(n-1, 0), maxCallbackBackoff)
	}
	return d - time.Duration(rand.Int64N(int64(d)/5+1))
}

// startCallbacks starts the server of deliveries when callbacks are on;
// the returned function stops it.
func (w *Worker) startCallbacks() (stop func(), err error) {
	cfg := w.cfg.Callbacks
	if len(cfg.Allow) == 0 {
		return func() {}, nil
	}
	timeout := cfg.Timeout
	if timeout <= 0 {
		timeout = DefaultCallbackTimeout
	}
	concurrency := cfg.Concurrency
	if concurrency <= 0 {
		concurrency = DefaultCallbackConcurrency
	}
	server := asynq.NewServerFromRedisClient(w.rdb, asynq.Config{
		Concurrency:              concurrency,
		Queues:                   map[string]int{CallbackQueueName(w.cfg.KeyPrefix): 1},
		TaskCheckInterval:        200 * time.Millisecond,
		DelayedTaskCheckInterval: time.Second,
		ShutdownTimeout:          w.cfg.ShutdownTimeout,
		RetryDelayFunc:           callbackDelay,
		Logger:                   asynqLogger{w.log.With("queue", CallbackQueueName(w.cfg.KeyPrefix)), &w.health},
		LogLevel:                 asynq.WarnLevel,
	})
	client := &http.Client{Transport: w.cfg.Transport, Timeout: timeout,
		// A redirect could leave the allow-list.
		CheckRedirect: func(*http.Request, []*http.Request) error { return http.ErrUseLastResponse }}
	if err := server.Start(w.deliver(client)); err != nil {
		return nil, fmt.Errorf("queue: start the callbacks' worker: %w", err)
	}
	return server.Shutdown, nil
}

// checkCallbackConfig checks a worker's callbacks: a valid allow-list and,
// with one, a secret to sign with.
func checkCallbackConfig(cfg CallbackConfig) error {
	if len(cfg.Allow) == 0 {
		return nil
	}
	if err := CheckCallbackAllow(cfg.Allow); err != nil {
		return fmt.Errorf("queue: callbacks: allow: %w", err)
	}
	if cfg.Secret == "" {
		return errors.New("queue: callbacks: a secret is needed to sign them ([callbacks] secret, e.g. secret = \"${SHAPER_CALLBACK_SECRET}\")")
	}
	return nil
}
