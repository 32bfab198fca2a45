package main

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"time"

	"github.com/redis/go-redis/v9"
	"github.com/spf13/cobra"

	"github.com/shaper-dev/shaper/config"
	"github.com/shaper-dev/shaper/queue"
)

func newExplainCmd() *cobra.Command {
	var asJSON bool
	var vendor string
	cmd := &cobra.Command{
		Use:   "explain TASK_ID",
		Short: "Say what a call waits for and when it should start, or how it ended",
		Long: `explain finds a call in the vendors' queues and says what it waits for now:
its lane and place in it, the limit that binds (a backlog at the effective
rate, a pause and why, a spent quota, the in-flight cap, a schedule), and
an estimated start; for a call that ran, when it ended, its answer and its
retries. The answer is the vendor's status and the start of its body as
stored with the call (quoted in the text; body_excerpt in --json: up to
512 bytes), and in --json the whole answer kept (answer: status, the
headers keep_headers names, the body up to max_answer), with the vendor's
and the call's header values and query values redacted. An export's
answers read back together: shaper export results. Header values and query strings are never shown: an error names
the call's path without its query.`,
		Args: cobra.ExactArgs(1),
		RunE: func(cmd *cobra.Command, args []string) error {
			return withClient(cmd, func(ctx context.Context, _ *config.Config, _ redis.UniversalClient, c *queue.Client) error {
				ex, err := c.ExplainVendor(ctx, vendor, args[0])
				if errors.Is(err, queue.ErrNoTask) {
					return fmt.Errorf("%w: check the id (shaper enqueue prints it)", err)
				}
				if err != nil {
					return err
				}
				if asJSON {
					enc := json.NewEncoder(cmd.OutOrStdout())
					enc.SetIndent("", "  ")
					return enc.Encode(ex)
				}
				printExplanation(cmd.OutOrStdout(), ex, time.Now())
				return nil
			})
		},
	}
	cmd.Flags().BoolVar(&asJSON, "json", false, "print JSON")
	cmd.Flags().StringVar(&vendor, "vendor", "", "the call's vendor: needed only for an id that calls of more than one vendor carry (ids are per vendor)")
	return cmd
}

func printExplanation(w io.Writer, ex queue.Explanation, now time.Time) {
	who := ex.Vendor
	if ex.Account != "" {
		who += ", account " + ex.Account
	}
	fmt.Fprintf(w, "task %s (%s, %s lane): %s\n", ex.TaskID, who, ex.Lane, ex.State)
	if ex.Place > 0 {
		fmt.Fprintf(w, "  place %d in its lane, %d calls start before it\n", ex.Place, ex.Ahead)
	}
	fmt.Fprintf(w, "  %s: %s\n", ex.Binding, ex.Reason)
	if ex.EstimatedStart != nil {
		fmt.Fprintf(w, "  estimated start: %s (in %s)\n", ex.EstimatedStart.Format(time.RFC3339), max(ex.EstimatedStart.Sub(now), 0).Round(100*time.Millisecond))
	}
	if ex.Status > 0 {
		fmt.Fprintf(w, "  answer: HTTP %d: %q\n", ex.Status, ex.Body)
	}
	if ex.Retried > 0 || ex.LastError != "" {
		fmt.Fprintf(w, "  retried %d times; last error: %s\n", ex.Retried, ex.LastError)
	}
}
