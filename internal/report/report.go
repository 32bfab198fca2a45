// Package report reads what `shaper stats` and the live page show: per
// vendor, the gate's rates and why, its queue, pauses, quotas and 429s,
// and for a per-account vendor its accounts. Its types are the stable
// shape of `shaper stats --json`: fields are only ever added.
package report

import (
	"context"
	"strconv"
	"time"

	"github.com/shaper-dev/shaper/config"
	"github.com/shaper-dev/shaper/internal/durations"
	"github.com/shaper-dev/shaper/internal/gatehook"
	"github.com/shaper-dev/shaper/queue"
	"github.com/shaper-dev/shaper/shaper"
)

// VendorState is one vendor in `shaper stats --json`. The shape is stable:
// fields are only ever added.
type VendorState struct {
	Name string `json:"vendor"`
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
	Requeued          int64 `json:"requeued"`
	Retrying          int64 `json:"retrying"`
	GrantedLastMinute int64 `json:"granted_last_minute"`
	GrantedTotal      int64 `json:"granted_total"`
	// GivenUpTotal counts the ticks granted and given up unused: a
	// caller woke later than its tolerance, a pause began, or the server
	// may have changed since the grant (each such call asked again).
	GivenUpTotal          int64   `json:"given_up_total"`
	RateLimitedLastMinute int64   `json:"rate_limited_last_minute"`
	RateLimitedTotal      int64   `json:"rate_limited_total"`
	PausedForSeconds      float64 `json:"paused_for_seconds"`
	PausedUntil           string  `json:"paused_until,omitempty"`
	PauseReason           string  `json:"pause_reason"`
	// PausesTotal counts the pauses set or extended; LastPauseUntil and
	// LastPauseReason are the latest one's end and reason, kept after it
	// ends.
	PausesTotal     int64  `json:"pauses_total"`
	LastPauseUntil  string `json:"last_pause_until,omitempty"`
	LastPauseReason string `json:"last_pause_reason,omitempty"`
	// RedisTime is when the gate's state was read, by Redis's clock.
	RedisTime           time.Time `json:"redis_time"`
	NextTickSeconds     float64   `json:"next_tick_seconds"`
	OldestQueuedSeconds float64   `json:"oldest_queued_seconds"`
	// Stalled counts the calls held by a worker that has not renewed
	// their lease for over 10 s (it died, or lost Redis): asynq gives
	// them back once the lease is 30 s past due; StalledForSeconds is
	// the longest since a renewal.
	Stalled           int64   `json:"stalled"`
	StalledForSeconds float64 `json:"stalled_for_seconds,omitempty"`
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
	AccountsWithBacklog *int64           `json:"accounts_with_backlog,omitempty"`
	TopAccounts         []AccountBacklog `json:"top_accounts,omitempty"`
	Account             *AccountDetails  `json:"account,omitempty"`
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

// AccountBacklog is an account with a backlog: its last planned call is due
// in BacklogSeconds (about its backlog at its pace).
type AccountBacklog struct {
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
	// Quotas is each of the account's own quotas (see Vendor).
	Quotas []QuotaStats `json:"quotas,omitempty"`
}

// Report is the whole of `shaper stats --json`.
type Report struct {
	At      time.Time     `json:"at"`
	Vendors []VendorState `json:"vendors"`
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

// quotaStats is each quota's use of its window.
func quotaStats(use []shaper.LimitUse) []QuotaStats {
	var out []QuotaStats
	for _, u := range use {
		if u.Quota {
			out = append(out, QuotaStats{Limit: u.Limit.String(), Rate: u.Limit.Rate, Window: durations.Format(u.Limit.Window),
				Used: u.Used, Left: u.Left, NextCallSeconds: Round2(u.NextIn.Seconds())})
		}
	}
	return out
}

// Collect reads every vendor of cfg (see VendorReport).
func Collect(ctx context.Context, cfg *config.Config, gate *shaper.Gate, c *queue.Client, topN int, account string) (Report, error) {
	rep := Report{At: time.Now().UTC(), Vendors: []VendorState{}}
	for _, v := range cfg.Vendors {
		vs, err := VendorReport(ctx, v, gate, c, topN, account)
		if err != nil {
			return rep, err
		}
		rep.Vendors = append(rep.Vendors, vs)
	}
	return rep, nil
}

// VendorReport reads vendor v: its gate's state, its queue and, for a
// per-account vendor, its total, the topN accounts with the longest
// backlog and account's own figures (account "": none).
func VendorReport(ctx context.Context, v config.Vendor, gate *shaper.Gate, c *queue.Client, topN int, account string) (VendorState, error) {
	b, err := gate.Bucket(v.Name, v.Policy())
	if err != nil {
		return VendorState{}, err
	}
	st, err := b.Stats(ctx)
	if err != nil {
		return VendorState{}, err
	}
	qs, err := c.QueueStats(ctx, v.Name)
	if err != nil {
		return VendorState{}, err
	}
	vs := VendorState{
		Name: v.Name, ConfigRate: v.Rate, ConfiguredRate: Round2(st.ConfiguredRate), EffectiveRate: Round2(st.EffectiveRate),
		Window: durations.Format(v.Window), RateSource: st.RateSource, RateReason: st.RateReason,
		Source: st.Source, GuardSeconds: st.Guard.Seconds(), ConfigGuardSeconds: v.Guard.Seconds(), GuardMeasured: v.GuardMeasured,
		GuardReason: st.GuardReason, WarmingForSeconds: Round2(st.WarmingFor.Seconds()),
		Queued: qs.Pending + qs.Scheduled, InFlight: qs.Active, Requeued: qs.Retry, Retrying: qs.Retry,
		GrantedLastMinute: st.GrantedLastMinute, GrantedTotal: st.Granted, GivenUpTotal: st.Late + st.Dropped,
		RateLimitedLastMinute: st.RateLimitedLastMinute, RateLimitedTotal: st.RateLimited,
		PausedForSeconds: st.PausedFor.Seconds(), PauseReason: st.PauseReason,
		PausesTotal: st.Pauses, LastPauseReason: st.LastPauseReason, RedisTime: st.At.UTC(),
		NextTickSeconds: st.NextTick.Seconds(), OldestQueuedSeconds: qs.Oldest.Seconds(),
		QueuedHigh: qs.HighPending, Quotas: quotaStats(st.Limits),
		Stalled: qs.Stalled, StalledForSeconds: qs.StalledFor.Seconds(),
	}
	if !st.LastPauseUntil.IsZero() {
		vs.LastPauseUntil = st.LastPauseUntil.UTC().Format(time.RFC3339Nano)
	}
	if st.PausedFor > 0 {
		vs.PausedUntil = time.Now().UTC().Add(st.PausedFor).Format(time.RFC3339)
	}
	// While replicas disagree (a rolling edit), the gate spaces by the
	// widest tick one of them asked under lately: show it beside this
	// config's.
	if w, ok, err := gatehook.Widest(ctx, b); err == nil && ok {
		mine, wide := Round2(st.ConfiguredRate), Round2(shaper.EffectiveRate(w.Interval, w.Burst, v.Window))
		if mine != wide {
			vs.ReplicaRates = []float64{min(mine, wide), max(mine, wide)}
		}
	}
	if v.PerAccount {
		if err := accounts(ctx, gate, v, &vs, topN, account); err != nil {
			return VendorState{}, err
		}
	}
	return vs, nil
}

// PerWindow prints rate calls per window w: "19.61/s", "600/1m".
func PerWindow(rate float64, w time.Duration) string {
	unit := durations.Format(w)
	if w == time.Second {
		unit = "s"
	}
	return strconv.FormatFloat(Round2(rate), 'f', -1, 64) + "/" + unit
}

// Round2 rounds f to two decimals, as the report shows rates.
func Round2(f float64) float64 { return float64(int64(f*100+0.5)) / 100 }

// accounts fills the per-account figures of vendor v: its total, the
// accounts with a backlog and the --account detail.
func accounts(ctx context.Context, gate *shaper.Gate, v config.Vendor, vs *VendorState, topN int, account string) error {
	total := v.TotalPolicy()
	grp, err := gate.Group(v.Name, total)
	if err != nil {
		return err
	}
	var totalRate float64 // per the total's window, after the guard
	if total != nil {
		iv, burst := total.Tick()
		totalRate = shaper.EffectiveRate(iv, burst, v.Total.Window)
		vs.Total = &TotalStats{Rate: v.Total.Rate, Window: durations.Format(v.Total.Window), EffectiveRate: Round2(totalRate)}
		for _, l := range v.TotalLimits {
			vs.Total.Limits = append(vs.Total.Limits, l.String())
		}
	}
	top, n, err := gatehook.Backlogs(ctx, grp, topN)
	if err != nil {
		return err
	}
	vs.AccountsWithBacklog = &n
	for _, b := range top {
		vs.TopAccounts = append(vs.TopAccounts, AccountBacklog{Account: b.Bucket, BacklogSeconds: Round2(b.Ahead.Seconds())})
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
	vs.Account = &AccountDetails{Account: account, EffectiveRate: Round2(st.EffectiveRate), ConfigRate: p.Limits[0].Rate,
		ConfiguredRate: Round2(st.ConfiguredRate), Window: durations.Format(st.Window),
		RateSource: st.RateSource, RateReason: st.RateReason, NextTickSeconds: st.NextTick.Seconds(),
		PausedForSeconds: st.PausedFor.Seconds(), PauseReason: st.PauseReason, Quotas: quotaStats(st.Limits)}
	if total != nil {
		share := Round2(FairShare(st.EffectiveRate, totalRate*float64(st.Window)/float64(v.Total.Window), n))
		vs.Account.ShareRate = &share
	}
	return nil
}

// FairShare is the least an account whose own rate is own gets of a total
// of rate total (both per the same window) while n accounts have a
// backlog: an even split, or its own rate when that is lower.
func FairShare(own, total float64, n int64) float64 {
	return min(own, total/float64(max(n, 1)))
}
