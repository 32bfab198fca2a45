package main

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"strings"
	"text/tabwriter"
	"time"
	"unicode/utf8"

	"github.com/redis/go-redis/v9"
	"github.com/spf13/cobra"

	"github.com/shaper-dev/shaper/config"
	"github.com/shaper-dev/shaper/internal/report"
	"github.com/shaper-dev/shaper/queue"
	"github.com/shaper-dev/shaper/shaper"
)

// The stats types are report's (the shape of --json).
type (
	StatsReport    = report.Report
	VendorStats    = report.VendorState
	TotalStats     = report.TotalStats
	AccountStats   = report.AccountBacklog
	AccountDetails = report.AccountDetails
	QuotaStats     = report.QuotaStats
)

func newStatsCmd() *cobra.Command {
	var asJSON, watch, noLegend bool
	var every time.Duration
	var accounts int
	var account string
	cmd := &cobra.Command{
		Use:   "stats",
		Short: "Show each vendor's rates, queue, pauses and 429s",
		Args:  cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			return withClient(cmd, func(ctx context.Context, cfg *config.Config, rdb redis.UniversalClient, c *queue.Client) error {
				gate := shaper.NewGate(rdb, shaper.Config{})
				for {
					rep, err := report.Collect(ctx, cfg, gate, c, accounts, account)
					if err != nil {
						return err
					}
					out := cmd.OutOrStdout()
					if asJSON {
						enc := json.NewEncoder(out)
						if !watch {
							enc.SetIndent("", "  ")
						}
						if err := enc.Encode(rep); err != nil {
							return err
						}
					} else {
						if watch {
							fmt.Fprint(out, "\033[H\033[2J")
						}
						printStats(out, rep, !noLegend)
					}
					if !watch {
						return nil
					}
					select {
					case <-ctx.Done():
						return nil
					case <-time.After(every):
					}
				}
			})
		},
	}
	cmd.Flags().BoolVar(&asJSON, "json", false, "print JSON (one object; one per line with --watch)")
	cmd.Flags().BoolVar(&watch, "watch", false, "refresh until interrupted")
	cmd.Flags().BoolVar(&noLegend, "no-legend", false, "leave out the legend below the table")
	cmd.Flags().DurationVar(&every, "every", 2*time.Second, "refresh period with --watch")
	cmd.Flags().IntVar(&accounts, "accounts", 5, "per-account vendors: show this many accounts with the longest backlog")
	cmd.Flags().StringVar(&account, "account", "", "per-account vendors: show this account's rate, next tick and pause")
	return cmd
}

// statsWidth is the widest line printStats means to print: the table
// keeps to it (reasons go to lines below it, wrapped to it).
const statsWidth = 100

// statsLegend says what each column of printStats's table is.
var statsLegend = [][2]string{
	{"RATE", "calls per window the gate grants now, all replicas together (below: why, if not LIMIT's)"},
	{"LIMIT", "the vendor's rate as the config has it; the guard spaces the ticks a little wider (below)"},
	{"QUEUED", "calls waiting in the vendor's queue (both lanes)"},
	{"IN FLIGHT", "calls a worker holds: waiting for their tick, or calling (stalled ones, whose worker stopped renewing them, are said below)"},
	{"REQUEUED", "calls sent back to the queue to wait their turn: a tick beyond max_wait or a 429 (not " +
		"failures), or a failed call (5xx, timeout) waiting for its retry"},
	{"GRANTED", "ticks granted in about the last 60 s: this clock minute's count plus the previous " +
		"minute's, weighted by the part of it still inside the last 60 s as if its ticks were spread " +
		"evenly (ticks late in the previous minute are undercounted); totals are below the table"},
	{"429s", "rate-limited answers in about the last 60 s, counted as GRANTED is"},
	{"NEXT", "time until the next free tick"},
	{"OLDEST", "age of the oldest queued call"},
	{"PAUSED", "time left of a pause the vendor asked for (429, Retry-After); why, below"},
}

