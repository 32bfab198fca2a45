package queue

import (
	"bytes"
	"context"
	"crypto/rand"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"maps"
	"math"
	"net"
	"net/http"
	"os"
	"strings"
	"sync"
	"time"

	"github.com/hibiken/asynq"
	"github.com/redis/go-redis/v9"

	"github.com/shaper-dev/shaper/shaper"
	"github.com/shaper-dev/shaper/vendorclients"
)

// Worker defaults.
const (
	DefaultMaxWait         = 5 * time.Second
	DefaultShutdownTimeout = 10 * time.Second
	excerptBytes           = 512
	maxConcurrency         = 1000
)

// VendorSpec is what the worker needs to know of a vendor.
type VendorSpec struct {
	Name    string
	BaseURL string
	Policy  shaper.Policy
	Timeout time.Duration // per call; default 30s
	// Concurrency is the vendor's worker budget: tasks waiting for a tick
	// or calling at once in this process. 0 sizes it from the rate.
	Concurrency int
	// Headers (already expanded: secrets), UserAgent and MaxRetryAfter go
	// to the vendor's client.
	Headers       map[string]string
	UserAgent     string
	MaxRetryAfter time.Duration
}

// concurrency sizes a vendor's worker budget: enough goroutines to hold a
// horizon of reserved ticks plus the calls in flight, so that no tick is
// lost to slow pick-up.
func (v VendorSpec) concurrency() int {
	if v.Concurrency > 0 {
		return v.Concurrency
	}
	iv, burst := v.Policy.Tick()
	perSecond := float64(burst) * float64(time.Second) / float64(iv)
	timeout := v.Timeout
	if timeout <= 0 {
		timeout = vendorclients.DefaultTimeout
	}
	// A horizon of reserved ticks (1s) plus the calls in flight: each
	// replica alone can carry the full rate if the others die.
	hold := v.Policy.Horizon
	if hold <= 0 {
		hold = shaper.DefaultHorizon
	}
	hold += min(timeout, time.Second)
	n := int(math.Ceil(perSecond*hold.Seconds())) + burst
	return max(2, min(n, maxConcurrency))
}

// WorkerConfig configures a Worker.
type WorkerConfig struct {
	Vendors []VendorSpec
	// MaxWait is the longest a task holds a goroutine waiting for its
	// tick; a longer wait (a pause) sends it back to the queue and pauses
	// the vendor's asynq queue until the wait is nearly over. Default 5s.
	MaxWait time.Duration
	// ShutdownTimeout is how long shutdown lets calls in flight finish;
	// the rest go back to the queue. Default 10s.
	ShutdownTimeout time.Duration
	Retention       time.Duration // how long finished calls are kept; default 24h
	KeyPrefix       string        // default "shaper"
	Logger          *slog.Logger
	// Transport is the base HTTP transport; default a pooled one.
	Transport http.RoundTripper
	// Observer is told of releases and 429s (metrics); optional.
	Observer vendorclients.Observer
	// RetryBackoff is the delay before retry n (1-based) of a failed call
	// (5xx, 408, timeout); default asynq's exponential backoff with jitter.
	RetryBackoff func(n int) time.Duration
}

// HandlerFunc handles a user task bound to a vendor. Every request sent
// through vendor passes the vendor's gate.
type HandlerFunc func(ctx context.Context, t *asynq.Task, vendor *vendorclients.Client) error

type vendorRuntime struct {
	spec    VendorSpec
	secrets []string // header values to redact from results and errors
	queue   string
	client  *vendorclients.Client
	server  *asynq.Server
	heldKey string
	stop    context.CancelFunc // ends the vendor's supervisor
}

// bucket is the vendor's current gate bucket (it changes on reload).
func (rt *vendorRuntime) bucket() *shaper.Bucket { return rt.client.Bucket() }

// Worker runs the tasks of every configured vendor: one asynq.Server per
// vendor on one shared Redis client.
type Worker struct {
	mu       sync.Mutex
	runCtx   context.Context // set by Run
	wg       sync.WaitGroup
	replica  string // id in the gate's replica heartbeats
	rdb      redis.UniversalClient
	cfg      WorkerConfig
	gate     *shaper.Gate
	insp     *asynq.Inspector
	log      *slog.Logger
	vendors  map[string]*vendorRuntime
	handlers map[string]map[string]HandlerFunc // vendor -> type -> handler
}

