package main

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"net/http"
	"os"
	"os/signal"
	"strings"
	"sync"
	"syscall"
	"time"

	"github.com/redis/go-redis/v9"
	"github.com/spf13/cobra"

	"github.com/shaper-dev/shaper/config"
	"github.com/shaper-dev/shaper/internal/api"
	"github.com/shaper-dev/shaper/internal/httpguard"
	"github.com/shaper-dev/shaper/internal/metrics"
	"github.com/shaper-dev/shaper/internal/ui"
	"github.com/shaper-dev/shaper/queue"
	"github.com/shaper-dev/shaper/shaper"
)

func newWorkerCmd() *cobra.Command {
	var metricsAddr, uiAddr, apiAddr, apiToken string
	var allowEviction bool
	var page uiFlags
	cmd := &cobra.Command{
		Use:   "worker",
		Short: "Run the background worker until SIGINT or SIGTERM",
		Long: `Run the worker: one queue per vendor, calls started on each vendor's tick
shared by every worker on the same Redis. Run as many as you like, on one
machine or many. Edits to the config file (and SIGHUP) reload it: rates
apply within a second, added vendors start, removed ones stop, [callbacks]
apply to the next delivery (a removed receiver gets nothing more); an invalid
edit is logged and the last good config stays. On SIGINT/SIGTERM calls in
flight finish (within worker.shutdown_timeout) and the rest go back to the
queue.`,
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			token := page.tokenOrEnv()
			if uiAddr != "" {
				if err := ui.CheckAddr("--ui-addr", uiAddr, token); err != nil {
					return err
				}
			}
			if apiToken == "" {
				apiToken = os.Getenv("SHAPER_API_TOKEN")
			}
			if apiAddr != "" {
				if err := api.CheckAddr("--api-addr", apiAddr, apiToken); err != nil {
					return err
				}
			}
			cfg, err := loadConfig(cmd)
			if err != nil {
				return err
			}
			log := slog.New(slog.NewTextHandler(cmd.ErrOrStderr(), &slog.HandlerOptions{Level: slog.LevelInfo}))
			redis.SetLogger(redisLog{log})
			ctx, stop := signal.NotifyContext(cmd.Context(), os.Interrupt, syscall.SIGTERM)
			defer stop()
			stopTracing, err := startTracing(ctx, cfg.Tracing, log)
			if err != nil {
				return err
			}
			defer stopTracing() // last: the spans of the shutdown go too
			ctx, rdb, closeRedis, err := connect(ctx, cfg, true, log)
			if err != nil {
				return err
			}
			defer closeRedis()
			if !cfg.Redis.Embedded() {
				if err := checkEviction(ctx, rdb, allowEviction, log); err != nil {
					return err
				}
				checkPersistence(ctx, rdb, log)
			}
			wc, err := cfg.WorkerConfig()
			if err != nil {
				return err
			}
			// One log, one format: the worker's own lines and asynq's
			// (its servers log through the worker's logger) go to the
			// handler above, never to slog.Default's "2006/01/02 15:04:05 INFO"
			// lines.
			wc.Logger = log
			var w *queue.Worker
			var m *metrics.Metrics
			if metricsAddr != "" {
				qc := queue.NewClient(rdb, cfg.ClientConfig())
				defer qc.Close()
				// The metrics are the worker's Observer, so they exist
				// before it. Their bucket source reads w, which is set
				// below before the server starts: the go statement that
				// starts it publishes w to every scrape.
				m = metrics.New(workerRef{&w}, qc)
				wc.Observer = m
			}
			w, err = queue.NewWorker(rdb, wc)
			if err != nil {
				return err
			}
			if m != nil {
				stopMetrics, err := serveMetrics(metricsAddr, m.Handler(rdb), log)
				if err != nil {
					return err
				}
				defer stopMetrics() // after the worker has stopped: /healthz answers during the shutdown
			}
			applied := func(*config.Config) {}
			if uiAddr != "" {
				src := newPageSource(rdb, cfg)
				defer src.Close()
				stopPage, err := servePage(uiAddr, "--ui-addr", src, rdb, page, token, log)
				if err != nil {
					return err
				}
				defer stopPage()
				applied = src.SetConfig
			}
			if apiAddr != "" {
				qc := queue.NewClient(rdb, cfg.ClientConfig())
				defer qc.Close()
				stopAPI, err := startAPI(apiAddr, api.Options{Client: qc, Token: apiToken}, log)
				if err != nil {
					return err
				}
				defer stopAPI()
			}
			// SIGHUP asks for a reload; caught for the command's whole run,
			// so that a SIGHUP during the shutdown cannot end the process.
			hup := make(chan os.Signal, 1)
			signal.Notify(hup, syscall.SIGHUP)
			defer signal.Stop(hup)
			log.Info("worker started", "config", cfg.Path, "vendors", cfg.VendorNames())
			if err := runWorker(ctx, w, cfg, hup, applied, log); err != nil {
				return err
			}
			return embeddedGone(ctx)
		},
	}
	cmd.Flags().BoolVar(&allowEviction, "allow-eviction", false, "run even when Redis's maxmemory-policy may evict queued calls (allkeys-*)")
	cmd.Flags().StringVar(&uiAddr, "ui-addr", "", "serve the live page on this address (off by default; see shaper ui)")
	cmd.Flags().StringVar(&apiAddr, "api-addr", "", "serve the HTTP API on this address (off by default; see shaper serve)")
	cmd.Flags().StringVar(&apiToken, "api-token", "", "the API's token, required on a non-loopback --api-addr (default $SHAPER_API_TOKEN)")
	page.add(cmd)
	cmd.Flags().StringVar(&metricsAddr, "metrics-addr", "", "serve Prometheus /metrics and /healthz on this address (off by default; :0 picks a free port)")
	return cmd
}

