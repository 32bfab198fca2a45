package main

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"sort"
	"text/tabwriter"
	"time"

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
	Vendor         string  `json:"vendor"`
	ConfiguredRate float64 `json:"configured_rate"`
	EffectiveRate  float64 `json:"effective_rate"`
	Window         string  `json:"window"`
	RateSource     string  `json:"rate_source"`
	RateReason     string  `json:"rate_reason"`
	// Source is what sets the effective rate now: configured, announced,
	// learned, set, margin (a guard learned from 429s) or warmup.
	Source                string  `json:"source"`
	GuardSeconds          float64 `json:"guard_seconds"`
	GuardReason           string  `json:"guard_reason,omitempty"`
	WarmingForSeconds     float64 `json:"warming_for_seconds,omitempty"`
	Queued                int64   `json:"queued"`
	InFlight              int64   `json:"in_flight"`
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
}

// AccountStats is an account with a backlog: its last planned call is due
// in BacklogSeconds (about its backlog at its pace).
type AccountStats struct {
	Account        string  `json:"account"`
	BacklogSeconds float64 `json:"backlog_seconds"`
}

// AccountDetails is one account of a per-account vendor (--account).
type AccountDetails struct {
	Account          string  `json:"account"`
	EffectiveRate    float64 `json:"effective_rate"`
	ConfiguredRate   float64 `json:"configured_rate"`
	RateSource       string  `json:"rate_source"`
	RateReason       string  `json:"rate_reason"`
	NextTickSeconds  float64 `json:"next_tick_seconds"`
	PausedForSeconds float64 `json:"paused_for_seconds"`
	PauseReason      string  `json:"pause_reason"`
	// Quotas is each of the account's own quotas (see VendorStats).
	Quotas []QuotaStats `json:"quotas,omitempty"`
}

// StatsReport is the whole of `shaper stats --json`.
type StatsReport struct {
	At      time.Time     `json:"at"`
	Vendors []VendorStats `json:"vendors"`
}

