package main

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"os"
	"strings"

	"github.com/redis/go-redis/v9"
	"github.com/spf13/cobra"

	"github.com/shaper-dev/shaper/config"
	"github.com/shaper-dev/shaper/queue"
)

func newEnqueueCmd() *cobra.Command {
	var vendor, account, path, method, body, file, id, priority, callback string
	var cost int
	var headers []string
	cmd := &cobra.Command{
		Use:   "enqueue",
		Short: "Queue one vendor call, or one per line of an NDJSON file",
		Long: `Queue one call (--path) or every line of an NDJSON file (--file, - for stdin):

  {"id":"order-1042","account":"store-42","method":"POST","path":"/orders","headers":{"X-A":"b"},"body":{...}}

"account" (or --account) names the account of a per-account vendor.
"cost" (or --cost) is the units the call uses of every limit (default 1):
a GraphQL query's points, a batch's items. "priority": "high" (or
--priority high) puts the call ahead of every normal call of its bucket
that has not started; high calls can starve normal ones. "callback":
{"url": ...} (or --callback URL) has the call's outcome POSTed there,
signed, when it ends; the URL must be under [callbacks] allow.

Every line is validated first; bad lines are reported with their numbers and
nothing is enqueued. An id makes enqueueing idempotent: re-running a file
queues nothing twice.`,
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			if vendor == "" {
				return errors.New("--vendor is required")
			}
			if (path == "") == (file == "") {
				return errors.New("give either --path (one call) or --file (an NDJSON call file)")
			}
			if cmd.Flags().Changed("cost") && cost < 1 {
				return fmt.Errorf("--cost %d: a cost is a whole number of units, at least 1 (the default)", cost)
			}
			if _, err := queue.ParseLane(priority); err != nil {
				return fmt.Errorf("--priority: %w", err)
			}
			return withClient(cmd, func(ctx context.Context, cfg *config.Config, _ redis.UniversalClient, c *queue.Client) error {
				out := cmd.OutOrStdout()
				if file != "" {
					cf, err := readCalls(cmd, file, account, cost, priority)
					if err != nil {
						return err
					}
					res, err := c.EnqueueBatch(ctx, vendor, cf.calls)
					if err != nil && res.Enqueued+res.AlreadyQueued > 0 {
						return partlyQueued(cf, vendor, res, err)
					}
					if err != nil {
						return badLines(cf.name, err)
					}
					waiting, _ := c.Waiting(ctx, vendor)
					fmt.Fprintf(out, "enqueued %d, already queued %d, on vendor %s (%d waiting)\n", res.Enqueued, res.AlreadyQueued, vendor, waiting)
					return nil
				}
				call := queue.Call{Vendor: vendor, Account: account, ID: id, Method: strings.ToUpper(method), Path: path, Cost: cost, Priority: priority}
				if body != "" {
					call.Body = json.RawMessage(body)
				}
				if callback != "" {
					call.Callback = &queue.Callback{URL: callback}
				}
				if len(headers) > 0 {
					call.Headers = map[string]string{}
				}
				for _, h := range headers {
					k, v, ok := strings.Cut(h, ":")
					if !ok {
						return fmt.Errorf("--header %q: want 'Name: value'", h)
					}
					call.Headers[strings.TrimSpace(k)] = strings.TrimSpace(v)
				}
				taskID, err := c.Enqueue(ctx, call)
				if errors.Is(err, queue.ErrDuplicate) {
					fmt.Fprintln(out, taskID, "(already queued)")
					return nil
				}
				if err != nil {
					return err
				}
				fmt.Fprintln(out, taskID)
				return nil
			})
		},
	}
	f := cmd.Flags()
	f.StringVar(&vendor, "vendor", "", "vendor name (a [vendors.NAME] table)")
	f.StringVar(&account, "account", "", "the account of a per-account vendor the call belongs to (with --file: of every line that names none)")
	f.StringVar(&path, "path", "", "path on the vendor's base_url, e.g. /orders/1042")
	f.StringVar(&method, "method", "GET", "HTTP method")
	f.StringArrayVar(&headers, "header", nil, "header 'Name: value' (repeatable)")
	f.StringVar(&body, "body", "", "JSON body")
	f.StringVar(&id, "id", "", "call id: makes enqueueing idempotent and is the Idempotency-Key")
	f.StringVar(&file, "file", "", "NDJSON call file, - for stdin")
	f.StringVar(&callback, "callback", "", "POST the call's outcome to this URL when it ends (under [callbacks] allow)")
	f.IntVar(&cost, "cost", 0, "units of every limit the call uses, default 1 (with --file: of every line that gives none)")
	f.StringVar(&priority, "priority", "", "lane: high or normal, default normal (with --file: of every line that gives none)")
	return cmd
}

