package main

import (
	"bufio"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"os"
	"strings"
	"time"

	"github.com/redis/go-redis/v9"
	"github.com/spf13/cobra"

	"github.com/shaper-dev/shaper/config"
	"github.com/shaper-dev/shaper/queue"
)

func newExportCmd() *cobra.Command {
	var vendor, account, file, id, out string
	var wait bool
	cmd := &cobra.Command{
		Use:   "export",
		Short: "Queue a call file as one named export; read its answers back, retry or cancel it",
		Long: `Queue every line of an NDJSON call file (see enqueue) as one export: a
named group of calls whose answers are kept, read back in the file's
order with "export results". A line may be the first page of a
paginated pull ("next"): its pages join the export after it.

A line without an id gets "<export id>:<n>", its place in the export:
running the same file again with the same --id queues nothing twice and
finishes what a first run left. A line whose id is already queued or
done counts as the export's own.

  shaper export --vendor acme --file orders.ndjson --wait --out answers.ndjson
  shaper export results ID --failed
  shaper export retry ID`,
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			if vendor == "" || file == "" {
				return errors.New("--vendor and --file are required")
			}
			if out != "" && !wait {
				return errors.New("--out writes the answers as the export runs: give --wait too (or read them later with: shaper export results ID --out FILE)")
			}
			return withClient(cmd, func(ctx context.Context, cfg *config.Config, _ redis.UniversalClient, c *queue.Client) error {
				src, name, cleanup, err := fileSource(cmd, file, account)
				if err != nil {
					return err
				}
				defer cleanup()
				st, err := c.StartExportFrom(ctx, id, vendor, src)
				if err != nil && st.ID == "" {
					return badLines(name, err)
				}
				if err != nil {
					return err
				}
				w := cmd.OutOrStdout()
				fmt.Fprintf(w, "export %s: %d calls on vendor %s (enqueued %d, already queued %d)\n", st.ID, st.Total, vendor, st.Enqueued, st.AlreadyQueued)
				if !wait {
					fmt.Fprintf(w, "follow it with: shaper export status %s; read its answers with: shaper export results %s\n", st.ID, st.ID)
					return nil
				}
				if out == "" {
					return watchExport(ctx, w, c, st.ID)
				}
				return watchWriting(ctx, w, c, st.ID, out)
			})
		},
	}
	f := cmd.Flags()
	f.StringVar(&vendor, "vendor", "", "vendor name")
	f.StringVar(&account, "account", "", "the account of a per-account vendor, for every line that names none")
	f.StringVar(&file, "file", "", "NDJSON call file, - for stdin")
	f.StringVar(&id, "id", "", "export id (default: a fresh one); re-running with the same id queues nothing twice")
	f.BoolVar(&wait, "wait", false, "show progress until the export completes")
	f.StringVar(&out, "out", "", "with --wait: write the answers to this file (NDJSON, the export's order) as the calls end")
	cmd.AddCommand(newExportStatusCmd(), newExportResultsCmd(), newExportRetryCmd(), newExportCancelCmd())
	return cmd
}

// fileSource is a call file as a queue.CallSource, read from the start on
// each pass (stdin is copied to a temporary file first): no file is held
// in memory whole.
func fileSource(cmd *cobra.Command, file, account string) (queue.CallSource, string, func(), error) {
	name, cleanup := file, func() {}
	if file == "-" {
		tmp, err := os.CreateTemp("", "shaper-export-*.ndjson")
		if err != nil {
			return nil, "", nil, err
		}
		cleanup = func() { tmp.Close(); os.Remove(tmp.Name()) }
		if _, err := io.Copy(tmp, cmd.InOrStdin()); err != nil {
			cleanup()
			return nil, "", nil, fmt.Errorf("reading stdin: %w", err)
		}
		file, name = tmp.Name(), "stdin"
	}
	if _, err := os.Stat(file); err != nil {
		cleanup()
		return nil, "", nil, err
	}
	src := func(fn func(queue.Call) error) error {
		f, err := os.Open(file)
		if err != nil {
			return err
		}
		defer f.Close()
		return queue.ScanCalls(bufio.NewReaderSize(f, 1<<16), false, func(c queue.Call) error {
			if c.Account == "" {
				c.Account = account
			}
			return fn(c)
		})
	}
	return src, name, cleanup, nil
}