// NewWorker returns a worker for cfg.Vendors on rdb; it never closes rdb.
func NewWorker(rdb redis.UniversalClient, cfg WorkerConfig) (*Worker, error) {
	if cfg.MaxWait <= 0 {
		cfg.MaxWait = DefaultMaxWait
	}
	if cfg.ShutdownTimeout <= 0 {
		cfg.ShutdownTimeout = DefaultShutdownTimeout
	}
	if cfg.Retention <= 0 {
		cfg.Retention = DefaultRetention
	}
	if cfg.KeyPrefix == "" {
		cfg.KeyPrefix = shaper.DefaultKeyPrefix
	}
	if cfg.Logger == nil {
		cfg.Logger = slog.Default()
	}
	if cfg.Transport == nil {
		cfg.Transport = &http.Transport{
			Proxy:               http.ProxyFromEnvironment,
			DialContext:         (&net.Dialer{Timeout: 10 * time.Second, KeepAlive: 30 * time.Second}).DialContext,
			MaxIdleConns:        1000,
			MaxIdleConnsPerHost: 256,
			IdleConnTimeout:     90 * time.Second,
			TLSHandshakeTimeout: 10 * time.Second,
			ForceAttemptHTTP2:   true,
		}
	}
	w := &Worker{
		rdb: rdb, cfg: cfg, log: cfg.Logger, replica: replicaID(),
		gate:     shaper.NewGate(rdb, shaper.Config{KeyPrefix: cfg.KeyPrefix}),
		insp:     asynq.NewInspectorFromRedisClient(rdb),
		vendors:  map[string]*vendorRuntime{},
		handlers: map[string]map[string]HandlerFunc{},
	}
	for _, spec := range cfg.Vendors {
		bucket, err := w.gate.Bucket(shaper.VendorBucket(spec.Name), spec.Policy)
		if err != nil {
			return nil, fmt.Errorf("queue: vendor %s: %w", spec.Name, err)
		}
		rt, err := w.newRuntime(spec, bucket)
		if err != nil {
			return nil, err
		}
		w.vendors[spec.Name] = rt
		w.handlers[spec.Name] = map[string]HandlerFunc{}
	}
	return w, nil
}

func (w *Worker) newRuntime(spec VendorSpec, bucket *shaper.Bucket) (*vendorRuntime, error) {
	client, err := vendorclients.New(vendorclients.Vendor{Name: spec.Name, BaseURL: spec.BaseURL, Timeout: spec.Timeout,
		Headers: spec.Headers, UserAgent: spec.UserAgent, MaxRetryAfter: spec.MaxRetryAfter},
		bucket, vendorclients.Options{MaxWait: w.cfg.MaxWait, Base: w.cfg.Transport, Logger: w.log, Observer: w.cfg.Observer})
	if err != nil {
		return nil, err
	}
	var secrets []string
	for _, v := range spec.Headers {
		if len(v) >= 4 {
			secrets = append(secrets, v)
			if _, token, ok := strings.Cut(v, " "); ok && len(token) >= 4 { // "Bearer <token>"
				secrets = append(secrets, token)
			}
		}
	}
	return &vendorRuntime{spec: spec, secrets: secrets, queue: QueueName(spec.Name), client: client,
		heldKey: w.cfg.KeyPrefix + ":{" + shaper.VendorBucket(spec.Name) + "}:held"}, nil
}

// Buckets returns the vendors' current gate buckets (for stats and
// metrics), by vendor name.
func (w *Worker) Buckets() map[string]*shaper.Bucket {
	w.mu.Lock()
	defer w.mu.Unlock()
	out := make(map[string]*shaper.Bucket, len(w.vendors))
	for name, rt := range w.vendors {
		out[name] = rt.bucket()
	}
	return out
}

// Handle registers a handler for tasks of taskType on vendor's queue
// (enqueued with Client.EnqueueTask). Call it before Run.
func (w *Worker) Handle(taskType, vendor string, h HandlerFunc) error {
	if taskType == TypeCall {
		return fmt.Errorf("queue: %s is the built-in call type", TypeCall)
	}
	if _, ok := w.vendors[vendor]; !ok {
		return fmt.Errorf("%w %q", ErrUnknownVendor, vendor)
	}
	w.handlers[vendor][taskType] = h
	return nil
}