// callFile is a call file read and checked: its calls, each with the
// --account given when its line names none.
type callFile struct {
	name  string
	calls []queue.Call
}

// readCalls reads and validates a call file; all bad lines in one error.
func readCalls(cmd *cobra.Command, file, account string, cost int, priority string) (callFile, error) {
	var r io.Reader = cmd.InOrStdin()
	name := "stdin"
	if file != "-" {
		f, err := os.Open(file)
		if err != nil {
			return callFile{}, err
		}
		defer f.Close()
		r, name = f, file
	}
	calls, err := queue.ParseCalls(r)
	if err != nil {
		return callFile{}, badLines(name, err)
	}
	if len(calls) == 0 {
		return callFile{}, fmt.Errorf("%s has no call lines; nothing was enqueued", name)
	}
	for i := range calls {
		if calls[i].Account == "" {
			calls[i].Account = account
		}
		if calls[i].Cost == 0 {
			calls[i].Cost = cost
		}
		if calls[i].Priority == "" {
			calls[i].Priority = priority
		}
	}
	return callFile{name: name, calls: calls}, nil
}

// partlyQueued says what an enqueue that stopped half way took:
// the counts, and the lines not queued.
func partlyQueued(cf callFile, vendor string, res queue.BatchResult, err error) error {
	var b strings.Builder
	n := 0
	for i, bc := range res.Calls {
		if bc.State != queue.StateNotQueued {
			continue
		}
		if n++; n <= 20 {
			fmt.Fprintf(&b, "\n%s:%d: not queued: %v", cf.name, queue.LineOf(cf.calls[i]), bc.Err)
		}
	}
	if n > 20 {
		fmt.Fprintf(&b, "\n... and %d more", n-20)
	}
	return fmt.Errorf("enqueued %d, already queued %d, on vendor %s; %d line(s) not queued: %w (a line with an id can be enqueued again safely: if it was queued, it is not queued twice)%s",
		res.Enqueued, res.AlreadyQueued, vendor, n, err, b.String())
}

// badLines reports the bad lines of a call file, up to 50, as name:line:
// reasons; other errors pass through.
func badLines(name string, err error) error {
	var b strings.Builder
	n := 0
	for _, e := range unwrapJoined(err) {
		var le *queue.LineError
		if errors.As(e, &le) {
			n++
			if n <= 50 {
				fmt.Fprintf(&b, "%s:%d: %v\n", name, le.Line, le.Err)
			}
		}
	}
	if n == 0 {
		return err
	}
	if n > 50 {
		fmt.Fprintf(&b, "... and %d more\n", n-50)
	}
	return fmt.Errorf("%d bad line(s) in %s; nothing was enqueued:\n%s", n, name, strings.TrimRight(b.String(), "\n"))
}

func unwrapJoined(err error) []error {
	if j, ok := err.(interface{ Unwrap() []error }); ok {
		return j.Unwrap()
	}
	return []error{err}
}

func bar(n, total int64, width int) string {
	if total <= 0 {
		return "[" + strings.Repeat(" ", width) + "]"
	}
	fill := int(float64(width) * float64(n) / float64(total))
	fill = min(max(fill, 0), width)
	return "[" + strings.Repeat("#", fill) + strings.Repeat(".", width-fill) + "]"
}

func isTerminal(w io.Writer) bool {
	f, ok := w.(*os.File)
	if !ok {
		return false
	}
	st, err := f.Stat()
	return err == nil && st.Mode()&os.ModeCharDevice != 0
}
