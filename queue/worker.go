package queue

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"net/http"
	"sync"
	"sync/atomic"
	"time"

	"github.com/hibiken/asynq"
	"github.com/redis/go-redis/v9"
	"go.opentelemetry.io/otel/trace"

	"github.com/shaper-dev/shaper/internal/gatehook"
	"github.com/shaper-dev/shaper/shaper"
	"github.com/shaper-dev/shaper/vendorclients"
)

// Worker defaults.
const (
	DefaultMaxWait         = 5 * time.Second
	DefaultShutdownTimeout = 10 * time.Second
)

// ErrStopped is returned by Run and Apply once Run has returned.
var ErrStopped = errors.New("queue: the worker has stopped")

// WorkerConfig configures a Worker.
type WorkerConfig struct {
	Vendors []Vendor
	// MaxWait is the longest a task holds a goroutine waiting for its
	// tick; a longer wait (a pause, a long backlog) sends it back to the
	// queue and pauses the vendor's asynq queue until the wait is nearly
	// over. Default 5s.
	MaxWait time.Duration
	// ShutdownTimeout is how long shutdown lets calls in flight finish;
	// the rest go back to the queue. Default 10s.
	ShutdownTimeout time.Duration
	Retention       time.Duration // how long finished calls are kept; default 24h
	KeyPrefix       string        // default "shaper"
	Logger          *slog.Logger
	// Transport is the base HTTP transport; default a pooled one.
	Transport http.RoundTripper
	// Observer is told of calls started and rate-limited answers
	// (metrics); optional.
	Observer vendorclients.Observer
	// RetryBackoff is the delay before retry n (1-based) of a failed call
	// (5xx, 408, timeout); default asynq's exponential backoff with jitter.
	RetryBackoff func(n int) time.Duration
	// TracerProvider makes the spans of each task's run (trace.go);
	// default the global one, a no-op unless a program installed one.
	TracerProvider trace.TracerProvider
	// Callbacks delivers the outcome of calls that name a callback URL
	// (see callback.go); off while Allow is empty.
	Callbacks CallbackConfig
}

// HandlerFunc handles a user task on a vendor's queue. Every request sent
// through vendor passes the vendor's gate.
type HandlerFunc func(ctx context.Context, t *asynq.Task, vendor *vendorclients.Client) error

// vendorRuntime is one vendor in a running worker.
type vendorRuntime struct {
	vendor Vendor // as it was made: its name and endpoint never change (see applied)
	// applied is the vendor as last applied (Apply's policy, per-account
	// shape and total), an immutable snapshot: a reload publishes a new
	// one while the vendor's goroutines read the last.
	applied atomic.Pointer[Vendor]
	secrets []string // header values to redact from results and errors
	queue   string   // the normal lane's asynq queue
	high    string   // the high lane's
	client  *vendorclients.Client
	shape   atomic.Pointer[accountShape] // per-account vendors: how each account is shaped
	// pausedHere: this process paused the vendor's asynq queue (or found
	// it paused by a replica), and its supervisor watches for the moment
	// to unpause it.
	pausedHere atomic.Bool
	// While the vendor's queue has work (see demand.go): its server, the
	// end of its supervisor, and the supervisor's end. Run's goroutine
	// alone starts and stops them.
	server     *asynq.Server
	highServer *asynq.Server // the high lane's
	stop       context.CancelFunc
	done       chan struct{}
}

// highConcurrency is the high lane's worker budget beside a normal one:
// an eighth of it, at least 4. High calls are the few that must not wait
// behind a backlog; more of them at once wait at the gate anyway.
func highConcurrency(normal int) int { return max(4, normal/8) }

// bucket is the vendor's current gate bucket (it changes on reload); for a
// per-account vendor it reads the vendor's group-wide stats.
func (rt *vendorRuntime) bucket() *shaper.Bucket { return rt.client.Bucket() }

// accountShape is how a per-account vendor shapes each account: a group
// (with the vendor's total, if any) and the accounts' policies.
type accountShape struct {
	group     *shaper.Group
	policy    shaper.Policy
	overrides map[string]shaper.Policy
}