func seconds(s float64, round time.Duration) time.Duration {
	return time.Duration(s * float64(time.Second)).Round(round)
}

func printStats(w io.Writer, rep StatsReport, legend bool) {
	tw := tabwriter.NewWriter(w, 0, 0, 2, ' ', 0)
	fmt.Fprintln(tw, "VENDOR\tRATE\tLIMIT\tQUEUED\tIN FLIGHT\tREQUEUED\tGRANTED\t429s\tNEXT\tOLDEST\tPAUSED")
	for _, v := range rep.Vendors {
		window, _ := time.ParseDuration(v.Window)
		paused := "-"
		if v.PausedForSeconds > 0 {
			paused = seconds(v.PausedForSeconds, time.Second).String()
		}
		next := seconds(v.NextTickSeconds, time.Millisecond)
		if next >= time.Second {
			next = next.Round(100 * time.Millisecond)
		}
		fmt.Fprintf(tw, "%s\t%s\t%s\t%d\t%d\t%d\t%d\t%d\t%s\t%s\t%s\n", v.Name,
			report.PerWindow(v.EffectiveRate, window), report.PerWindow(float64(v.ConfigRate), window), v.Queued, v.InFlight, v.Requeued,
			v.GrantedLastMinute, v.RateLimitedLastMinute, next,
			seconds(v.OldestQueuedSeconds, time.Second), paused)
	}
	tw.Flush()
	for _, v := range rep.Vendors {
		fmt.Fprintln(w)
		for _, line := range vendorNotes(v) {
			printWrapped(w, v.Name+": ", line, "    ")
		}
	}
	if legend {
		fmt.Fprintln(w)
		for _, l := range statsLegend {
			printWrapped(w, fmt.Sprintf("%-10s ", l[0]), l[1], strings.Repeat(" ", 11))
		}
	}
}

