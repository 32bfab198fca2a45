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

	"github.com/shaper-dev/shaper/internal/vendorsim"
)

func newMockVendorCmd() *cobra.Command {
	var listen, phase, retryAfter, headers string
	var rate int
	var window time.Duration
	var quiet bool
	cmd := &cobra.Command{
		Use:   "mock-vendor",
		Short: "Run a vendor API that enforces a fixed window and answers excess with 429",
		Long: `Run a vendor API for trying shaper: it allows --rate requests per fixed
--window whose phase you do not see (--phase random), answers excess with 429
and Retry-After, logs every request, and on SIGINT/SIGTERM prints a summary:
requests, 429s and the most requests in any of its windows.`,
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			if rate < 1 || window <= 0 {
				return errors.New("--rate must be at least 1 and --window positive")
			}
			v := &vendorsim.Vendor{Rate: rate, Window: window, RetryAfter: retryAfter, Headers: headers}
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
			if !quiet {
				h = http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
					rec := &statusRecorder{ResponseWriter: w, status: http.StatusOK}
					v.ServeHTTP(rec, r)
					fmt.Fprintf(out, "%s %s %s %d key=%s\n", time.Now().Format("15:04:05.000"), r.Method, r.URL.RequestURI(), rec.status, r.Header.Get("Idempotency-Key"))
				})
			}
			ln, err := net.Listen("tcp", listen)
			if err != nil {
				return err
			}
			fmt.Fprintf(cmd.OutOrStdout(), "mock vendor on http://%s: %d per %s, phase %s, Retry-After %s, headers %s\n",
				ln.Addr(), rate, window, v.Phase.Round(time.Millisecond), retryAfter, headers)
			srv := &http.Server{Handler: h, ReadHeaderTimeout: 10 * time.Second}
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
	f.StringVar(&phase, "phase", "random", "window phase: random, or seconds after each multiple of the window")
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