// watchWriting shows the export's progress and writes its answers to
// out as its calls end, in its order.
func watchWriting(ctx context.Context, w io.Writer, c *queue.Client, id, out string) error {
	f, err := os.Create(out)
	if err != nil {
		return err
	}
	bw := bufio.NewWriterSize(f, 1<<16)
	rctx, cancel := context.WithCancel(ctx)
	defer cancel()
	type result struct {
		sum queue.ResultsSummary
		err error
	}
	done := make(chan result, 1)
	go func() {
		sum, err := c.ExportResults(rctx, id, queue.ResultsQuery{Follow: true}, flushWriter{bw})
		done <- result{sum, err}
	}()
	werr := watchExport(ctx, w, c, id)
	var r result
	select {
	case r = <-done:
	case <-time.After(30 * time.Second):
		cancel()
		r = <-done
		if r.err == nil {
			r.err = errors.New("the answers did not all arrive 30 s after the export finished")
		}
	}
	if err := errors.Join(bw.Flush(), f.Close()); err != nil && r.err == nil {
		r.err = err
	}
	if r.err != nil {
		return errors.Join(werr, fmt.Errorf("writing the answers to %s: %w", out, r.err))
	}
	fmt.Fprintf(w, "wrote %d answers to %s\n", r.sum.Lines, out)
	return werr
}

// flushWriter flushes a bufio.Writer when ExportResults waits.
type flushWriter struct{ *bufio.Writer }

func (f flushWriter) Flush() { _ = f.Writer.Flush() }

func newExportStatusCmd() *cobra.Command {
	var asJSON bool
	cmd := &cobra.Command{
		Use:   "status ID",
		Short: "Report an export's progress",
		Args:  cobra.ExactArgs(1),
		RunE: func(cmd *cobra.Command, args []string) error {
			return withClient(cmd, func(ctx context.Context, cfg *config.Config, _ redis.UniversalClient, c *queue.Client) error {
				e, err := c.ExportStatus(ctx, args[0])
				if err != nil {
					return err
				}
				w := cmd.OutOrStdout()
				if asJSON {
					return json.NewEncoder(w).Encode(exportJSON(e))
				}
				fmt.Fprintf(w, "export %s on %s: %s, %d done, %d failed, %d total (started %s)\n",
					e.ID, e.Vendor, e.State(), e.Done, e.Failed, e.Total, e.Created.Format(time.RFC3339))
				if !e.Queued {
					fmt.Fprintf(w, "its enqueue stopped before every call was queued: run the export again with --id %s to queue the rest\n", e.ID)
				}
				return nil
			})
		},
	}
	cmd.Flags().BoolVar(&asJSON, "json", false, "print the progress as JSON")
	return cmd
}

// exportJSON is an export's progress as status --json and the HTTP API
// show it.
func exportJSON(e queue.Export) any {
	return struct {
		queue.Export
		State string `json:"state"`
	}{e, e.State()}
}

func newExportResultsCmd() *cobra.Command {
	var out string
	var follow, failed bool
	var states []string
	cmd := &cobra.Command{
		Use:   "results ID",
		Short: "Write an export's answers as NDJSON, one line per call in the export's order",
		Long: `Write one JSON line per call of the export, in its order (a pull's pages
after its first call, in page order):

  {"id":"order-1","state":"done","status":201,"attempts":1,"answer":{"status":201,"body":{...},"bytes":4096}}

state is queued, retrying, running, done, failed, cancelled or expired
(past the retention). The answer is what the call kept (see max_answer
and keep_headers). --follow writes lines as calls end, still in order,
until the export finishes; --failed (or --state failed) lists the calls
that ended without success, with their last error.`,
		Args: cobra.ExactArgs(1),
		RunE: func(cmd *cobra.Command, args []string) error {
			if failed {
				states = append(states, queue.CallFailed)
			}
			for _, s := range states {
				switch s {
				case queue.CallQueued, queue.CallRetrying, queue.CallRunning, queue.CallDone, queue.CallFailed, queue.CallCancelled, queue.CallExpired:
				default:
					return fmt.Errorf("--state %q: want queued, retrying, running, done, failed, cancelled or expired", s)
				}
			}
			return withClient(cmd, func(ctx context.Context, cfg *config.Config, _ redis.UniversalClient, c *queue.Client) error {
				w, closeOut, err := outFile(cmd, out)
				if err != nil {
					return err
				}
				sum, err := c.ExportResults(ctx, args[0], queue.ResultsQuery{States: states, Follow: follow}, w)
				if cerr := closeOut(); err == nil {
					err = cerr
				}
				if err != nil {
					return err
				}
				if out != "" {
					fmt.Fprintf(cmd.OutOrStdout(), "wrote %d lines to %s\n", sum.Lines, out)
				}
				return nil
			})
		},
	}
	f := cmd.Flags()
	f.StringVar(&out, "out", "", "write to this file (default stdout)")
	f.BoolVar(&follow, "follow", false, "write lines as calls end, in order, until the export finishes")
	f.BoolVar(&failed, "failed", false, "only the calls that ended without success")
	f.StringSliceVar(&states, "state", nil, "only calls in these states (comma-separated)")
	return cmd
}

