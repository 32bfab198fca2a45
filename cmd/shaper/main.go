// Command shaper is the CLI of shaper, an outbound traffic-shaping job
// runner: calls to each vendor wait their turn in a queue and start
// on a tick shared by every worker replica through Redis.
package main

import (
	"fmt"
	"os"

	"github.com/spf13/cobra"
)

func main() {
	if err := newRootCmd().Execute(); err != nil {
		fmt.Fprintln(os.Stderr, "shaper:", err)
		os.Exit(1)
	}
}

func newRootCmd() *cobra.Command {
	root := &cobra.Command{
		Use:           "shaper",
		Short:         "Shape outbound calls to rate-limited vendor APIs across worker replicas",
		SilenceUsage:  true,
		SilenceErrors: true,
	}
	root.PersistentFlags().String("config", "config.toml", "config file")
	root.AddCommand(newConfigCmd(), newWorkerCmd(), newEnqueueCmd(), newExportCmd(), newMockVendorCmd(), newDemoCmd(), newStatsCmd())
	return root
}