// shapeOf builds v's account shape, checking every policy; nil for a
// vendor that is not per-account.
func (w *Worker) shapeOf(v Vendor) (*accountShape, error) {
	if !v.PerAccount {
		return nil, nil
	}
	group, err := w.gate.Group(bucketName(v.Name), v.Total)
	if err != nil {
		return nil, fmt.Errorf("queue: vendor %s: %w", v.Name, err)
	}
	if err := v.Policy.Validate(); err != nil {
		return nil, fmt.Errorf("queue: vendor %s: %w", v.Name, err)
	}
	for account, p := range v.Overrides {
		if err := p.Validate(); err != nil {
			return nil, fmt.Errorf("queue: vendor %s, account %s: %w", v.Name, account, err)
		}
	}
	return &accountShape{group: group, policy: v.Policy, overrides: v.Overrides}, nil
}

// clientFor returns the client of one call: the vendor's, or for a
// per-account vendor one of the account, shaped by the account's bucket.
// Handles are made per call: nothing is kept per account.
func (rt *vendorRuntime) clientFor(account string) (*vendorclients.Client, error) {
	sh := rt.shape.Load()
	switch {
	case sh == nil && account == "":
		return rt.client, nil
	case sh == nil:
		return nil, fmt.Errorf("vendor %s is not per-account, and the task names account %q: %w", rt.vendor.Name, account, asynq.SkipRetry)
	case account == "":
		return nil, fmt.Errorf("vendor %s is per-account, and the task names no account: %w", rt.vendor.Name, asynq.SkipRetry)
	}
	b, err := sh.group.Bucket(account, accountPolicy(sh.policy, sh.overrides, account))
	if err != nil {
		return nil, fmt.Errorf("%w: %w", err, asynq.SkipRetry)
	}
	c, err := rt.client.ForAccount(account, b)
	if err != nil {
		return nil, fmt.Errorf("%w: %w", err, asynq.SkipRetry)
	}
	return c, nil
}

// Worker runs the tasks of every configured vendor: one asynq.Server per
// vendor with work, on one shared Redis client. Run it once; Apply changes its vendors
// while it runs.
type Worker struct {
	rdb  redis.UniversalClient
	cfg  WorkerConfig
	gate *shaper.Gate
	live *liveness // the live workers, this one among them (alive.go)
	// stamps are the enqueue stamps of the callback deliveries it queues.
	stamps stamper
	insp   *asynq.Inspector
	aq     *asynq.Client // queues callback deliveries
	log    *slog.Logger
	// transport is the HTTP transport NewWorker made (nil when the
	// config gave one): Run closes its idle connections when it returns.
	transport *http.Transport
	// health is whether Redis answers, from Run's pings.
	health redisHealth
	// callbacks are the [callbacks] in force and their deliveries' server
	// (callback.go).
	callbacks callbackState

	applyMu  sync.Mutex          // one Apply at a time
	applyc   chan applyRequest   // to Run's loop while it runs
	idlec    chan *vendorRuntime // supervisors to Run: this vendor's queue has been idle
	recheckc chan *vendorRuntime // a server stopped: look at its queue again
	serving  atomic.Int64        // vendors with a running server
	// idleStopAfter and sweepEvery; tests shorten them.
	idleStop, sweepEvery time.Duration
	stopped              chan struct{} // closed when Run stops serving

	mu       sync.Mutex
	state    workerState
	vendors  map[string]*vendorRuntime
	handlers map[string]HandlerFunc // task type -> handler, for every vendor
}

type workerState int

const (
	notStarted workerState = iota
	running
	stopped
)

type applyRequest struct {
	plan  *plan
	reply chan error
}

