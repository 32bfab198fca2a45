package main

import (
	"bytes"
	"encoding/json"
	"regexp"
	"strings"
	"testing"
	"unicode/utf8"
)

// statsSample is a report with what makes the table wide: a learned rate
// with its reason, a measured guard, a pause, replicas that disagree, a
// quota, a per-account vendor with a total and an account's detail.
func statsSample() StatsReport {
	n := int64(3)
	share := 13.07
	return StatsReport{Vendors: []VendorStats{
		{Name: "logistics-eu-prod", ConfigRate: 20, ConfiguredRate: 19.61, EffectiveRate: 19.5, Window: "1s",
			RateSource: "learned", Source: "learned",
			RateReason:   "429 without rate-limit headers at 20.0/s: the largest consistent limit is 19.8/s; probing halfway to it after 3 windows",
			GuardSeconds: 0.045, ConfigGuardSeconds: 0.02, GuardReason: "measured: calls start within 3.2ms of their tick (tolerance), round trips spread 1.1ms",
			Queued: 123456, InFlight: 1000, Requeued: 98765, Retrying: 98765, GrantedLastMinute: 1176, GrantedTotal: 1234567,
			RateLimitedLastMinute: 12, RateLimitedTotal: 3456, PausedForSeconds: 12.3, PausedUntil: "2026-12-03T08:00:12Z",
			PauseReason: "HTTP 429, Retry-After: 12", NextTickSeconds: 12.345, OldestQueuedSeconds: 3725,
			ReplicaRates: []float64{9.8, 19.61}, QueuedHigh: 7,
			Quotas: []QuotaStats{{Limit: "5000 per 24h", Rate: 5000, Window: "24h", Used: 4990, Left: 10, NextCallSeconds: 0}}},
		{Name: "acme", ConfigRate: 20, ConfiguredRate: 19.61, EffectiveRate: 19.61, Window: "1s", Source: "configured",
			GuardSeconds: 0.02, ConfigGuardSeconds: 0.02, GrantedLastMinute: 340, GrantedTotal: 400},
		{Name: "shop", ConfigRate: 20, ConfiguredRate: 19.61, EffectiveRate: 19.61, Window: "1s", Source: "configured",
			GuardSeconds: 0.02, ConfigGuardSeconds: 0.02, AccountsWithBacklog: &n,
			TopAccounts: []AccountStats{{Account: "store-9", BacklogSeconds: 95}, {Account: "store-1", BacklogSeconds: 3}},
			Total:       &TotalStats{Rate: 40, Window: "1s", EffectiveRate: 39.22, Limits: []string{"100000 per 24h"}},
			Account: &AccountDetails{Account: "store-9", EffectiveRate: 19.61, ConfigRate: 20, ConfiguredRate: 19.61, Window: "1s",
				ShareRate: &share, NextTickSeconds: 0.051}},
	}}
}

// TestStatsTable: the table keeps to 100 columns however long the
// reasons, which go below it in full; LIMIT shows the rate as configured
// (20/s, not 19.61 after the guard) and the guard is said; REQUEUED
// replaces RETRYING; a vendor's total and an account's share of it are
// shown; the legend says what each column is.
func TestStatsTable(t *testing.T) {
	var b bytes.Buffer
	printStats(&b, statsSample(), true)
	out := b.String()
	t.Logf("\n%s", out)
	for i, line := range strings.Split(out, "\n") {
		if n := utf8.RuneCountInString(line); n > statsWidth {
			t.Errorf("line %d is %d columns wide, want <= %d: %q", i+1, n, statsWidth, line)
		}
	}
	for _, want := range []string{
		`(?m)^VENDOR +RATE +LIMIT +QUEUED +IN FLIGHT +REQUEUED +GRANTED +429s +NEXT +OLDEST +PAUSED$`,
		`(?m)^logistics-eu-prod +19\.5/s +20/s +123456 +1000 +98765 +1176 +12 +12\.3s +1h2m5s +12s$`,
		`(?m)^acme +19\.61/s +20/s +0 +0 +0 +340 +0 +0s +0s +-$`,
		`(?m)^acme: limit 20 per 1s, at most 19\.61/s with the 20ms guard; 400 granted, 0 429s in all$`,
		`(?m)^logistics-eu-prod: rate 19\.5/s learned — 429 without rate-limit headers at 20\.0/s: the largest`,
		`(?m)^logistics-eu-prod: limit 20 per 1s, at most 19\.61/s with the 20ms guard; 1234567 granted, 3456`,
		`(?m)^logistics-eu-prod: guard 45ms in force — measured: calls start within 3\.2ms`,
		`(?m)^logistics-eu-prod: paused 12s \(until 2026-12-03T08:00:12Z\) — HTTP 429, Retry-After: 12$`,
		`(?m)^logistics-eu-prod: replicas disagree on the configured rate: 9\.8/s, 19\.61/s; the lowest applies$`,
		`(?m)^logistics-eu-prod: quota 5000 per 24h: 4990 used, 10 left, next call now$`,
		`(?m)^shop: limit 20 per 1s for each account, at most 19\.61/s with the 20ms guard; 0 granted, 0 429s`,
		`(?m)^shop: total 40 per 1s over all accounts, at most 39\.22/s with the 20ms guard, and 100000 per 24h$`,
		`(?m)^shop: 3 account\(s\) with a backlog, longest: store-9 \(1m35s\), store-1 \(3s\)$`,
		`(?m)^shop: account store-9: rate 19\.61/s; its own limit 20 per 1s, at most 19\.61/s with its guard;`,
		`its\s+share of the total: at least 13\.07/s while 3 account\(s\) have a backlog`,
		`(?m)^REQUEUED +calls sent back to the queue to wait their turn: a tick beyond max_wait or a 429 \(not$`,
		`(?m)^GRANTED +ticks granted in about the last 60 s: this clock minute's count plus the previous`,
	} {
		if !regexp.MustCompile(want).MatchString(out) {
			t.Errorf("output lacks a line matching %s", want)
		}
	}
	// Nothing important is cut: every reason is there in full, across
	// its wrapped lines.
	flat := strings.Join(strings.Fields(out), " ")
	for _, v := range statsSample().Vendors {
		for _, s := range []string{v.RateReason, v.GuardReason, v.PauseReason} {
			if !strings.Contains(flat, strings.Join(strings.Fields(s), " ")) {
				t.Errorf("a reason is cut: %q", s)
			}
		}
	}
	if strings.Contains(out, "RETRYING") || strings.Contains(out, "20/19.61") {
		t.Errorf("the old RETRYING column or the rate after the guard as configured is still there")
	}
	b.Reset()
	printStats(&b, statsSample(), false)
	if strings.Contains(b.String(), "REQUEUED   calls") {
		t.Errorf("--no-legend printed the legend:\n%s", b.String())
	}
}

// TestStatsJSONOnlyAdds: the --json shape keeps every field it had
// (retrying, configured_rate after the guard) and adds the new ones.
func TestStatsJSONOnlyAdds(t *testing.T) {
	data, err := json.Marshal(statsSample())
	if err != nil {
		t.Fatal(err)
	}
	for _, want := range []string{`"retrying":98765`, `"requeued":98765`, `"configured_rate":19.61`, `"config_rate":20`,
		`"total":{"rate":40,"window":"1s","effective_rate":39.22,"limits":["100000 per 24h"]}`, `"share_rate":13.07`,
		`"granted_last_minute":1176`, `"rate_reason":`} {
		if !strings.Contains(string(data), want) {
			t.Errorf("--json lacks %s:\n%s", want, data)
		}
	}
}