// redisLog takes go-redis's own log lines (a failed dial, once per
// connection attempt) at debug level: during an outage the worker says
// once that Redis does not answer, and once that it answers again.
type redisLog struct{ l *slog.Logger }

func (r redisLog) Printf(_ context.Context, format string, v ...any) {
	r.l.Debug("redis client: " + fmt.Sprintf(format, v...))
}

// checkEviction refuses a Redis that may evict queued calls, unless
// allow, and warns about one that may evict the gate's state.
func checkEviction(ctx context.Context, rdb redis.UniversalClient, allow bool, log *slog.Logger) error {
	policy, err := queue.EvictionPolicy(ctx, rdb)
	switch {
	case errors.Is(err, queue.ErrEvictingRedis) && !allow:
		return err
	case errors.Is(err, queue.ErrEvictingRedis):
		log.Warn("--allow-eviction: running on a Redis that may evict queued calls when it is full", "maxmemory_policy", policy)
	case err != nil:
		log.Warn("cannot check Redis's eviction policy; make sure maxmemory-policy is noeviction", "err", err)
	case strings.HasPrefix(policy, "volatile-"):
		log.Warn("Redis may evict keys with an expiry when full: finished calls' results and gate state (which the gate recovers by waiting out its horizon); noeviction is safest", "maxmemory_policy", policy)
	}
	return nil
}

// runWorker runs w until ctx ends, with the config watch beside it, and
// returns once both have stopped. The watch stops first, and is waited
// for, before the worker shuts down: a reload never reaches a worker that
// is shutting down. If the worker fails to start, the watch stops too.
// runWorker runs w until ctx ends, applying config edits (applied hears
// of each one the worker took).
func runWorker(ctx context.Context, w *queue.Worker, cfg *config.Config, hup <-chan os.Signal, applied func(*config.Config), log *slog.Logger) error {
	watchCtx, stopWatch := context.WithCancel(ctx)
	defer stopWatch()
	var watch sync.WaitGroup
	reload := make(chan struct{})
	watch.Go(func() { forwardReloads(watchCtx, hup, reload, log) })
	watch.Go(func() { watchConfig(watchCtx, w, cfg, reload, applied, log) })

	runCtx, stopRun := context.WithCancel(context.WithoutCancel(ctx))
	defer stopRun()
	var run sync.WaitGroup
	var runErr error
	run.Go(func() {
		runErr = w.Run(runCtx)
		stopWatch() // Run returns early only when the worker cannot start
	})
	<-watchCtx.Done()
	watch.Wait()
	stopRun()
	run.Wait()
	return runErr
}

// forwardReloads turns each signal from hup into a reload request for the
// config watch, until ctx ends.
func forwardReloads(ctx context.Context, hup <-chan os.Signal, reload chan<- struct{}, log *slog.Logger) {
	for {
		select {
		case <-ctx.Done():
			return
		case <-hup:
			log.Info("SIGHUP: reloading the config file")
			select {
			case reload <- struct{}{}:
			case <-ctx.Done():
				return
			}
		}
	}
}