// NewWorker returns a worker for cfg.Vendors on rdb; it never closes rdb.
func NewWorker(rdb redis.UniversalClient, cfg WorkerConfig) (*Worker, error) {
	if err := checkAsynq(); err != nil {
		return nil, err
	}
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
	if err := checkCallbackConfig(cfg.Callbacks); err != nil {
		return nil, err
	}
	var own *http.Transport
	if cfg.Transport == nil {
		own = &http.Transport{
			Proxy:               http.ProxyFromEnvironment,
			DialContext:         (&net.Dialer{Timeout: 10 * time.Second, KeepAlive: 30 * time.Second}).DialContext,
			MaxIdleConns:        1000,
			MaxIdleConnsPerHost: 256,
			IdleConnTimeout:     90 * time.Second,
			TLSHandshakeTimeout: 10 * time.Second,
			ForceAttemptHTTP2:   true,
		}
		cfg.Transport = own
	}
	w := &Worker{
		rdb: rdb, cfg: cfg, log: cfg.Logger, transport: own,
		gate:     shaper.NewGate(rdb, shaper.Config{KeyPrefix: cfg.KeyPrefix}),
		insp:     asynq.NewInspectorFromRedisClient(rdb),
		aq:       asynq.NewClientFromRedisClient(rdb),
		applyc:   make(chan applyRequest),
		idlec:    make(chan *vendorRuntime),
		recheckc: make(chan *vendorRuntime),
		idleStop: idleStopAfter, sweepEvery: sweepEvery,
		stopped:  make(chan struct{}),
		vendors:  map[string]*vendorRuntime{},
		handlers: map[string]HandlerFunc{},
	}
	w.health.log = w.log
	w.health.kept = newRedisKept(rdb, cfg.KeyPrefix, w.log)
	w.live = newLiveness(rdb, cfg.KeyPrefix, gatehook.Replica(w.gate))
	w.live.handled = w.advertised // with every heartbeat (handlers.go)
	for _, v := range cfg.Vendors {
		rt, err := w.newRuntime(v)
		if err != nil {
			return nil, err
		}
		w.vendors[v.Name] = rt
	}
	return w, nil
}

// vendorBucket is v's vendor-level bucket: the one a vendor's calls
// are shaped by, and for a per-account vendor the one its worker reads
// and clears its accounts' record of held calls through (recover), which
// it keeps in the group's set with theirs (gatehook.TagsInSet).
func vendorBucket(gate *shaper.Gate, v Vendor) (*shaper.Bucket, error) {
	b, err := gate.Bucket(bucketName(v.Name), v.Policy)
	if err != nil {
		return nil, fmt.Errorf("queue: vendor %s: %w", v.Name, err)
	}
	if v.PerAccount {
		gatehook.TagsInSet(b)
	}
	return b, nil
}

