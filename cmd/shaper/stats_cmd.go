package main

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"sort"
	"strconv"
	"strings"
	"text/tabwriter"
	"time"
	"unicode/utf8"

	"github.com/redis/go-redis/v9"
	"github.com/spf13/cobra"

	"github.com/shaper-dev/shaper/config"
	"github.com/shaper-dev/shaper/internal/durations"
	"github.com/shaper-dev/shaper/queue"
	"github.com/shaper-dev/shaper/shaper"
)

// VendorStats is one vendor in `shaper stats --json`. The shape is stable:
// fields are only ever added.
type VendorStats struct {
	Vendor string `json:"vendor"`
	// ConfigRate is the rate key as the config has it (calls per
	// Window); ConfiguredRate is what the gate grants at most from it,
	// after burst and guard (GuardSeconds); EffectiveRate what it grants
	// now.
	ConfigRate     int     `json:"config_rate"`
	ConfiguredRate float64 `json:"configured_rate"`
	EffectiveRate  float64 `json:"effective_rate"`
	Window         string  `json:"window"`
	RateSource     string  `json:"rate_source"`
	RateReason     string  `json:"rate_reason"`
	// Source is what sets the effective rate now: configured, announced,
	// learned, set, margin (a guard learned from 429s) or warmup.
	Source string `json:"source"`
	// GuardSeconds is the guard in force: ConfigGuardSeconds, the config's
	// guard (GuardMeasured: guard = "measured", which follows what the
	// workers measure), or a wider one learned from 429s (GuardReason
	// says why).
	GuardSeconds       float64 `json:"guard_seconds"`
	ConfigGuardSeconds float64 `json:"config_guard_seconds"`
	GuardMeasured      bool    `json:"guard_measured,omitempty"`
	GuardReason        string  `json:"guard_reason,omitempty"`
	WarmingForSeconds  float64 `json:"warming_for_seconds,omitempty"`
	Queued             int64   `json:"queued"`
	InFlight           int64   `json:"in_flight"`
	// Requeued counts the calls sent back to the queue to wait their
	// turn: mostly for a tick beyond max_wait or a 429 (not failures),
	// and failed calls (5xx, timeouts) waiting for their retry. Retrying
	// is the same count under its first name, kept for old readers.
	Requeued              int64   `json:"requeued"`
	Retrying              int64   `json:"retrying"`
	GrantedLastMinute     int64   `json:"granted_last_minute"`
	GrantedTotal          int64   `json:"granted_total"`
	RateLimitedLastMinute int64   `json:"rate_limited_last_minute"`
	RateLimitedTotal      int64   `json:"rate_limited_total"`
	PausedForSeconds      float64 `json:"paused_for_seconds"`
	PausedUntil           string  `json:"paused_until,omitempty"`
	PauseReason           string  `json:"pause_reason"`
	NextTickSeconds       float64 `json:"next_tick_seconds"`
	OldestQueuedSeconds   float64 `json:"oldest_queued_seconds"`
	// ReplicaRates are the configured rates of live workers when they
	// disagree (a rolling config edit); the gate uses the lowest.
	ReplicaRates []float64 `json:"replica_rates,omitempty"`
	// QueuedHigh counts the calls queued in the high lane (in Queued too).
	QueuedHigh int64 `json:"queued_high"`
	// Quotas is each quota's use of its window (see "Limits as vendors
	// publish them" in the README).
	Quotas []QuotaStats `json:"quotas,omitempty"`
	// For a per-account vendor: how many accounts have calls planned
	// ahead (a backlog), the --accounts N with the longest, and the
	// --account detail.
	AccountsWithBacklog *int64          `json:"accounts_with_backlog,omitempty"`
	TopAccounts         []AccountStats  `json:"top_accounts,omitempty"`
	Account             *AccountDetails `json:"account,omitempty"`
	// Total is the vendor's total (a limit over all of its accounts
	// together), when it has one.
	Total *TotalStats `json:"total,omitempty"`
}