// Run serves every vendor until ctx ends, then shuts down gracefully: calls
// in flight finish within ShutdownTimeout, the rest go back to the queue.
func (w *Worker) Run(ctx context.Context) error {
	w.mu.Lock()
	w.runCtx = ctx
	var started []*vendorRuntime
	for _, rt := range w.vendors {
		if err := w.start(ctx, rt); err != nil {
			w.mu.Unlock()
			for _, s := range started {
				s.stop()
				s.server.Shutdown()
			}
			return err
		}
		started = append(started, rt)
	}
	w.mu.Unlock()
	w.wg.Go(func() { w.gate.Watch(ctx) })
	<-ctx.Done()
	w.log.Info("shutting down: calls in flight finish, the rest go back to the queue", "timeout", w.cfg.ShutdownTimeout)
	w.mu.Lock()
	for _, rt := range w.vendors {
		w.wg.Go(func() { rt.server.Shutdown() })
	}
	w.mu.Unlock()
	w.wg.Wait()
	return nil
}

// start starts a vendor's asynq server and supervisor; w.mu is held.
func (w *Worker) start(ctx context.Context, rt *vendorRuntime) error {
	mux := asynq.NewServeMux()
	mux.HandleFunc(TypeCall, w.handleCall(rt))
	for typ, h := range w.handlers[rt.spec.Name] {
		mux.HandleFunc(typ, w.handleUser(rt, h))
	}
	rt.server = asynq.NewServerFromRedisClient(w.rdb, asynq.Config{
		Concurrency:              rt.spec.concurrency(),
		Queues:                   map[string]int{rt.queue: 1},
		TaskCheckInterval:        100 * time.Millisecond,
		DelayedTaskCheckInterval: time.Second,
		ShutdownTimeout:          w.cfg.ShutdownTimeout,
		IsFailure:                isFailure,
		RetryDelayFunc:           w.retryDelay,
		Logger:                   asynqLogger{w.log.With("vendor", rt.spec.Name)},
		LogLevel:                 asynq.WarnLevel,
	})
	if err := rt.server.Start(mux); err != nil {
		return fmt.Errorf("queue: start worker for %s: %w", rt.spec.Name, err)
	}
	sctx, cancel := context.WithCancel(ctx)
	rt.stop = cancel
	w.wg.Go(func() { w.supervise(sctx, rt) })
	w.log.Info("serving vendor", "vendor", rt.spec.Name, "queue", rt.queue, "concurrency", rt.spec.concurrency())
	return nil
}

// Apply brings a running worker to a new vendor list (a config reload): a
// changed rate, window, burst, guard or limit applies to the next release,
// with no burst (the next tick is the last one plus the new interval);
// added vendors start serving; removed ones stop taking calls (their
// queued calls stay in Redis). Changes to base_url, headers, timeouts and
// concurrency take effect when the worker restarts; Apply says so. It
// checks everything before changing anything.
func (w *Worker) Apply(specs []VendorSpec) (notes []string, err error) {
	buckets := map[string]*shaper.Bucket{}
	for _, spec := range specs {
		b, err := w.gate.Bucket(shaper.VendorBucket(spec.Name), spec.Policy)
		if err != nil {
			return nil, fmt.Errorf("queue: vendor %s: %w", spec.Name, err)
		}
		buckets[spec.Name] = b
	}
	w.mu.Lock()
	defer w.mu.Unlock()
	keep := map[string]bool{}
	for _, spec := range specs {
		keep[spec.Name] = true
		rt, ok := w.vendors[spec.Name]
		if !ok {
			nrt, err := w.newRuntime(spec, buckets[spec.Name])
			if err != nil {
				return notes, err
			}
			w.vendors[spec.Name] = nrt
			w.handlers[spec.Name] = map[string]HandlerFunc{}
			if w.runCtx != nil {
				if err := w.start(w.runCtx, nrt); err != nil {
					return notes, err
				}
			}
			notes = append(notes, fmt.Sprintf("vendor %s added", spec.Name))
			continue
		}
		oldIv, oldBurst := rt.bucket().Tick()
		newIv, newBurst := buckets[spec.Name].Tick()
		if oldIv != newIv || oldBurst != newBurst {
			notes = append(notes, fmt.Sprintf("vendor %s: release tick %d every %s -> %d every %s", spec.Name, oldBurst, oldIv, newBurst, newIv))
		}
		rt.client.SetBucket(buckets[spec.Name]) // the whole policy: limits, in-flight cap, adaptation
		if spec.BaseURL != rt.spec.BaseURL || spec.Timeout != rt.spec.Timeout || spec.Concurrency != rt.spec.Concurrency ||
			spec.UserAgent != rt.spec.UserAgent || !maps.Equal(spec.Headers, rt.spec.Headers) {
			notes = append(notes, fmt.Sprintf("vendor %s: base_url, headers, user_agent, timeout and concurrency changes apply when the worker restarts", spec.Name))
		}
		rt.spec.Policy = spec.Policy
	}
	for name, rt := range w.vendors {
		if keep[name] {
			continue
		}
		delete(w.vendors, name)
		if rt.server != nil {
			rt.stop()
			w.wg.Go(func() { rt.server.Shutdown() })
		}
		notes = append(notes, fmt.Sprintf("vendor %s removed: its worker stops; queued calls stay in Redis", name))
	}
	return notes, nil
}

