package main

import (
	"context"
	"fmt"
	"log/slog"
	"net"
	"net/http"
	"os"
	"os/signal"
	"syscall"
	"time"

	"github.com/spf13/cobra"

	"github.com/shaper-dev/shaper/config"
	"github.com/shaper-dev/shaper/internal/metrics"
	"github.com/shaper-dev/shaper/queue"
	"github.com/shaper-dev/shaper/shaper"
)

func newWorkerCmd() *cobra.Command {
	var metricsAddr string
	cmd := &cobra.Command{
		Use:   "worker",
		Short: "Run the background worker until SIGINT or SIGTERM",
		Long: `Run the worker: one queue per vendor, calls released on each vendor's tick
shared by every worker on the same Redis. Run as many as you like, on one
machine or many. Edits to the config file (and SIGHUP) reload it: rates
apply within a second, added vendors start, removed ones stop; an invalid
edit is logged and the last good config stays. On SIGINT/SIGTERM calls in
flight finish (within worker.shutdown_timeout) and the rest go back to the
queue.`,
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			cfg, err := loadConfig(cmd)
			if err != nil {
				return err
			}
			log := slog.New(slog.NewTextHandler(cmd.ErrOrStderr(), &slog.HandlerOptions{Level: slog.LevelInfo}))
			ctx, stop := signal.NotifyContext(cmd.Context(), os.Interrupt, syscall.SIGTERM)
			defer stop()
			rdb, closeRedis, err := connect(ctx, cfg, true, log)
			if err != nil {
				return err
			}
			defer closeRedis()
			wc, err := workerConfig(cfg, log)
			if err != nil {
				return err
			}
			var w *queue.Worker
			if metricsAddr != "" {
				qc := queue.NewClient(rdb, clientConfig(cfg))
				defer qc.Close()
				m := metrics.New(func() map[string]*shaper.Bucket { return w.Buckets() }, qc)
				wc.Observer = m
				ln, err := net.Listen("tcp", metricsAddr)
				if err != nil {
					return fmt.Errorf("--metrics-addr %s: %w", metricsAddr, err)
				}
				srv := &http.Server{Handler: m.Handler(rdb), ReadHeaderTimeout: 5 * time.Second}
				go func() { _ = srv.Serve(ln) }()
				defer srv.Close()
				log.Info("serving metrics", "addr", "http://"+ln.Addr().String()+"/metrics", "healthz", "http://"+ln.Addr().String()+"/healthz")
			}
			w, err = queue.NewWorker(rdb, wc)
			if err != nil {
				return err
			}
			hup := make(chan os.Signal, 1)
			signal.Notify(hup, syscall.SIGHUP)
			defer signal.Stop(hup)
			reload := make(chan struct{})
			go func() {
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
			}()
			log.Info("worker started", "config", cfg.Path, "vendors", cfg.VendorNames())
			go func() {
				err := config.Watch(ctx, cfg.Path, log, func(next *config.Config) {
					if next.Redis != cfg.Redis {
						log.Warn("redis settings changed in the config; they apply when the worker restarts")
					}
					nwc, err := workerConfig(next, log)
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
				}, config.WatchOptions{Reload: reload})
				if err != nil {
					log.Error("cannot watch the config file; edits need a restart (SIGHUP still reloads)", "err", err)
				}
			}()
			return w.Run(ctx)
		},
	}
	cmd.Flags().StringVar(&metricsAddr, "metrics-addr", "", "serve Prometheus /metrics and /healthz on this address (off by default; :0 picks a free port)")
	return cmd
}

func loadConfig(cmd *cobra.Command) (*config.Config, error) {
	path, _ := cmd.Flags().GetString("config")
	return config.Load(path)
}

func workerConfig(cfg *config.Config, log *slog.Logger) (queue.WorkerConfig, error) {
	wc := queue.WorkerConfig{
		MaxWait:         cfg.Worker.MaxWait,
		ShutdownTimeout: cfg.Worker.ShutdownTimeout,
		Retention:       cfg.Worker.Retention,
		Logger:          log,
	}
	for _, v := range cfg.Vendors {
		headers, err := v.ExpandHeaders()
		if err != nil {
			return wc, err
		}
		wc.Vendors = append(wc.Vendors, queue.VendorSpec{
			Name: v.Name, BaseURL: v.BaseURL, Policy: v.Policy(), Timeout: v.Timeout, Concurrency: v.Concurrency,
			Headers: headers, UserAgent: v.UserAgent, MaxRetryAfter: v.MaxRetryAfter,
		})
	}
	return wc, nil
}

func clientConfig(cfg *config.Config) queue.ClientConfig {
	cc := queue.ClientConfig{MaxRetry: cfg.Worker.MaxRetry, Retention: cfg.Worker.Retention}
	for _, v := range cfg.Vendors {
		cc.Vendors = append(cc.Vendors, queue.VendorQueue{Name: v.Name, QueueLimit: v.QueueLimit})
	}
	return cc
}

// withClient loads the config, connects and runs f with a queue client.
func withClient(cmd *cobra.Command, f func(ctx context.Context, cfg *config.Config, c *queue.Client) error) error {
	cfg, err := loadConfig(cmd)
	if err != nil {
		return err
	}
	ctx, stop := signal.NotifyContext(cmd.Context(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	log := slog.New(slog.NewTextHandler(cmd.ErrOrStderr(), nil))
	rdb, closeRedis, err := connect(ctx, cfg, false, log)
	if err != nil {
		return err
	}
	defer closeRedis()
	c := queue.NewClient(rdb, clientConfig(cfg))
	defer c.Close()
	return f(ctx, cfg, c)
}