// TotalStats is a per-account vendor's total: Rate calls per Window as
// the config has it, EffectiveRate per Window after the guard, and its
// further limits (Limits, "N per WINDOW").
type TotalStats struct {
	Rate          int      `json:"rate"`
	Window        string   `json:"window"`
	EffectiveRate float64  `json:"effective_rate"`
	Limits        []string `json:"limits,omitempty"`
}

// AccountStats is an account with a backlog: its last planned call is due
// in BacklogSeconds (about its backlog at its pace).
type AccountStats struct {
	Account        string  `json:"account"`
	BacklogSeconds float64 `json:"backlog_seconds"`
}

// AccountDetails is one account of a per-account vendor (--account).
type AccountDetails struct {
	Account       string  `json:"account"`
	EffectiveRate float64 `json:"effective_rate"`
	// ConfigRate is the account's own rate key (its override's or the
	// vendor's), per Window; ConfiguredRate is what the gate grants at
	// most from it, after burst and guard.
	ConfigRate     int     `json:"config_rate"`
	ConfiguredRate float64 `json:"configured_rate"`
	Window         string  `json:"window"`
	// ShareRate, for a vendor with a total, is the least of the total the
	// account gets (calls per Window) while the vendor's
	// AccountsWithBacklog accounts have a backlog: the total's
	// effective rate divided among them, or the account's own
	// EffectiveRate when that is lower. The share is max-min fair: the
	// account gets more while other accounts need less than their share.
	ShareRate        *float64 `json:"share_rate,omitempty"`
	RateSource       string   `json:"rate_source"`
	RateReason       string   `json:"rate_reason"`
	NextTickSeconds  float64  `json:"next_tick_seconds"`
	PausedForSeconds float64  `json:"paused_for_seconds"`
	PauseReason      string   `json:"pause_reason"`
	// Quotas is each of the account's own quotas (see VendorStats).
	Quotas []QuotaStats `json:"quotas,omitempty"`
}

// StatsReport is the whole of `shaper stats --json`.
type StatsReport struct {
	At      time.Time     `json:"at"`
	Vendors []VendorStats `json:"vendors"`
}

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
					rep, err := collectStats(ctx, cfg, gate, c, accounts, account)
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

// QuotaStats is one quota of a bucket: its use of the last window (on the
// safe side by up to 1/60 of it), what is left, and when a call of one
// unit can go next.
type QuotaStats struct {
	Limit           string  `json:"limit"`
	Rate            int     `json:"rate"`
	Window          string  `json:"window"`
	Used            int64   `json:"used"`
	Left            int64   `json:"left"`
	NextCallSeconds float64 `json:"next_call_seconds"`
}

func quotaStats(use []shaper.LimitUse) []QuotaStats {
	var out []QuotaStats
	for _, u := range use {
		if u.Quota {
			out = append(out, QuotaStats{Limit: u.Limit.String(), Rate: u.Limit.Rate, Window: durations.Format(u.Limit.Window),
				Used: u.Used, Left: u.Left, NextCallSeconds: round2(u.NextIn.Seconds())})
		}
	}
	return out
}