// supervise unpauses the vendor's asynq queue when this worker (or
// another) held it for a long pause that is nearly over.
func (w *Worker) supervise(ctx context.Context, rt *vendorRuntime) {
	t := time.NewTicker(500 * time.Millisecond)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
		if err := rt.bucket().Heartbeat(ctx, w.replica); err != nil && ctx.Err() == nil {
			w.log.Warn("gate heartbeat failed", "vendor", rt.spec.Name, "err", err)
		}
		if rate, changed, err := rt.bucket().Recover(ctx); err == nil && changed {
			if rate == 0 {
				w.log.Info("vendor quiet: back to the configured rate", "vendor", rt.spec.Name)
			} else {
				w.log.Info("vendor quiet: effective rate raised", "vendor", rt.spec.Name, "rate", rate, "per", rt.spec.Policy.Limits[0].Window)
			}
		}
		held, err := w.rdb.Exists(ctx, rt.heldKey).Result()
		if err != nil || held == 0 {
			continue
		}
		st, err := rt.bucket().Stats(ctx)
		if err != nil || st.NextTick > w.cfg.MaxWait {
			continue
		}
		if n, err := w.rdb.Del(ctx, rt.heldKey).Result(); err == nil && n == 1 {
			if err := w.insp.UnpauseQueue(rt.queue); err != nil {
				w.log.Warn("could not unpause the vendor's queue", "vendor", rt.spec.Name, "err", err)
			} else {
				w.log.Info("vendor pause nearly over: queue unpaused", "vendor", rt.spec.Name)
			}
		}
	}
}

func replicaID() string {
	host, _ := os.Hostname()
	var b [4]byte
	_, _ = rand.Read(b[:])
	return fmt.Sprintf("%s:%d:%s", host, os.Getpid(), hex.EncodeToString(b[:]))
}

// hold pauses the vendor's asynq queue through a long wait, so that no
// replica dequeues tasks only to send them back.
func (w *Worker) hold(ctx context.Context, rt *vendorRuntime, wait time.Duration) {
	ok, err := w.rdb.SetNX(ctx, rt.heldKey, "1", wait+time.Minute).Result()
	if err != nil || !ok {
		return
	}
	if err := w.insp.PauseQueue(rt.queue); err != nil {
		w.log.Warn("could not pause the vendor's queue", "vendor", rt.spec.Name, "err", err)
		return
	}
	w.log.Info("vendor paused for longer than max wait: queue held", "vendor", rt.spec.Name, "wait", wait.Round(time.Second))
}

// deferError sends a task back to its queue for Wait without counting a
// failure: waiting and 429s never use up the retry budget.
type deferError struct{ Wait time.Duration }

func (e *deferError) Error() string {
	return fmt.Sprintf("waiting for the vendor's next release in %s", e.Wait.Round(time.Millisecond))
}

func isFailure(err error) bool {
	var d *deferError
	return !errors.As(err, &d)
}

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

// CallResult is stored as the task result of a call.
type CallResult struct {
	Status  int    `json:"status"`
	Excerpt string `json:"body_excerpt,omitempty"`
}

func (w *Worker) handleCall(rt *vendorRuntime) asynq.HandlerFunc {
	return func(ctx context.Context, t *asynq.Task) error {
		var call Call
		if err := json.Unmarshal(t.Payload(), &call); err != nil {
			return fmt.Errorf("malformed call payload: %v: %w", err, asynq.SkipRetry)
		}
		id, _ := asynq.GetTaskID(ctx)
		err := w.doCall(ctx, rt, t, id, call)
		w.markEnd(ctx, call.Export, id, err)
		return err
	}
}

func (w *Worker) handleUser(rt *vendorRuntime, h HandlerFunc) asynq.HandlerFunc {
	return func(ctx context.Context, t *asynq.Task) error {
		err := h(ctx, t, rt.client)
		if d := w.asDeferral(ctx, rt, err); d != nil {
			return d
		}
		return err
	}
}

