package main

import (
	"context"
	"log/slog"
	"os"
	"os/signal"
	"syscall"

	"github.com/spf13/cobra"

	"github.com/shaper-dev/shaper/config"
	"github.com/shaper-dev/shaper/queue"
)

func newWorkerCmd() *cobra.Command {
	return &cobra.Command{
		Use:   "worker",
		Short: "Run the background worker until SIGINT or SIGTERM",
		Long: `Run the worker: one queue per vendor, calls released on each vendor's tick
shared by every worker on the same Redis. Run as many as you like, on one
machine or many. On SIGINT/SIGTERM calls in flight finish (within
worker.shutdown_timeout) and the rest go back to the queue.`,
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
			w, err := queue.NewWorker(rdb, wc)
			if err != nil {
				return err
			}
			log.Info("worker started", "config", cfg.Path, "vendors", cfg.VendorNames())
			return w.Run(ctx)
		},
	}
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