func collectStats(ctx context.Context, cfg *config.Config, gate *shaper.Gate, c *queue.Client, topN int, account string) (StatsReport, error) {
	rep := StatsReport{At: time.Now().UTC(), Vendors: []VendorStats{}}
	for _, v := range cfg.Vendors {
		b, err := gate.Bucket(v.Name, v.Policy())
		if err != nil {
			return rep, err
		}
		st, err := b.Stats(ctx)
		if err != nil {
			return rep, err
		}
		qs, err := c.QueueStats(ctx, v.Name)
		if err != nil {
			return rep, err
		}
		vs := VendorStats{
			Vendor: v.Name, ConfigRate: v.Rate, ConfiguredRate: round2(st.ConfiguredRate), EffectiveRate: round2(st.EffectiveRate),
			Window: durations.Format(v.Window), RateSource: st.RateSource, RateReason: st.RateReason,
			Source: st.Source, GuardSeconds: st.Guard.Seconds(), ConfigGuardSeconds: v.Guard.Seconds(), GuardMeasured: v.GuardMeasured,
			GuardReason: st.GuardReason, WarmingForSeconds: round2(st.WarmingFor.Seconds()),
			Queued: qs.Pending + qs.Scheduled, InFlight: qs.Active, Requeued: qs.Retry, Retrying: qs.Retry,
			GrantedLastMinute: st.GrantedLastMinute, GrantedTotal: st.Granted,
			RateLimitedLastMinute: st.RateLimitedLastMinute, RateLimitedTotal: st.RateLimited,
			PausedForSeconds: st.PausedFor.Seconds(), PauseReason: st.PauseReason,
			NextTickSeconds: st.NextTick.Seconds(), OldestQueuedSeconds: qs.Oldest.Seconds(),
			QueuedHigh: qs.HighPending, Quotas: quotaStats(st.Limits),
		}
		if st.PausedFor > 0 {
			vs.PausedUntil = rep.At.Add(st.PausedFor).Format(time.RFC3339)
		}
		if reps, err := b.Control().Replicas(ctx); err == nil {
			seen := map[float64]bool{}
			for _, r := range reps {
				seen[round2(shaper.EffectiveRate(r.Interval, r.Burst, v.Window))] = true
			}
			if len(seen) > 1 {
				for r := range seen {
					vs.ReplicaRates = append(vs.ReplicaRates, r)
				}
				sort.Float64s(vs.ReplicaRates)
			}
		}
		if v.PerAccount {
			if err := accountStats(ctx, gate, v, &vs, topN, account); err != nil {
				return rep, err
			}
		}
		rep.Vendors = append(rep.Vendors, vs)
	}
	return rep, nil
}

func round2(f float64) float64 { return float64(int64(f*100+0.5)) / 100 }

// statsWidth is the widest line printStats means to print: the table
// keeps to it (reasons go to lines below it, wrapped to it).
const statsWidth = 100