// asDeferral turns a long wait or a rate-limited answer into a deferral:
// back to the queue without using a retry. Long waits also hold the
// vendor's asynq queue. It returns nil for other errors.
func (w *Worker) asDeferral(ctx context.Context, rt *vendorRuntime, err error) *deferError {
	var we *vendorclients.WaitError
	var rl *vendorclients.RateLimitedError
	switch {
	case errors.As(err, &we):
		w.hold(ctx, rt, we.Wait)
		return &deferError{Wait: we.Wait}
	case errors.As(err, &rl):
		return &deferError{Wait: max(rl.RetryAfter, time.Second)}
	}
	return nil
}

func (w *Worker) doCall(ctx context.Context, rt *vendorRuntime, t *asynq.Task, id string, call Call) error {
	for attempt := 1; ; attempt++ {
		var body io.Reader
		if len(call.Body) > 0 {
			body = bytes.NewReader(call.Body)
		}
		req, err := rt.client.NewRequest(ctx, call.Method, call.Path, body)
		if err != nil {
			return fmt.Errorf("%v: %w", err, asynq.SkipRetry)
		}
		for k, v := range call.Headers {
			req.Header.Set(k, v)
		}
		if len(call.Body) > 0 && req.Header.Get("Content-Type") == "" {
			req.Header.Set("Content-Type", "application/json")
		}
		req.Header.Set("Idempotency-Key", id)
		resp, err := rt.client.Do(req)
		var rl *vendorclients.RateLimitedError
		if errors.As(err, &rl) && attempt < 10 {
			// The vendor is paused for every replica: wait for the next
			// tick after the pause, in this goroutine while it is short.
			continue
		}
		if d := w.asDeferral(ctx, rt, err); d != nil {
			return d
		}
		if err != nil {
			if ctx.Err() != nil {
				return err
			}
			return fmt.Errorf("%s %s: %w", call.Method, call.Path, err)
		}
		excerpt, _ := io.ReadAll(io.LimitReader(resp.Body, excerptBytes))
		excerpt = redact(excerpt, rt.secrets)
		_, _ = io.Copy(io.Discard, io.LimitReader(resp.Body, 1<<20))
		resp.Body.Close()
		res, _ := json.Marshal(CallResult{Status: resp.StatusCode, Excerpt: string(excerpt)})
		if _, err := t.ResultWriter().Write(res); err != nil {
			w.log.Warn("could not store the call result", "vendor", rt.spec.Name, "task", id, "err", err)
		}
		switch {
		case resp.StatusCode >= 200 && resp.StatusCode < 300:
			return nil
		case resp.StatusCode == http.StatusRequestTimeout || resp.StatusCode >= 500:
			return fmt.Errorf("%s %s: HTTP %d: %s", call.Method, call.Path, resp.StatusCode, excerpt)
		default:
			return fmt.Errorf("%s %s: HTTP %d (not retried): %s: %w", call.Method, call.Path, resp.StatusCode, excerpt, asynq.SkipRetry)
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

// markEnd records the end of an export's call: done, or failed for good
// (not retried, or out of retries).
func (w *Worker) markEnd(ctx context.Context, export, id string, err error) {
	if export == "" || !isFailure(err) && err != nil {
		return
	}
	final := err == nil || errors.Is(err, asynq.SkipRetry)
	if !final {
		n, _ := asynq.GetRetryCount(ctx)
		maxRetry, _ := asynq.GetMaxRetry(ctx)
		final = n >= maxRetry
	}
	if !final {
		return
	}
	if e := markExport(context.WithoutCancel(ctx), w.rdb, w.cfg.KeyPrefix, export, id, err == nil, w.cfg.Retention+7*24*time.Hour); e != nil {
		w.log.Warn("could not record export progress", "export", export, "task", id, "err", e)
	}
}

// asynqLogger sends asynq's logs to slog.
type asynqLogger struct{ l *slog.Logger }

func (a asynqLogger) Debug(args ...any) { a.l.Debug(fmt.Sprint(args...)) }
func (a asynqLogger) Info(args ...any)  { a.l.Info(fmt.Sprint(args...)) }
func (a asynqLogger) Warn(args ...any)  { a.l.Warn(fmt.Sprint(args...)) }
func (a asynqLogger) Error(args ...any) { a.l.Error(fmt.Sprint(args...)) }
func (a asynqLogger) Fatal(args ...any) { a.l.Error(fmt.Sprint(args...)) }
