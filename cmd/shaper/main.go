// Command shaper is the CLI of shaper, an outbound traffic-shaping job
// runner: calls to each vendor wait their turn in a queue and start
// on a tick shared by every worker replica through Redis.
package main

import (
	"errors"
	"fmt"
	"os"
	"path/filepath"

	"github.com/spf13/cobra"

	"github.com/shaper-dev/shaper/config"
)

func main() {
	if err := newRootCmd().Execute(); err != nil {
		fmt.Fprintln(os.Stderr, "shaper:", explain(err))
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
	root.AddCommand(newConfigCmd(), newWorkerCmd(), newEnqueueCmd(), newExportCmd(), newMockVendorCmd(), newDemoCmd(), newStatsCmd(), newExplainCmd(), newUICmd(), newServeCmd())
	return root
}

// explain adds what to do to an error that stops a command, where the
// fix is one of the CLI's flags: a missing config file names --config.
func explain(err error) error {
	var nf *config.NotFoundError
	if !errors.As(err, &nf) {
		return err
	}
	if filepath.Base(nf.Path) == nf.Path {
		return fmt.Errorf("%w: pass --config PATH (or run in the directory that holds %s)", err, nf.Path)
	}
	return fmt.Errorf("%w: check the path given to --config", err)
}