// outFile is stdout, or path created, buffered; close flushes it.
func outFile(cmd *cobra.Command, path string) (io.Writer, func() error, error) {
	var f *os.File
	var w io.Writer = cmd.OutOrStdout()
	if path != "" {
		var err error
		if f, err = os.Create(path); err != nil {
			return nil, nil, err
		}
		w = f
	}
	bw := bufio.NewWriterSize(w, 1<<16)
	return flushWriter{bw}, func() error {
		err := bw.Flush()
		if f != nil {
			err = errors.Join(err, f.Close())
		}
		return err
	}, nil
}

func newExportRetryCmd() *cobra.Command {
	var wait bool
	cmd := &cobra.Command{
		Use:   "retry ID",
		Short: "Queue an export's failed calls again, under their own ids",
		Long: `Queue every call of the export that failed (its retries spent, or an
answer not retried such as a 422) again, in the export's order, under its
own id: a vendor that deduplicates by Idempotency-Key sees the same call.
A cancelled call, or one past the retention, cannot run again: it is
listed, to be enqueued again.`,
		Args: cobra.ExactArgs(1),
		RunE: func(cmd *cobra.Command, args []string) error {
			return withClient(cmd, func(ctx context.Context, cfg *config.Config, _ redis.UniversalClient, c *queue.Client) error {
				r, err := c.RetryExport(ctx, args[0])
				if err != nil {
					return err
				}
				w := cmd.OutOrStdout()
				fmt.Fprintf(w, "export %s: %d failed call(s) queued again\n", args[0], r.Queued)
				if len(r.Gone) > 0 {
					fmt.Fprintf(w, "%d call(s) cannot run again (cancelled, or past the retention): %s\n", len(r.Gone), strings.Join(first(r.Gone, 20), ", "))
				}
				if wait && r.Queued > 0 {
					return watchExport(ctx, w, c, args[0])
				}
				return nil
			})
		},
	}
	cmd.Flags().BoolVar(&wait, "wait", false, "show progress until the export completes")
	return cmd
}

func newExportCancelCmd() *cobra.Command {
	return &cobra.Command{
		Use:   "cancel ID",
		Short: "Cancel every call of an export that has not started",
		Args:  cobra.ExactArgs(1),
		RunE: func(cmd *cobra.Command, args []string) error {
			return withClient(cmd, func(ctx context.Context, cfg *config.Config, _ redis.UniversalClient, c *queue.Client) error {
				r, err := c.CancelExport(ctx, args[0])
				if err != nil {
					return err
				}
				fmt.Fprintf(cmd.OutOrStdout(), "export %s: %d call(s) cancelled, %d running (they end as they will)\n", args[0], r.Cancelled, r.Running)
				return nil
			})
		},
	}
}

func first(s []string, n int) []string {
	if len(s) > n {
		return append(s[:n:n], fmt.Sprintf("and %d more", len(s)-n))
	}
	return s
}

// watchExport prints progress (done, failed, total, rate, ETA) until the
// export finishes, then a summary.
func watchExport(ctx context.Context, out io.Writer, c *queue.Client, id string) error {
	tty := isTerminal(out)
	start := time.Now()
	var first queue.Export
	lastPrint := time.Time{}
	for i := 0; ; i++ {
		e, err := c.ExportStatus(ctx, id)
		if err != nil {
			return err
		}
		if i == 0 {
			first = e
		}
		elapsed := time.Since(start)
		ended := e.Done + e.Failed - first.Done - first.Failed
		rate := float64(ended) / max(elapsed.Seconds(), 0.001)
		eta := "?"
		if rate > 0 {
			eta = (time.Duration(float64(e.Total-e.Done-e.Failed)/rate) * time.Second).Round(time.Second).String()
		}
		line := fmt.Sprintf("%s %d/%d done, %d failed, %.1f calls/s, ETA %s", bar(e.Done+e.Failed, e.Total, 30), e.Done, e.Total, e.Failed, rate, eta)
		if tty {
			fmt.Fprintf(out, "\r%s   ", line)
		} else if time.Since(lastPrint) >= 5*time.Second || e.Finished() {
			fmt.Fprintln(out, line)
			lastPrint = time.Now()
		}
		if e.Finished() {
			if tty {
				fmt.Fprintln(out)
			}
			fmt.Fprintf(out, "export %s finished in %s: %d done, %d failed of %d\n", id, elapsed.Round(100*time.Millisecond), e.Done, e.Failed, e.Total)
			if e.Failed > 0 {
				return fmt.Errorf("%d call(s) of export %s failed: list them with: shaper export results %s --failed; run them again with: shaper export retry %s", e.Failed, id, id, id)
			}
			return nil
		}
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-time.After(500 * time.Millisecond):
		}
	}
}
