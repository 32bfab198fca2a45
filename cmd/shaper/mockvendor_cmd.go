package main

import (
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"net"
	"net/http"
	"os"
	"os/signal"
	"strconv"
	"syscall"
	"time"

	"github.com/spf13/cobra"

	"github.com/shaper-dev/shaper/internal/httpguard"
	"github.com/shaper-dev/shaper/internal/vendorsim"
)

func newMockVendorCmd() *cobra.Command {
	var listen, phase, retryAfter, headers, kind string
	var rate, burst int
	var window, jitter time.Duration
	var quiet bool
	cmd := &cobra.Command{
		Use:   "mock-vendor",
		Short: "Run a vendor API that enforces a limit and answers excess with 429",
		Long: `Run a vendor API for trying shaper: it allows --rate requests per
--window, counted in a fixed window whose phase you do not see (--kind fixed,
--phase random), a sliding log (--kind sliding) or a token bucket of --burst
(--kind gcra); answers excess with 429 and Retry-After; can add --jitter of
random delay to every request (a network that bunches calls up); logs every
request, and on SIGINT/SIGTERM prints a summary: requests, 429s and the most
requests in any of its windows.`,
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			if rate < 1 || window <= 0 {
				return errors.New("--rate must be at least 1 and --window positive")
			}
			v := &vendorsim.Mock{Kind: kind, Rate: rate, Window: window, Burst: burst, RetryAfter: retryAfter, Headers: headers}
			switch kind {
			case "fixed", "sliding", "gcra":
			default:
				return fmt.Errorf("--kind %q: want fixed, sliding or gcra", kind)
			}
			if burst < 1 || jitter < 0 {
				return errors.New("--burst must be at least 1 and --jitter not negative")
			}
			switch retryAfter {
			case "seconds", "date", "none":
			default:
				return fmt.Errorf("--retry-after %q: want seconds, date or none", retryAfter)
			}
			switch headers {
			case "none", "x-ratelimit", "ietf":
			default:
				return fmt.Errorf("--headers %q: want none, x-ratelimit or ietf", headers)
			}
			if phase == "random" {
				v.Phase = time.Duration(rand.Int64N(int64(window)))
			} else if secs, err := strconv.ParseFloat(phase, 64); err == nil && secs >= 0 {
				v.Phase = time.Duration(secs * float64(time.Second))
			} else {
				return fmt.Errorf("--phase %q: want random or a number of seconds", phase)
			}
			out := cmd.ErrOrStderr()
			var h http.Handler = v
			if jitter > 0 {
				h = &vendorsim.Jitter{Next: v, Max: jitter}
			}
			if inner := h; !quiet {
				h = http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
					rec := &statusRecorder{ResponseWriter: w, status: http.StatusOK}
					inner.ServeHTTP(rec, r)
					fmt.Fprintf(out, "%s %s %s %d key=%s\n", time.Now().Format("15:04:05.000"), r.Method, r.URL.RequestURI(), rec.status, r.Header.Get("Idempotency-Key"))
				})
			}
			ln, err := net.Listen("tcp", listen)
			if err != nil {
				return err
			}
			fmt.Fprintf(cmd.OutOrStdout(), "mock vendor on http://%s: %s, %d per %s, phase %s, Retry-After %s, headers %s, jitter 0-%s\n",
				ln.Addr(), kind, rate, window, v.Phase.Round(time.Millisecond), retryAfter, headers, jitter)
			srv := httpguard.NewServer(h, jitter+time.Minute, nil)
			ctx, stop := signal.NotifyContext(cmd.Context(), os.Interrupt, syscall.SIGTERM)
			defer stop()
			go func() { <-ctx.Done(); _ = srv.Shutdown(context.Background()) }()
			if err := srv.Serve(ln); err != nil && !errors.Is(err, http.ErrServerClosed) {
				return err
			}
			s := v.Summarize()
			fmt.Fprintf(cmd.OutOrStdout(), "summary: %d requests, %d answered 429, most in one %s window: %d (limit %d), most in any sliding %s: %d\n",
				s.Requests, s.RateLimited, window, s.MaxPerWindow, rate, window, s.MaxSliding)
			return nil
		},
	}
	f := cmd.Flags()
	f.StringVar(&listen, "listen", "127.0.0.1:0", "address to listen on")
	f.IntVar(&rate, "rate", 100, "requests allowed per window")
	f.DurationVar(&window, "window", time.Second, "the fixed window")
	f.StringVar(&kind, "kind", "fixed", "how the limit is counted: fixed (window), sliding (log) or gcra (token bucket)")
	f.IntVar(&burst, "burst", 1, "the token bucket's burst (--kind gcra)")
	f.DurationVar(&jitter, "jitter", 0, "random delay of 0 to this before each request reaches the vendor")
	f.StringVar(&phase, "phase", "random", "window phase (--kind fixed): random, or seconds after each multiple of the window")
	f.StringVar(&retryAfter, "retry-after", "seconds", "Retry-After on 429: seconds, date or none")
	f.StringVar(&headers, "headers", "none", "rate-limit headers: none, x-ratelimit or ietf")
	f.BoolVar(&quiet, "quiet", false, "do not log every request")
	return cmd
}

type statusRecorder struct {
	http.ResponseWriter
	status int
}

func (r *statusRecorder) WriteHeader(code int) {
	r.status = code
	r.ResponseWriter.WriteHeader(code)
}