// statsLegend says what each column of printStats's table is.
var statsLegend = [][2]string{
	{"RATE", "calls per window the gate grants now, all replicas together (below: why, if not LIMIT's)"},
	{"LIMIT", "the vendor's rate as the config has it; the guard spaces the ticks a little wider (below)"},
	{"QUEUED", "calls waiting in the vendor's queue (both lanes)"},
	{"IN FLIGHT", "calls a worker holds: waiting for their tick, or calling"},
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

// perWindow prints rate calls per window w: "19.61/s", "600/1m".
func perWindow(rate float64, w time.Duration) string {
	unit := durations.Format(w)
	if w == time.Second {
		unit = "s"
	}
	return strconv.FormatFloat(round2(rate), 'f', -1, 64) + "/" + unit
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
		fmt.Fprintf(tw, "%s\t%s\t%s\t%d\t%d\t%d\t%d\t%d\t%s\t%s\t%s\n", v.Vendor,
			perWindow(v.EffectiveRate, window), perWindow(float64(v.ConfigRate), window), v.Queued, v.InFlight, v.Requeued,
			v.GrantedLastMinute, v.RateLimitedLastMinute, next,
			seconds(v.OldestQueuedSeconds, time.Second), paused)
	}
	tw.Flush()
	for _, v := range rep.Vendors {
		fmt.Fprintln(w)
		for _, line := range vendorNotes(v) {
			printWrapped(w, v.Vendor+": ", line, "    ")
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
	guarded := "no guard"
	switch cg := seconds(v.ConfigGuardSeconds, 100*time.Microsecond); {
	case v.GuardMeasured:
		guarded = "the measured guard"
	case cg > 0:
		guarded = "the " + cg.String() + " guard"
	}
	each, all := "", "in all"
	if v.AccountsWithBacklog != nil { // a per-account vendor
		each, all = " for each account", "in all, all accounts together"
	}
	note("limit %d per %s%s, at most %s with %s; %d granted, %d 429s %s",
		v.ConfigRate, v.Window, each, perWindow(v.ConfiguredRate, window), guarded, v.GrantedTotal, v.RateLimitedTotal, all)
	rate := perWindow(v.EffectiveRate, window)
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
			rates[i] = perWindow(r, window)
		}
		note("replicas disagree on the configured rate: %s; the lowest applies", strings.Join(rates, ", "))
	}
	if v.PausedForSeconds > 0 {
		note("paused %s (until %s) — %s", seconds(v.PausedForSeconds, time.Second), v.PausedUntil, v.PauseReason)
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
		line := fmt.Sprintf("total %d per %s over all accounts, at most %s with %s", t.Rate, t.Window, perWindow(t.EffectiveRate, tw), guarded)
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
			a.Account, perWindow(a.EffectiveRate, aw), a.ConfigRate, a.Window, perWindow(a.ConfiguredRate, aw))
		if a.ShareRate != nil {
			line += fmt.Sprintf("; its share of the total: at least %s while %d account(s) have a backlog (more while others need less)",
				perWindow(*a.ShareRate, aw), *v.AccountsWithBacklog)
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

// accountStats fills the per-account figures of vendor v: its total, the
// accounts with a backlog and the --account detail.
func accountStats(ctx context.Context, gate *shaper.Gate, v config.Vendor, vs *VendorStats, topN int, account string) error {
	total := v.TotalPolicy()
	grp, err := gate.Group(v.Name, total)
	if err != nil {
		return err
	}
	var totalRate float64 // per the total's window, after the guard
	if total != nil {
		iv, burst := total.Tick()
		totalRate = shaper.EffectiveRate(iv, burst, v.Total.Window)
		vs.Total = &TotalStats{Rate: v.Total.Rate, Window: durations.Format(v.Total.Window), EffectiveRate: round2(totalRate)}
		for _, l := range v.TotalLimits {
			vs.Total.Limits = append(vs.Total.Limits, l.String())
		}
	}
	top, n, err := grp.Backlogs(ctx, topN)
	if err != nil {
		return err
	}
	vs.AccountsWithBacklog = &n
	for _, b := range top {
		vs.TopAccounts = append(vs.TopAccounts, AccountStats{Account: b.Bucket, BacklogSeconds: round2(b.Ahead.Seconds())})
	}
	if account == "" {
		return nil
	}
	if err := queue.CheckAccount(account); err != nil {
		return err
	}
	p := v.AccountPolicy(account)
	b, err := grp.Bucket(account, p)
	if err != nil {
		return err
	}
	st, err := b.Stats(ctx)
	if err != nil {
		return err
	}
	vs.Account = &AccountDetails{Account: account, EffectiveRate: round2(st.EffectiveRate), ConfigRate: p.Limits[0].Rate,
		ConfiguredRate: round2(st.ConfiguredRate), Window: durations.Format(st.Window),
		RateSource: st.RateSource, RateReason: st.RateReason, NextTickSeconds: st.NextTick.Seconds(),
		PausedForSeconds: st.PausedFor.Seconds(), PauseReason: st.PauseReason, Quotas: quotaStats(st.Limits)}
	if total != nil {
		share := round2(fairShare(st.EffectiveRate, totalRate*float64(st.Window)/float64(v.Total.Window), n))
		vs.Account.ShareRate = &share
	}
	return nil
}

// fairShare is the least an account whose own rate is own gets of a total
// of rate total (both per the same window) while n accounts have a
// backlog: an even split, or its own rate when that is lower.
func fairShare(own, total float64, n int64) float64 {
	return min(own, total/float64(max(n, 1)))
}
