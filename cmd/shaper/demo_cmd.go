package main

import (
	"os"
	"os/signal"
	"syscall"
	"time"

	"github.com/spf13/cobra"

	"github.com/shaper-dev/shaper/internal/demo"
)

func newDemoCmd() *cobra.Command {
	var o demo.Options
	cmd := &cobra.Command{
		Use:   "demo",
		Short: "Run shaper end to end on this machine, beside the common alternative, and print a verdict",
		Long: `Run the quick-start demo with nothing installed: an embedded Redis, two
identical mock vendors enforcing a fixed window at a random phase, three
shaper workers on one, and on the other the usual alternative (a token
bucket per worker with burst = rate that reschedules limited tasks). It
shows live progress, then a verdict table, and ends by itself.`,
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			ctx, stop := signal.NotifyContext(cmd.Context(), os.Interrupt, syscall.SIGTERM)
			defer stop()
			_, err := demo.Run(ctx, cmd.OutOrStdout(), o)
			return err
		},
	}
	f := cmd.Flags()
	f.IntVar(&o.Calls, "calls", 1000, "calls per approach")
	f.IntVar(&o.Rate, "rate", 50, "the vendors' limit per window")
	f.DurationVar(&o.Window, "window", time.Second, "the vendors' fixed window")
	f.IntVar(&o.Workers, "workers", 3, "worker replicas per approach")
	f.DurationVar(&o.Timeout, "timeout", 40*time.Second, "stop the demo after this long, whatever happened")
	f.DurationVar(&o.Settle, "settle", 3*time.Second, "once shaper is done, stop this long after if the token bucket has already broken the limit")
	return cmd
}
