//go:build exportbar

package main

import (
	"testing"
	"time"
)

// TestExportBar is issue 42's first bar as stated (make bench-export):
// 2,000 POST calls answered with 4 KB JSON bodies, three workers, 100/s
// in fixed windows of a hidden phase, through `shaper export --wait
// --out`: every answer whole and in the file's order, no window over the
// limit, and the CLI's and the workers' peak resident memory, logged and
// held under 150 MiB.
func TestExportBar(t *testing.T) {
	run := runExportBar(t, 2000, 3)
	t.Logf("export bar: 2,000 calls in %s, %d lines in order, answers equal to the vendor's; most %d calls in a vendor window (limit 100), %d keys twice; peak RSS: CLI %d MiB, workers %d MiB (the largest of three)",
		run.elapsed.Round(time.Millisecond), len(run.lines), run.maxPerWindow, run.repeatedKeys, run.cliRSS>>10, run.workerRSS>>10)
	if run.cliRSS > 150<<10 || run.workerRSS > 150<<10 {
		t.Errorf("peak RSS: CLI %d MiB, worker %d MiB; want both under 150 MiB", run.cliRSS>>10, run.workerRSS>>10)
	}
}
