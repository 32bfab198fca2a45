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
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
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

// CallbackConfig is the [callbacks] table. A callback may name a URL
// under one of its prefixes (Prefixes: scheme, host and port exactly,
// then a path prefix): no callback goes to a host it does not name, and
// with none, callbacks are refused at enqueue.
type CallbackConfig struct {
	// Allow lists prefixes whose deliveries are signed with Secret.
	Allow []string
	// Secret keys the HMAC-SHA256 signature of deliveries under Allow's
	// prefixes, the default (workers only; enqueueing needs none).
	Secret string
	// Receivers are prefixes with a secret of their own: a receiver can
	// verify its deliveries but not sign another's.
	Receivers   []CallbackReceiver
	Timeout     time.Duration // one delivery attempt; default 10s
	Attempts    int           // delivery attempts before the callback is archived; default 20
	Concurrency int           // deliveries at once per worker; default 20
}

// CallbackReceiver is a URL prefix whose deliveries are signed with a
// secret of its own.
type CallbackReceiver struct {
	Prefix string
	Secret string
}

// Prefixes returns every prefix a callback may name: Allow's and the
// receivers'.
func (c CallbackConfig) Prefixes() []string {
	out := slices.Clone(c.Allow)
	for _, r := range c.Receivers {
		out = append(out, r.Prefix)
	}
	return out
}

// secretFor returns the secret that signs a delivery to u: that of the
// longest prefix u is under, a receiver's own or, for an Allow prefix,
// Secret (a receiver's, when one has the same prefix as Allow); ok is
// false when u is under none.
func (c CallbackConfig) secretFor(u *url.URL) (secret string, ok bool) {
	if plainPath(u) != nil {
		return "", false
	}
	best := -1
	for _, a := range c.Allow {
		if n, under := underPrefix(a, u); under && n > best {
			best, secret = n, c.Secret
		}
	}
	for _, r := range c.Receivers {
		if n, under := underPrefix(r.Prefix, u); under && n >= best {
			best, secret = n, r.Secret
		}
	}
	return secret, best >= 0
}

// ErrCallbackNotAllowed is returned for a callback URL outside
// CallbackConfig.Allow.
var ErrCallbackNotAllowed = errors.New("queue: callback URL not allowed")

