package main

import (
	"context"
	"fmt"
	"log/slog"
	"net"
	"net/http"
	"os"
	"os/signal"
	"sync"
	"syscall"
	"time"

	"github.com/hibiken/asynqmon"
	"github.com/redis/go-redis/v9"
	"github.com/spf13/cobra"

	"github.com/shaper-dev/shaper/config"
	"github.com/shaper-dev/shaper/internal/httpguard"
	"github.com/shaper-dev/shaper/internal/report"
	"github.com/shaper-dev/shaper/internal/ui"
	"github.com/shaper-dev/shaper/queue"
	"github.com/shaper-dev/shaper/shaper"
)

// uiFlags are the live page's flags, the same on `shaper ui` and
// `shaper worker`.
type uiFlags struct {
	token       string
	allowWrites bool
}

func (f *uiFlags) add(cmd *cobra.Command) {
	cmd.Flags().StringVar(&f.token, "ui-token", "", "the live page's token, required on a non-loopback address (default $SHAPER_UI_TOKEN)")
	cmd.Flags().BoolVar(&f.allowWrites, "ui-allow-writes", false, "let the task views under /asynq/ delete, run and archive tasks (read-only by default)")
}

// tokenOrEnv is --ui-token, else $SHAPER_UI_TOKEN.
func (f *uiFlags) tokenOrEnv() string {
	if f.token != "" {
		return f.token
	}
	return os.Getenv("SHAPER_UI_TOKEN")
}

func newUICmd() *cobra.Command {
	var addr string
	var flags uiFlags
	cmd := &cobra.Command{
		Use:   "ui",
		Short: "Serve the live page: each vendor's calls against its limit, pauses and why a call waits",
		Long: `ui serves a page that shows, per vendor, the calls started per second against
the limit, the effective rate and what set it, quotas, pauses with their
reasons, 429s, the queue and the calls in flight, a per-account vendor's
accounts, and why one call waits (its task id). The task views of asynqmon
are under /asynq/, read-only unless --ui-allow-writes. It reads the same
Redis as the workers and follows edits of the config file.

The page binds to 127.0.0.1 by default. On any other address it needs a
token (--ui-token or SHAPER_UI_TOKEN): open the page once as /?token=TOKEN
(a cookie keeps it) or send "Authorization: Bearer TOKEN".`,
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			token := flags.tokenOrEnv()
			if err := ui.CheckAddr("--addr", addr, token); err != nil {
				return err
			}
			cfg, err := loadConfig(cmd)
			if err != nil {
				return err
			}
			log := slog.New(slog.NewTextHandler(cmd.ErrOrStderr(), nil))
			redis.SetLogger(redisLog{log})
			ctx, stop := signal.NotifyContext(cmd.Context(), os.Interrupt, syscall.SIGTERM)
			defer stop()
			ctx, rdb, closeRedis, err := connect(ctx, cfg, false, log)
			if err != nil {
				return err
			}
			defer closeRedis()
			src := newPageSource(rdb, cfg)
			defer src.Close()
			stopPage, err := servePage(addr, "--addr", src, rdb, flags, token, log)
			if err != nil {
				return err
			}
			defer stopPage()
			var watch sync.WaitGroup
			watch.Go(func() {
				err := config.Watch(ctx, cfg.Path, log, func(next *config.Config) {
					if _, err := next.WorkerConfig(); err != nil {
						log.Error("config reload rejected; the page keeps the last good config", "err", err)
						return
					}
					src.SetConfig(next)
					log.Info("config reloaded", "vendors", next.VendorNames())
				}, config.WatchOptions{})
				if err != nil {
					log.Warn("cannot watch the config file; the page shows the vendors it started with", "err", err)
				}
			})
			<-ctx.Done()
			watch.Wait()
			return embeddedGone(ctx)
		},
	}
	cmd.Flags().StringVar(&addr, "addr", "127.0.0.1:8080", "serve the page on this address (:0 picks a free port)")
	flags.add(cmd)
	return cmd
}