// watchConfig applies edits of the config file (and reload requests) to
// the running worker until ctx ends.
func watchConfig(ctx context.Context, w *queue.Worker, cfg *config.Config, reload <-chan struct{}, applied func(*config.Config), log *slog.Logger) {
	apply := func(next *config.Config) {
		if next.Redis != cfg.Redis {
			log.Warn("redis settings changed in the config; they apply when the worker restarts")
		}
		nwc, err := next.WorkerConfig()
		if err != nil {
			log.Error("config reload rejected; the last good config stays in force", "err", err)
			return
		}
		notes, err := w.Apply(nwc.Vendors)
		if err != nil {
			log.Error("config reload rejected; the last good config stays in force", "err", err)
			return
		}
		for _, n := range notes {
			log.Info("config change applied", "change", n)
		}
		// [callbacks]: from the next delivery attempt; the notes name
		// prefixes, never secrets.
		notes, err = w.ApplyCallbacks(nwc.Callbacks)
		if err != nil {
			log.Error("[callbacks] reload rejected; the last good [callbacks] stay in force", "err", err)
		}
		for _, n := range notes {
			log.Info("config change applied", "change", n)
		}
		applied(next)
	}
	observe := func(e config.WatchEvent) {
		if e == config.WatchArmed {
			log.Info("watching the config file; saving it or SIGHUP reloads it", "path", cfg.Path)
		}
	}
	err := config.Watch(ctx, cfg.Path, log, apply, config.WatchOptions{Reload: reload, Observe: observe})
	if err != nil {
		log.Error("cannot watch the config file; edits and SIGHUP need a restart", "err", err)
	}
}

// metricsWriteTimeout bounds a scrape's answer: a read of Redis.
const metricsWriteTimeout = 30 * time.Second

// serveMetrics serves h on addr. stop shuts the server down (scrapes in
// progress get 5 s) and waits for it.
func serveMetrics(addr string, h http.Handler, log *slog.Logger) (stop func(), err error) {
	ln, err := net.Listen("tcp", addr)
	if err != nil {
		return nil, fmt.Errorf("--metrics-addr %s: %w", addr, err)
	}
	// The server's own errors (a broken scrape connection) go to the
	// worker's log too, not to the log package's default logger.
	srv := httpguard.NewServer(h, metricsWriteTimeout, log)
	var serving sync.WaitGroup
	serving.Go(func() { _ = srv.Serve(ln) })
	base := "http://" + ln.Addr().String()
	log.Info("serving metrics", "addr", base+"/metrics", "healthz", base+"/healthz")
	return func() {
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		defer cancel()
		if srv.Shutdown(ctx) != nil {
			_ = srv.Close()
		}
		serving.Wait()
	}, nil
}

func loadConfig(cmd *cobra.Command) (*config.Config, error) {
	path, _ := cmd.Flags().GetString("config")
	return config.Load(path)
}

// withClient loads the config, connects and runs f with a queue client.
func withClient(cmd *cobra.Command, f func(ctx context.Context, cfg *config.Config, rdb redis.UniversalClient, c *queue.Client) error) error {
	cfg, err := loadConfig(cmd)
	if err != nil {
		return err
	}
	ctx, stop := signal.NotifyContext(cmd.Context(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	log := slog.New(slog.NewTextHandler(cmd.ErrOrStderr(), nil))
	ctx, rdb, closeRedis, err := connect(ctx, cfg, false, log)
	if err != nil {
		return err
	}
	defer closeRedis()
	c := queue.NewClient(rdb, cfg.ClientConfig())
	defer c.Close()
	err = f(ctx, cfg, rdb, c)
	if gone := embeddedGone(ctx); gone != nil {
		return gone
	}
	return err
}

// workerRef reads the worker the metrics describe through w, which is set
// before the metrics server starts serving.
type workerRef struct{ w **queue.Worker }

func (r workerRef) Buckets() map[string]*shaper.Bucket { return (*r.w).Buckets() }
func (r workerRef) Serving() int                       { return (*r.w).Serving() }
func (r workerRef) AccountBacklogs(ctx context.Context) (map[string]int64, error) {
	return (*r.w).AccountBacklogs(ctx)
}