// checkCallbackURL checks that raw is an absolute http(s) URL.
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
		if err := plainPath(u); err != nil {
			return fmt.Errorf("callback url %q: %w", a, err)
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
		return fmt.Errorf("%w: %w", ErrBadCall, err)
	}
	if err := plainPath(u); err != nil {
		return fmt.Errorf("%w: %w: callback url %q: %w; it must stay under a prefix of [callbacks] allow (%s)",
			ErrBadCall, ErrCallbackNotAllowed, cb.URL, err, strings.Join(allow, ", "))
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
	// (CallResult: 512 bytes, with header and query values redacted).
	Body     string `json:"body,omitempty"`
	Error    string `json:"error,omitempty"`
	Attempts int    `json:"attempts"` // vendor calls made, the last one included (waits and 429s aside)
	// EnqueuedAt is when the call was queued (by the enqueuer's clock;
	// absent for a call queued before shaper stamped it).
	EnqueuedAt time.Time `json:"enqueued_at,omitzero"`
	// SentAt is when the last attempt's request went out to the vendor
	// (its headers written, after the wait for its tick; absent when no
	// answer came: a timeout, a refused connection).
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
	o := Outcome{ID: id, Vendor: vendor, Account: call.Account, State: "completed", Status: res.Status, Body: res.BodyExcerpt(excerptBytes),
		Attempts: n + 1, EnqueuedAt: enqueuedAt(t), SentAt: res.SentAt, FinishedAt: time.Now().UTC()}
	if err != nil {
		o.State, o.Error = "archived", err.Error()
	}
	body, _ := json.Marshal(o)
	payload, _ := json.Marshal(callbackTask{URL: call.Callback.URL, Body: body})
	attempts := w.callbackConfig().Attempts
	if attempts <= 0 {
		attempts = DefaultCallbackAttempts
	}
	ctx = context.WithoutCancel(ctx)
	delivery := traced(ctx, asynq.NewTask(TypeCallback, payload), &w.stamps) // the delivery joins the call's trace
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
			w.log.Error("could not queue a call's callback: it is not delivered", "vendor", vendor, "task", id, "url", safeURL(call.Callback.URL), "err", e)
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
// by asynq (callbackDelay) until it is answered 2xx. Each attempt reads
// the callbacks in force (a reload changes them): a URL no longer under
// any prefix is archived unsent, and the secret is its receiver's now.
func (w *Worker) deliver(ctx context.Context, t *asynq.Task) error {
	defer w.health.await(ctx, awaitRedis)
	cfg := w.callbackConfig()
	var ct callbackTask
	if err := json.Unmarshal(t.Payload(), &ct); err != nil {
		return fmt.Errorf("malformed callback payload: %w: %w", err, asynq.SkipRetry)
	}
	// What the delivery leaves behind (its error, the log) names the URL
	// without its query, which may hold the receiver's key.
	err := w.deliverTo(ctx, t, cfg, ct)
	if err != nil {
		err = redactedError{safeError(err), querySecrets(ct.URL)}
	}
	return err
}

func (w *Worker) deliverTo(ctx context.Context, t *asynq.Task, cfg CallbackConfig, ct callbackTask) error {
	// The worker checks too: a task queued by an older config, or not
	// through a Client, goes nowhere its own prefixes do not name.
	u, err := checkCallbackURL(ct.URL)
	if err != nil {
		return fmt.Errorf("%w: %w", err, asynq.SkipRetry)
	}
	if err := plainPath(u); err != nil {
		return fmt.Errorf("%w: %s: %w: not sent: %w", ErrCallbackNotAllowed, safeURL(ct.URL), err, asynq.SkipRetry)
	}
	secret, ok := cfg.secretFor(u)
	switch {
	case !ok && len(cfg.Prefixes()) == 0:
		return fmt.Errorf("%w: %s: callbacks are off in this worker's [callbacks]: not sent: %w", ErrCallbackNotAllowed, safeURL(ct.URL), asynq.SkipRetry)
	case !ok:
		return fmt.Errorf("%w: %s is not under any prefix of this worker's [callbacks] (%s): not sent: %w",
			ErrCallbackNotAllowed, safeURL(ct.URL), strings.Join(cfg.Prefixes(), ", "), asynq.SkipRetry)
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
	req.Header.Set(SignatureHeader, Sign(secret, time.Now(), ct.Body))
	ctx, span := w.deliverySpan(ctx, t, req)
	defer span.End()
	timeout := cfg.Timeout
	if timeout <= 0 {
		timeout = DefaultCallbackTimeout
	}
	client := &http.Client{Transport: w.cfg.Transport, Timeout: timeout,
		// A redirect could leave the allow-list.
		CheckRedirect: func(*http.Request, []*http.Request) error { return http.ErrUseLastResponse }}
	resp, err := client.Do(req.WithContext(ctx))
	if err != nil {
		err = safeError(err)
		span.RecordError(err)
		span.SetStatus(codes.Error, err.Error())
		return fmt.Errorf("callback %s: %w", safeURL(ct.URL), err)
	}
	span.SetAttributes(attribute.Int("http.response.status_code", resp.StatusCode))
	excerpt := readExcerpt(resp.Body, 256, querySecrets(ct.URL))
	_, _ = io.Copy(io.Discard, io.LimitReader(resp.Body, 1<<20))
	resp.Body.Close()
	if resp.StatusCode < 200 || resp.StatusCode > 299 {
		span.SetStatus(codes.Error, "HTTP "+strconv.Itoa(resp.StatusCode))
		return fmt.Errorf("callback %s: HTTP %d: %s", safeURL(ct.URL), resp.StatusCode, excerpt)
	}
	return nil
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
		trace.WithAttributes(attribute.String("http.request.method", http.MethodPost), attribute.String("url.full", safeURL(req.URL.String())), attrRetry.Int(n)))
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

// callbackState is a worker's callbacks: the config in force, which a
// reload replaces (ApplyCallbacks), and the server of deliveries, which
// runs from the start of Run, or from the reload that turns callbacks on,
// until Run returns.
type callbackState struct {
	cfg     atomic.Pointer[CallbackConfig] // nil: WorkerConfig.Callbacks
	mu      sync.Mutex                     // guards running and server, and orders Apply
	running bool                           // Run is between startCallbacks and its stop
	server  *asynq.Server
}

// callbackConfig returns the callbacks in force.
func (w *Worker) callbackConfig() CallbackConfig {
	if c := w.callbacks.cfg.Load(); c != nil {
		return *c
	}
	return w.cfg.Callbacks
}

// startCallbacks starts the server of deliveries when callbacks are on;
// the returned function stops it (Run's, when it returns).
func (w *Worker) startCallbacks() (stop func(), err error) {
	s := &w.callbacks
	s.mu.Lock()
	defer s.mu.Unlock()
	if err := w.startDeliveriesLocked(); err != nil {
		return nil, err
	}
	s.running = true
	return func() {
		s.mu.Lock()
		server := s.server
		s.server, s.running = nil, false
		s.mu.Unlock()
		if server != nil {
			server.Shutdown()
		}
	}, nil
}

// startDeliveriesLocked starts the server of deliveries if callbacks are
// on and it is not running; callbacks.mu is held.
func (w *Worker) startDeliveriesLocked() error {
	cfg := w.callbackConfig()
	if w.callbacks.server != nil || len(cfg.Prefixes()) == 0 {
		return nil
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
	if err := server.Start(asynq.HandlerFunc(w.deliver)); err != nil {
		return fmt.Errorf("queue: start the callbacks' worker: %w", err)
	}
	w.callbacks.server = server
	return nil
}

// ApplyCallbacks brings the worker's callbacks to cfg (a config reload).
// Every delivery attempt from then on checks its URL against cfg's
// prefixes and is signed with cfg's secrets: a receiver removed from cfg
// receives nothing more (its queued deliveries are archived, with an
// error naming their URL, when they next come up), and one whose secret
// changed gets the new one. Callbacks turned on start the worker's
// deliveries; turned off, the worker archives the deliveries it meets. A
// change of concurrency applies when the worker restarts. It returns what
// changed, naming prefixes and never a secret; on error nothing changed.
func (w *Worker) ApplyCallbacks(cfg CallbackConfig) (notes []string, err error) {
	if err := checkCallbackConfig(cfg); err != nil {
		return nil, err
	}
	s := &w.callbacks
	s.mu.Lock()
	defer s.mu.Unlock()
	old := w.callbackConfig()
	notes = callbackChanges(old, cfg)
	cfg.Allow, cfg.Receivers = slices.Clone(cfg.Allow), slices.Clone(cfg.Receivers)
	prev := s.cfg.Load()
	s.cfg.Store(&cfg)
	if s.running {
		if err := w.startDeliveriesLocked(); err != nil {
			s.cfg.Store(prev) // the last good [callbacks] stay in force
			return nil, err
		}
	}
	return notes, nil
}

// callbackChanges says what changed from old to cfg, in the words of the
// config's keys, naming prefixes and never secrets.
func callbackChanges(old, cfg CallbackConfig) []string {
	var notes []string
	on, wasOn := len(cfg.Prefixes()) > 0, len(old.Prefixes()) > 0
	switch {
	case on && !wasOn:
		notes = append(notes, "callbacks turned on: this worker delivers them")
	case !on && wasOn:
		notes = append(notes, "callbacks turned off: deliveries still queued are archived unsent when they come up")
	}
	for _, a := range cfg.Allow {
		if !slices.Contains(old.Allow, a) {
			notes = append(notes, "callbacks: allow "+a+" added")
		}
	}
	for _, a := range old.Allow {
		if !slices.Contains(cfg.Allow, a) {
			notes = append(notes, "callbacks: allow "+a+" removed: deliveries under it only are archived unsent from now on")
		}
	}
	if cfg.Secret != old.Secret && len(cfg.Allow) > 0 && len(old.Allow) > 0 {
		notes = append(notes, "callbacks: the secret changed: deliveries under allow are signed with the new one from now on")
	}
	secrets := func(rs []CallbackReceiver) map[string]string {
		m := map[string]string{}
		for _, r := range rs {
			m[r.Prefix] = r.Secret
		}
		return m
	}
	now, before := secrets(cfg.Receivers), secrets(old.Receivers)
	for _, r := range cfg.Receivers {
		switch secret, ok := before[r.Prefix]; {
		case !ok:
			notes = append(notes, "callbacks: receiver "+r.Prefix+" added, with its own secret")
		case secret != r.Secret:
			notes = append(notes, "callbacks: receiver "+r.Prefix+": its secret changed: its deliveries are signed with the new one from now on")
		}
	}
	for _, r := range old.Receivers {
		if _, ok := now[r.Prefix]; !ok {
			notes = append(notes, "callbacks: receiver "+r.Prefix+" removed: deliveries under it only are archived unsent from now on")
		}
	}
	if cfg.Timeout != old.Timeout {
		notes = append(notes, fmt.Sprintf("callbacks: timeout %s -> %s", old.Timeout, cfg.Timeout))
	}
	if cfg.Attempts != old.Attempts {
		notes = append(notes, fmt.Sprintf("callbacks: attempts %d -> %d, for callbacks queued from now on", old.Attempts, cfg.Attempts))
	}
	if cfg.Concurrency != old.Concurrency {
		notes = append(notes, fmt.Sprintf("callbacks: concurrency %d -> %d applies when the worker restarts", old.Concurrency, cfg.Concurrency))
	}
	return notes
}

// checkCallbackConfig checks a worker's callbacks: valid prefixes, a
// secret for each receiver, and, with an allow-list, the secret that signs
// its deliveries.
func checkCallbackConfig(cfg CallbackConfig) error {
	if len(cfg.Prefixes()) == 0 {
		return nil
	}
	if err := CheckCallbackAllow(cfg.Allow); err != nil {
		return fmt.Errorf("queue: callbacks: allow: %w", err)
	}
	seen := map[string]bool{}
	for i, r := range cfg.Receivers {
		if err := CheckCallbackAllow([]string{r.Prefix}); err != nil {
			return fmt.Errorf("queue: callbacks: receiver %d: %w", i+1, err)
		}
		if seen[r.Prefix] {
			return fmt.Errorf("queue: callbacks: receiver %d: %s is another receiver's prefix too; give each prefix one secret", i+1, r.Prefix)
		}
		seen[r.Prefix] = true
		if r.Secret == "" {
			return fmt.Errorf("queue: callbacks: receiver %s: a secret is needed to sign its callbacks", r.Prefix)
		}
	}
	if len(cfg.Allow) > 0 && cfg.Secret == "" {
		return errors.New("queue: callbacks: a secret is needed to sign them ([callbacks] secret, e.g. secret = \"${SHAPER_CALLBACK_SECRET}\")")
	}
	return nil
}
