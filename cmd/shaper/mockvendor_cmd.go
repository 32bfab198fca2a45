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
	"strings"
	"syscall"
	"time"

	"github.com/spf13/cobra"

	"github.com/shaper-dev/shaper/internal/httpguard"
	"github.com/shaper-dev/shaper/internal/vendorsim"
)

func newMockVendorCmd() *cobra.Command {
	var listen, phase, retryAfter, headers, kind, paging, pagePath, failIDs string
	var rate, burst, answerBytes, pages, pageItems, failEvery int
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
requests in any of its windows.

What it answers to an admitted request can be set too:
  --answer-bytes N  a JSON body of N bytes (at least 156 bytes plus the
                    key and path), the same for the same request: {"id":
                    its Idempotency-Key, "method", "path",
                    "request_sha256": of its body, "waybill": "WB-" and
                    12 hex digits of the key's SHA-256, "pad": "xxx..."}
                    (vendorsim.Answer);
  --pages N         GET requests under --page-path walk a list of N pages
                    of --page-items items ({"id":"c-1"}, "c-2" ...); each
                    page names the next by --paging: cursor (the body's
                    meta.next_cursor, sent back as ?cursor=), link (a
                    Link: <URL>; rel="next" header) or url (the body's
                    links.next), whose URLs are absolute, built from the
                    request's Host, and carry ?page_token=. The last page
                    names none; a cursor it did not give out is answered
                    400;
  --fail-ids FILE   requests whose Idempotency-Key is a line of FILE are
                    answered 422 {"error":"validation failed","id":KEY},
                    every time;
  --fail-every K    as are those whose key's 64-bit FNV-1a hash is a
                    multiple of K (about one key in K; vendorsim.FailsEvery
                    says which).
A 422 or 400 counts against the limit like any other admitted request. The
summary adds the distinct Idempotency-Keys seen, those seen more than once
(and the first few) and the 422s sent.`,
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
			if answerBytes < 0 || pages < 0 || failEvery < 0 {
				return errors.New("--answer-bytes, --pages and --fail-every must not be negative")
			}
			switch paging {
			case "cursor", "link", "url":
			default:
				return fmt.Errorf("--paging %q: want cursor, link or url", paging)
			}
			if pages > 0 && pageItems < 1 {
				return errors.New("--page-items must be at least 1")
			}
			if !strings.HasPrefix(pagePath, "/") {
				return fmt.Errorf("--page-path %q: want a path starting with /", pagePath)
			}
			v.AnswerBytes, v.FailEvery = answerBytes, failEvery
			v.Paging = vendorsim.Paging{Pages: pages, Items: pageItems, Style: paging, Prefix: pagePath}
			if failIDs != "" {
				keys, err := readFailIDs(failIDs)
				if err != nil {
					return err
				}
				v.FailKeys = keys
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
			if answerBytes > 0 {
				fmt.Fprintf(cmd.OutOrStdout(), "answers of %d bytes\n", answerBytes)
			}
			if pages > 0 {
				fmt.Fprintf(cmd.OutOrStdout(), "GET %s: %d pages of %d items, paging by %s\n", pagePath, pages, pageItems, paging)
			}
			if len(v.FailKeys) > 0 {
				fmt.Fprintf(cmd.OutOrStdout(), "answers 422 to the %d keys of %s\n", len(v.FailKeys), failIDs)
			}
			if failEvery > 0 {
				fmt.Fprintf(cmd.OutOrStdout(), "answers 422 to keys whose FNV-1a hash is a multiple of %d\n", failEvery)
			}
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
			repeated := ""
			if len(s.RepeatedFirst) > 0 {
				repeated = " (first: " + strings.Join(s.RepeatedFirst, ", ") + ")"
			}
			fmt.Fprintf(cmd.OutOrStdout(), "keys: %d distinct, %d seen more than once%s, %d answered 422\n",
				s.KeysSeen, s.KeysRepeated, repeated, s.Failed)
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
	f.IntVar(&answerBytes, "answer-bytes", 0, "answer admitted requests with a JSON body of this many bytes (0: a small one)")
	f.IntVar(&pages, "pages", 0, "serve GET requests under --page-path as a list of this many pages (0: off)")
	f.IntVar(&pageItems, "page-items", 10, "items on each page (--pages)")
	f.StringVar(&paging, "paging", "cursor", "how a page names the next (--pages): cursor, link or url")
	f.StringVar(&pagePath, "page-path", "/", "the path, and those under it, served as pages (--pages)")
	f.StringVar(&failIDs, "fail-ids", "", "a file of Idempotency-Keys, one a line, whose requests are answered 422")
	f.IntVar(&failEvery, "fail-every", 0, "answer 422 to requests whose Idempotency-Key's FNV-1a hash is a multiple of this (0: none)")
	return cmd
}

// readFailIDs reads the Idempotency-Keys of --fail-ids: one a line,
// surrounding blanks trimmed, blank lines skipped.
func readFailIDs(path string) (map[string]bool, error) {
	b, err := os.ReadFile(path)
	if err != nil {
		return nil, fmt.Errorf("--fail-ids: %w", err)
	}
	keys := map[string]bool{}
	for line := range strings.Lines(string(b)) {
		if k := strings.TrimSpace(line); k != "" {
			keys[k] = true
		}
	}
	return keys, nil
}

type statusRecorder struct {
	http.ResponseWriter
	status int
}

func (r *statusRecorder) WriteHeader(code int) {
	r.status = code
	r.ResponseWriter.WriteHeader(code)
}