func newStatsCmd() *cobra.Command {
	var asJSON, watch bool
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
						printStats(out, rep)
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
			Vendor: v.Name, ConfiguredRate: round2(st.ConfiguredRate), EffectiveRate: round2(st.EffectiveRate),
			Window: durations.Format(v.Window), RateSource: st.RateSource, RateReason: st.RateReason,
			Source: st.Source, GuardSeconds: st.Guard.Seconds(), GuardReason: st.GuardReason, WarmingForSeconds: round2(st.WarmingFor.Seconds()),
			Queued: qs.Pending + qs.Scheduled, InFlight: qs.Active, Retrying: qs.Retry,
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

func printStats(w io.Writer, rep StatsReport) {
	tw := tabwriter.NewWriter(w, 0, 0, 2, ' ', 0)
	fmt.Fprintln(tw, "VENDOR\tRATE (EFFECTIVE/CONFIGURED)\tQUEUED\tIN FLIGHT\tRETRYING\tGRANTED 1m/TOTAL\t429s 1m/TOTAL\tNEXT TICK\tOLDEST\tPAUSED")
	for _, v := range rep.Vendors {
		rate := fmt.Sprintf("%.4g/%.4g per %s", v.EffectiveRate, v.ConfiguredRate, v.Window)
		if v.RateSource != "" {
			rate += fmt.Sprintf(" (%s: %s)", v.RateSource, v.RateReason)
		}
		if v.GuardReason != "" {
			rate += fmt.Sprintf(" (guard %s: %s)", time.Duration(v.GuardSeconds*float64(time.Second)).Round(time.Millisecond), v.GuardReason)
		}
		if v.WarmingForSeconds > 0 {
			rate += fmt.Sprintf(" (warming up, %s left)", time.Duration(v.WarmingForSeconds*float64(time.Second)).Round(100*time.Millisecond))
		}
		if v.Source != "" && v.Source != "configured" {
			rate += " [set by: " + v.Source + "]"
		}
		if len(v.ReplicaRates) > 0 {
			rate += fmt.Sprintf(" [replicas disagree: %v; the lowest applies]", v.ReplicaRates)
		}
		paused := "-"
		if v.PausedForSeconds > 0 {
			paused = fmt.Sprintf("%s (%s)", (time.Duration(v.PausedForSeconds * float64(time.Second))).Round(time.Second), v.PauseReason)
		}
		fmt.Fprintf(tw, "%s\t%s\t%d\t%d\t%d\t%d/%d\t%d/%d\t%s\t%s\t%s\n", v.Vendor, rate, v.Queued, v.InFlight, v.Retrying,
			v.GrantedLastMinute, v.GrantedTotal, v.RateLimitedLastMinute, v.RateLimitedTotal,
			time.Duration(v.NextTickSeconds*float64(time.Second)).Round(time.Millisecond),
			time.Duration(v.OldestQueuedSeconds*float64(time.Second)).Round(time.Second), paused)
	}
	tw.Flush()
	for _, v := range rep.Vendors {
		for _, q := range v.Quotas {
			next := "now"
			if q.NextCallSeconds > 0 {
				next = "in " + time.Duration(q.NextCallSeconds*float64(time.Second)).Round(time.Second).String()
			}
			fmt.Fprintf(w, "\n%s: quota %s: %d used, %d left, next call %s", v.Vendor, q.Limit, q.Used, q.Left, next)
		}
		if len(v.Quotas) > 0 {
			fmt.Fprintln(w)
		}
	}
	for _, v := range rep.Vendors {
		if v.AccountsWithBacklog == nil {
			continue
		}
		fmt.Fprintf(w, "\n%s: %d account(s) with a backlog", v.Vendor, *v.AccountsWithBacklog)
		for i, a := range v.TopAccounts {
			sep := ", longest: "
			if i > 0 {
				sep = ", "
			}
			fmt.Fprintf(w, "%s%s (%s)", sep, a.Account, time.Duration(a.BacklogSeconds*float64(time.Second)).Round(time.Second))
		}
		fmt.Fprintln(w)
		if a := v.Account; a != nil {
			fmt.Fprintf(w, "  account %s: rate %.4g/%.4g per %s", a.Account, a.EffectiveRate, a.ConfiguredRate, v.Window)
			if a.RateSource != "" {
				fmt.Fprintf(w, " (%s: %s)", a.RateSource, a.RateReason)
			}
			fmt.Fprintf(w, ", next tick in %s", time.Duration(a.NextTickSeconds*float64(time.Second)).Round(time.Millisecond))
			for _, q := range a.Quotas {
				fmt.Fprintf(w, ", quota %s: %d used, %d left", q.Limit, q.Used, q.Left)
			}
			if a.PausedForSeconds > 0 {
				fmt.Fprintf(w, ", paused %s (%s)", time.Duration(a.PausedForSeconds*float64(time.Second)).Round(time.Second), a.PauseReason)
			}
			fmt.Fprintln(w)
		}
	}
}

// accountStats fills the per-account figures of vendor v.
func accountStats(ctx context.Context, gate *shaper.Gate, v config.Vendor, vs *VendorStats, topN int, account string) error {
	grp, err := gate.Group(v.Name, v.TotalPolicy())
	if err != nil {
		return err
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
	b, err := grp.Bucket(account, v.AccountPolicy(account))
	if err != nil {
		return err
	}
	st, err := b.Stats(ctx)
	if err != nil {
		return err
	}
	vs.Account = &AccountDetails{Account: account, EffectiveRate: round2(st.EffectiveRate), ConfiguredRate: round2(st.ConfiguredRate),
		RateSource: st.RateSource, RateReason: st.RateReason, NextTickSeconds: st.NextTick.Seconds(),
		PausedForSeconds: st.PausedFor.Seconds(), PauseReason: st.PauseReason, Quotas: quotaStats(st.Limits)}
	return nil
}