// vendorNotes are the lines printStats prints below the table for v: how
// its rate follows from the config, why it is lower, its totals, pause,
// quotas, its total and its accounts.
func vendorNotes(v VendorStats) []string {
	window, _ := time.ParseDuration(v.Window)
	guard := seconds(v.GuardSeconds, 100*time.Microsecond)
	var out []string
	note := func(format string, args ...any) { out = append(out, fmt.Sprintf(format, args...)) }
	// The total is spaced with the vendor's configured guard, or the
	// default one where the accounts' guards are measured.
	guarded, totalGuarded := "no guard", "no guard"
	if cg := seconds(v.ConfigGuardSeconds, 100*time.Microsecond); cg > 0 {
		guarded = "the " + cg.String() + " guard"
		totalGuarded = guarded
	}
	if v.GuardMeasured {
		guarded = "the measured guard"
	}
	each, all := "", "in all"
	if v.AccountsWithBacklog != nil { // a per-account vendor
		each, all = " for each account", "in all, all accounts together"
	}
	note("limit %d per %s%s, at most %s with %s; %d granted, %d 429s %s",
		v.ConfigRate, v.Window, each, report.PerWindow(v.ConfiguredRate, window), guarded, v.GrantedTotal, v.RateLimitedTotal, all)
	rate := report.PerWindow(v.EffectiveRate, window)
	switch {
	case v.RateSource != "" && v.RateReason != "":
		note("rate %s %s — %s", rate, v.RateSource, v.RateReason)
	case v.RateSource != "":
		note("rate %s %s", rate, v.RateSource)
	}
	if v.Source != "" && v.Source != "configured" && v.Source != v.RateSource {
		note("rate %s now, set by: %s", rate, v.Source)
	}
	if v.GuardReason != "" {
		note("guard %s in force — %s", guard, v.GuardReason)
	}
	if v.WarmingForSeconds > 0 {
		note("warming up to the full rate, %s left", seconds(v.WarmingForSeconds, 100*time.Millisecond))
	}
	if len(v.ReplicaRates) > 0 {
		rates := make([]string, len(v.ReplicaRates))
		for i, r := range v.ReplicaRates {
			rates[i] = report.PerWindow(r, window)
		}
		note("replicas disagree on the configured rate: %s; the lowest applies", strings.Join(rates, ", "))
	}
	if v.PausedForSeconds > 0 {
		note("paused %s (until %s) — %s", seconds(v.PausedForSeconds, time.Second), v.PausedUntil, v.PauseReason)
	}
	if v.Stalled > 0 {
		note("%d calls stalled: held by a worker that has not renewed their lease for %s (it died, or lost Redis); asynq gives them back once the lease is 30 s past due",
			v.Stalled, seconds(v.StalledForSeconds, time.Second))
	}
	if v.QueuedHigh > 0 {
		note("%d of the %d queued calls are in the high lane", v.QueuedHigh, v.Queued)
	}
	for _, q := range v.Quotas {
		next := "now"
		if q.NextCallSeconds > 0 {
			next = "in " + seconds(q.NextCallSeconds, time.Second).String()
		}
		note("quota %s: %d used, %d left, next call %s", q.Limit, q.Used, q.Left, next)
	}
	if t := v.Total; t != nil {
		tw, _ := time.ParseDuration(t.Window)
		line := fmt.Sprintf("total %d per %s over all accounts, at most %s with %s", t.Rate, t.Window, report.PerWindow(t.EffectiveRate, tw), totalGuarded)
		if len(t.Limits) > 0 {
			line += ", and " + strings.Join(t.Limits, ", ")
		}
		note("%s", line)
	}
	if v.AccountsWithBacklog != nil {
		line := fmt.Sprintf("%d account(s) with a backlog", *v.AccountsWithBacklog)
		for i, a := range v.TopAccounts {
			sep := ", longest: "
			if i > 0 {
				sep = ", "
			}
			line += fmt.Sprintf("%s%s (%s)", sep, a.Account, seconds(a.BacklogSeconds, time.Second))
		}
		note("%s", line)
	}
	if a := v.Account; a != nil {
		aw, _ := time.ParseDuration(a.Window)
		line := fmt.Sprintf("account %s: rate %s; its own limit %d per %s, at most %s with its guard",
			a.Account, report.PerWindow(a.EffectiveRate, aw), a.ConfigRate, a.Window, report.PerWindow(a.ConfiguredRate, aw))
		if a.ShareRate != nil {
			line += fmt.Sprintf("; its share of the total: at least %s while %d account(s) have a backlog (more while others need less)",
				report.PerWindow(*a.ShareRate, aw), *v.AccountsWithBacklog)
		}
		if a.RateSource != "" {
			line += fmt.Sprintf("; rate %s — %s", a.RateSource, a.RateReason)
		}
		line += fmt.Sprintf("; next tick in %s", seconds(a.NextTickSeconds, time.Millisecond))
		for _, q := range a.Quotas {
			line += fmt.Sprintf("; quota %s: %d used, %d left", q.Limit, q.Used, q.Left)
		}
		if a.PausedForSeconds > 0 {
			line += fmt.Sprintf("; paused %s — %s", seconds(a.PausedForSeconds, time.Second), a.PauseReason)
		}
		note("%s", line)
	}
	return out
}

// printWrapped prints head and then text wrapped at spaces to statsWidth
// columns, the lines after the first indented by indent. A word longer
// than a line is printed whole.
func printWrapped(w io.Writer, head, text, indent string) {
	var cur strings.Builder
	cur.WriteString(head)
	width := utf8.RuneCountInString(head)
	fresh := true // nothing but head or indent on the line yet
	for _, word := range strings.Fields(text) {
		n := utf8.RuneCountInString(word)
		switch {
		case !fresh && width+1+n > statsWidth:
			fmt.Fprintln(w, cur.String())
			cur.Reset()
			cur.WriteString(indent)
			width = utf8.RuneCountInString(indent)
		case !fresh:
			cur.WriteByte(' ')
			width++
		}
		cur.WriteString(word)
		width += n
		fresh = false
	}
	fmt.Fprintln(w, cur.String())
}