func (w *Worker) newRuntime(v Vendor) (*vendorRuntime, error) {
	bucket, err := vendorBucket(w.gate, v)
	if err != nil {
		return nil, err
	}
	client, err := vendorclients.New(v.Endpoint, bucket,
		vendorclients.Options{MaxWait: w.cfg.MaxWait, Base: w.cfg.Transport, Logger: w.log, Observer: w.cfg.Observer})
	if err != nil {
		return nil, fmt.Errorf("queue: %w", err)
	}
	sh, err := w.shapeOf(v)
	if err != nil {
		return nil, err
	}
	rt := &vendorRuntime{vendor: v, secrets: v.secrets(), queue: QueueName(v.Name), high: HighQueueName(v.Name), client: client}
	rt.applied.Store(&v)
	rt.shape.Store(sh)
	return rt, nil
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

// Serving returns how many vendors this worker serves now: those whose
// queues have work (an idle vendor has no server).
func (w *Worker) Serving() int { return int(w.serving.Load()) }

// AccountBacklogs returns, for each per-account vendor, how many of its
// accounts have calls planned ahead (see gatehook.Backlogs).
func (w *Worker) AccountBacklogs(ctx context.Context) (map[string]int64, error) {
	w.mu.Lock()
	groups := map[string]*shaper.Group{}
	for name, rt := range w.vendors {
		if sh := rt.shape.Load(); sh != nil {
			groups[name] = sh.group
		}
	}
	w.mu.Unlock()
	out := make(map[string]int64, len(groups))
	for name, g := range groups {
		_, n, err := gatehook.Backlogs(ctx, g, 0)
		if err != nil {
			return out, err
		}
		out[name] = n
	}
	return out, nil
}

// Handle registers the handler of tasks of taskType (enqueued with
// Client.EnqueueTask) on every vendor's queue, including vendors added
// later by Apply. It may be called at any time; the worker advertises
// the type to the others with its next heartbeat. A worker that takes a
// task whose type it has no handler for gives it back to its queue,
// without using a retry, while another worker serving the task's vendor
// advertised a handler for it within the last minute, and otherwise
// archives it at once with an error naming the type and the vendor.
func (w *Worker) Handle(taskType string, h HandlerFunc) error {
	switch {
	case taskType == TypeCall:
		return fmt.Errorf("queue: %s is the built-in call type", TypeCall)
	case taskType == "":
		return errors.New("queue: empty task type")
	case h == nil:
		return fmt.Errorf("queue: nil handler for %s", taskType)
	}
	w.mu.Lock()
	defer w.mu.Unlock()
	w.handlers[taskType] = h
	return nil
}

func (w *Worker) handler(taskType string) HandlerFunc {
	w.mu.Lock()
	defer w.mu.Unlock()
	return w.handlers[taskType]
}

// Run serves every vendor until ctx ends, then shuts down gracefully: calls
// in flight finish within ShutdownTimeout, the rest go back to the queue.
// A vendor's asynq server runs only while its queue holds work (see
// demand.go). Run returns once every goroutine it started has stopped. A
// worker runs once.
func (w *Worker) Run(ctx context.Context) error {
	w.mu.Lock()
	if w.state != notStarted {
		w.mu.Unlock()
		return fmt.Errorf("queue: Run called twice: %w", ErrStopped)
	}
	w.state = running
	w.mu.Unlock()

	stopCallbacks, err := w.startCallbacks()
	if err != nil {
		return err
	}
	defer stopCallbacks()
	var wg sync.WaitGroup
	wg.Go(func() { w.gate.Watch(ctx) })
	// The heartbeat lasts until every call has finished or gone back to
	// the queue (after the shutdown below): a worker finishing its calls
	// is not dead to the others.
	aliveCtx, stopAlive := context.WithCancel(context.WithoutCancel(ctx))
	defer stopAlive()
	wg.Go(func() { watchRedis(aliveCtx, w.live, &w.health) })
	wg.Go(func() { w.recoverDead(ctx) })
	problems := newProblemLog(w.log, &w.health)
	ww := &workWatch{}
	_, err = w.pollWork(ctx, ww) // the baseline, before the first sweep
	problems.check("reading the work signals", err)
	problems.check("looking for vendors with work", w.sweep(ctx, w.runtimes(nil)))
	poll := time.NewTicker(workPollEvery)
	defer poll.Stop()
	sweep := time.NewTicker(w.sweepEvery)
	defer sweep.Stop()
	for {
		select {
		case req := <-w.applyc:
			removed, err := w.commit(req.plan)
			wg.Go(func() { w.shutdown(removed) }) // Run waits for them below
			req.reply <- err
			if err == nil {
				problems.check("looking for vendors with work", w.sweep(ctx, req.plan.added))
				w.respace(ctx, req.plan.respace)
				w.respaceAccounts(ctx, req.plan.reshaped)
			}
			continue
		case <-poll.C:
			moved, err := w.pollWork(ctx, ww)
			problems.check("reading the work signals", err)
			if len(moved) > 0 {
				for _, rt := range w.runtimes(moved) {
					w.ensure(ctx, rt)
				}
			}
			continue
		case <-sweep.C:
			problems.check("looking for vendors with work", w.sweep(ctx, w.runtimes(nil)))
			continue
		case rt := <-w.idlec:
			if w.current(rt) && rt.server != nil {
				stopped := w.detach(rt)
				wg.Go(func() {
					stopped()
					select { // work may have come during the stop
					case w.recheckc <- rt:
					case <-ctx.Done():
					}
				})
			}
			continue
		case rt := <-w.recheckc:
			if w.current(rt) {
				problems.check("looking for vendors with work", w.sweep(ctx, []*vendorRuntime{rt}))
			}
			continue
		case <-ctx.Done():
		}
		break
	}
	w.log.Info("shutting down: calls in flight finish, the rest go back to the queue", "timeout", w.cfg.ShutdownTimeout)
	w.mu.Lock()
	w.state = stopped
	close(w.stopped)
	w.mu.Unlock()
	w.shutdown(w.runtimes(nil))
	stopAlive()
	wg.Wait()
	if w.transport != nil {
		w.transport.CloseIdleConnections() // their goroutines end with Run
	}
	return nil
}

// respace makes changed ticks what the vendors see at once: the ticks
// reserved at the old spacing are dropped by every replica's gate and
// asked for again (see shaper.Control.Respace).
func (w *Worker) respace(ctx context.Context, buckets []*shaper.Bucket) {
	for _, b := range buckets {
		if err := b.Control().Respace(ctx); err != nil {
			w.log.Warn("could not respace a vendor's reserved ticks after a rate change; they go out at the old spacing", "vendor", b.Name(), "err", err)
		}
	}
}

// respaceAccounts respaces, for each per-account vendor reshaped, the
// accounts with calls in flight in this process whose tick changed (each
// replica does its own; idle accounts have no ticks reserved).
func (w *Worker) respaceAccounts(ctx context.Context, reshaped [][2]*accountShape) {
	for _, pair := range reshaped {
		old, cur := pair[0], pair[1]
		var bs []*shaper.Bucket
		for _, account := range gatehook.ActiveIn(w.gate, cur.group.Name()) {
			np := accountPolicy(cur.policy, cur.overrides, account)
			oldIv, oldBurst := accountPolicy(old.policy, old.overrides, account).Tick()
			if iv, burst := np.Tick(); iv == oldIv && burst == oldBurst {
				continue
			}
			b, err := cur.group.Bucket(account, np)
			if err != nil {
				w.log.Warn("could not respace an account after a rate change", "vendor", cur.group.Name(), "account", account, "err", err)
				continue
			}
			bs = append(bs, b)
		}
		w.respace(ctx, bs)
	}
}

// current reports whether rt is still one of the worker's vendors.
func (w *Worker) current(rt *vendorRuntime) bool {
	w.mu.Lock()
	defer w.mu.Unlock()
	return w.vendors[rt.vendor.Name] == rt
}

// start starts a vendor's asynq server and supervisor, on Run's goroutine.
func (w *Worker) start(ctx context.Context, rt *vendorRuntime) error {
	// Two servers: the normal lane's, and the high lane's with a budget of
	// its own, so that a high call is picked up at once however many
	// normal ones this process holds, and so that the normal server
	// dequeues from one queue (asynq polls each queue of a server in
	// turn: a second queue would cost every dequeue a round trip).
	v := rt.applied.Load()
	config := func(queue string, concurrency int) asynq.Config {
		return asynq.Config{
			Concurrency:              concurrency,
			Queues:                   map[string]int{queue: 1},
			TaskCheckInterval:        100 * time.Millisecond,
			DelayedTaskCheckInterval: v.forwardEvery(),
			ShutdownTimeout:          w.cfg.ShutdownTimeout,
			IsFailure:                isFailure,
			RetryDelayFunc:           w.retryDelay,
			Logger:                   asynqLogger{w.log.With("vendor", rt.vendor.Name), &w.health},
			LogLevel:                 asynq.WarnLevel,
		}
	}
	server := asynq.NewServerFromRedisClient(w.rdb, config(rt.queue, v.concurrency()))
	if err := server.Start(w.handle(rt)); err != nil {
		return fmt.Errorf("queue: start the worker of vendor %s: %w", rt.vendor.Name, err)
	}
	high := asynq.NewServerFromRedisClient(w.rdb, config(rt.high, highConcurrency(v.concurrency())))
	if err := high.Start(w.handle(rt)); err != nil {
		server.Shutdown()
		return fmt.Errorf("queue: start the high lane's worker of vendor %s: %w", rt.vendor.Name, err)
	}
	sctx, cancel := context.WithCancel(ctx)
	done := make(chan struct{})
	rt.server, rt.highServer, rt.stop, rt.done = server, high, cancel, done
	w.serving.Add(1)
	go func() {
		defer close(done)
		w.supervise(sctx, rt)
	}()
	w.log.Debug("serving vendor: its queue has work", "vendor", rt.vendor.Name, "queue", rt.queue, "concurrency", v.concurrency())
	return nil
}

// detach takes rt's server and supervisor off it, on Run's goroutine, and
// returns the function that stops them and waits.
func (w *Worker) detach(rt *vendorRuntime) (stop func()) {
	server, high, cancel, done := rt.server, rt.highServer, rt.stop, rt.done
	rt.server, rt.highServer, rt.stop, rt.done = nil, nil, nil, nil
	w.serving.Add(-1)
	return func() {
		cancel()
		var wg sync.WaitGroup
		wg.Go(server.Shutdown)
		wg.Go(high.Shutdown)
		wg.Wait()
		<-done
	}
}

// shutdown stops the vendors' supervisors and servers, in parallel, and
// waits for them.
func (w *Worker) shutdown(rts []*vendorRuntime) {
	var wg sync.WaitGroup
	for _, rt := range rts {
		if rt.server == nil {
			continue
		}
		wg.Go(w.detach(rt))
	}
	wg.Wait()
}