// servePage serves the live page on addr (flag names the flag that set
// it, for errors) until stop, which shuts the server down (requests in
// progress get 5 s) and stops the page's sampler.
func servePage(addr, flag string, src *pageSource, rdb redis.UniversalClient, flags uiFlags, token string, log *slog.Logger) (stop func(), err error) {
	if err := ui.CheckAddr(flag, addr, token); err != nil {
		return nil, err
	}
	ln, err := net.Listen("tcp", addr)
	if err != nil {
		return nil, fmt.Errorf("%s %s: %w", flag, addr, err)
	}
	page, err := ui.New(ui.Options{Source: src, Asynq: asynqmonHandler(rdb, flags.allowWrites), Token: token, Log: log,
		Addr: httpguard.Bound(addr, ln)})
	if err != nil {
		_ = ln.Close()
		return nil, err
	}
	ctx, cancel := context.WithCancel(context.Background())
	srv := httpguard.NewServer(page.Handler(), ui.WriteTimeout, log)
	srv.BaseContext = func(net.Listener) context.Context { return ctx }
	var running sync.WaitGroup
	running.Go(func() { page.Run(ctx) })
	running.Go(func() { _ = srv.Serve(ln) })
	log.Info("serving the live page", "url", "http://"+ln.Addr().String()+"/", "tasks", "http://"+ln.Addr().String()+"/asynq/",
		"token", token != "", "asynq_writes", flags.allowWrites)
	return func() {
		sctx, scancel := context.WithTimeout(context.Background(), 5*time.Second)
		defer scancel()
		if srv.Shutdown(sctx) != nil {
			_ = srv.Close()
		}
		cancel()
		running.Wait()
	}, nil
}

// pageSource is the live page's ui.Source: the stats report and explain
// of the config in force, which SetConfig replaces. Its one gate serves
// every client it makes (a gate keeps what it learned of the servers).
type pageSource struct {
	rdb  redis.UniversalClient
	gate *shaper.Gate

	mu     sync.RWMutex // held for reading while a read uses cfg and client
	cfg    *config.Config
	client *queue.Client
}

func newPageSource(rdb redis.UniversalClient, cfg *config.Config) *pageSource {
	p := &pageSource{rdb: rdb, gate: shaper.NewGate(rdb, shaper.Config{}), cfg: cfg}
	p.client = p.newClient(cfg)
	return p
}

// newClient is a queue client of cfg on the page's gate.
func (p *pageSource) newClient(cfg *config.Config) *queue.Client {
	cc := cfg.ClientConfig()
	cc.Gate = p.gate
	return queue.NewClient(p.rdb, cc)
}

// SetConfig makes next the config the page shows.
func (p *pageSource) SetConfig(next *config.Config) {
	c := p.newClient(next)
	p.mu.Lock()
	old := p.client
	p.cfg, p.client = next, c
	p.mu.Unlock()
	old.Close()
}

// Close releases the queue client.
func (p *pageSource) Close() error {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.client.Close()
}

// pageTopAccounts is how many accounts of a per-account vendor the page
// lists, the longest backlog first.
const pageTopAccounts = 10

func (p *pageSource) Report(ctx context.Context) (report.Report, error) {
	p.mu.RLock()
	defer p.mu.RUnlock()
	return report.Collect(ctx, p.cfg, p.gate, p.client, pageTopAccounts, "")
}

func (p *pageSource) Vendor(ctx context.Context, vendor, account string) (report.VendorState, error) {
	p.mu.RLock()
	defer p.mu.RUnlock()
	for _, v := range p.cfg.Vendors {
		if v.Name == vendor {
			return report.VendorReport(ctx, v, p.gate, p.client, pageTopAccounts, account)
		}
	}
	return report.VendorState{}, fmt.Errorf("%w %q: configured vendors are %v", queue.ErrUnknownVendor, vendor, p.cfg.VendorNames())
}

func (p *pageSource) Explain(ctx context.Context, id string) (queue.Explanation, error) {
	p.mu.RLock()
	defer p.mu.RUnlock()
	return p.client.Explain(ctx, id)
}

// sharedRedis hands asynqmon the page's Redis client (an
// asynq.RedisConnOpt). asynqmon's Close would close it: the page never
// calls it, and the client closes with the command.
type sharedRedis struct{ rdb redis.UniversalClient }

func (s sharedRedis) MakeRedisClient() any { return s.rdb }

// asynqmonHandler is asynqmon's task views under /asynq/, read-only unless
// allowWrites, showing a call's method and path and a result's status in
// place of payloads and bodies.
func asynqmonHandler(rdb redis.UniversalClient, allowWrites bool) http.Handler {
	return asynqmon.New(asynqmon.Options{
		RootPath:         "/asynq",
		RedisConnOpt:     sharedRedis{rdb},
		ReadOnly:         !allowWrites,
		PayloadFormatter: asynqmon.PayloadFormatterFunc(queue.DescribePayload),
		ResultFormatter:  asynqmon.ResultFormatterFunc(queue.DescribeResult),
	})
}
