package main

import (
	"encoding/json"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/shaper-dev/shaper/internal/redistest"
	"github.com/shaper-dev/shaper/internal/report"
)

// TestEnqueueAccounts: the CLI names a call's account with --account or
// "account" in a call line; a per-account vendor refuses a call without
// one, a file with bad lines is refused whole with their line numbers.
func TestEnqueueAccounts(t *testing.T) {
	t.Parallel()
	vendor := "shop-" + redistest.Prefix(t)[5:]
	cfg := filepath.Join(t.TempDir(), "config.toml")
	err := os.WriteFile(cfg, []byte(`[redis]
addr = "`+redistest.Addr(t)+`"

[vendors.`+vendor+`]
base_url = "https://api.shop.example/stores/{account}"
rate = 2
per_account = true
`), 0o600)
	if err != nil {
		t.Fatal(err)
	}
	if out, err := runShaper(t, "", "enqueue", "--config", cfg, "--vendor", vendor, "--path", "/orders"); err == nil || !strings.Contains(out, "needs an account") {
		t.Errorf("a call without an account: %v\n%s", err, out)
	}
	if out, err := runShaper(t, "", "enqueue", "--config", cfg, "--vendor", vendor, "--account", "store-1", "--path", "/orders"); err != nil {
		t.Errorf("a call with --account: %v\n%s", err, out)
	}
	lines := `{"path":"/a"}
{"path":"/b","account":"store-2"}
{"path":"/c","account":"bad account"}
`
	out, err := runShaper(t, lines, "enqueue", "--config", cfg, "--vendor", vendor, "--account", "store-1", "--file", "-")
	if err == nil || !strings.Contains(out, "stdin:3:") || strings.Contains(out, "stdin:1:") || !strings.Contains(out, "nothing was enqueued") {
		t.Errorf("a file with a bad account on line 3: %v\n%s", err, out)
	}
	out, err = runShaper(t, lines[:strings.LastIndex(lines[:len(lines)-1], "\n")+1], "enqueue", "--config", cfg, "--vendor", vendor, "--account", "store-1", "--file", "-")
	if err != nil || !strings.Contains(out, "enqueued 2") {
		t.Errorf("a file whose first line takes --account: %v\n%s", err, out)
	}
	// stats: the accounts with a backlog, longest first, and one account.
	var many strings.Builder
	for i := range 20 {
		fmt.Fprintf(&many, "{\"path\":\"/o/%d\",\"account\":\"store-9\"}\n", i)
	}
	if out, err := runShaper(t, many.String(), "enqueue", "--config", cfg, "--vendor", vendor, "--file", "-"); err != nil {
		t.Fatalf("enqueue 20 calls for store-9: %v\n%s", err, out)
	}
	out, err = runShaper(t, "", "stats", "--config", cfg, "--json", "--accounts", "3", "--account", "store-9")
	if err != nil {
		t.Fatalf("stats: %v\n%s", err, out)
	}
	var rep StatsReport
	if err := json.Unmarshal([]byte(out), &rep); err != nil {
		t.Fatalf("stats --json: %v\n%s", err, out)
	}
	vs := rep.Vendors[0]
	if vs.AccountsWithBacklog == nil || *vs.AccountsWithBacklog < 1 || len(vs.TopAccounts) == 0 || vs.TopAccounts[0].Account != "store-9" ||
		vs.TopAccounts[0].BacklogSeconds < 5 || vs.Account == nil || vs.Account.Account != "store-9" || vs.Account.ConfiguredRate != 1.96 {
		t.Errorf("stats of a per-account vendor: %s", out)
	}
}

// TestStatsShowsTheTotalAndTheShare: a per-account vendor with a total.
// stats shows the total, and for --account both the account's own limit
// and the least it gets of the total while the accounts with a backlog
// share it.
func TestStatsShowsTheTotalAndTheShare(t *testing.T) {
	t.Parallel()
	vendor := "tot-" + redistest.Prefix(t)[5:]
	cfg := filepath.Join(t.TempDir(), "config.toml")
	err := os.WriteFile(cfg, []byte(`[redis]
addr = "`+redistest.Addr(t)+`"

[vendors.`+vendor+`]
base_url = "https://api.shop.example/stores/{account}"
rate = 20
per_account = true

[vendors.`+vendor+`.total]
rate = 30
`), 0o600)
	if err != nil {
		t.Fatal(err)
	}
	var lines strings.Builder
	for i := range 40 {
		fmt.Fprintf(&lines, "{\"path\":\"/o/%d\",\"account\":\"store-%d\"}\n", i, i%2)
	}
	if out, err := runShaper(t, lines.String(), "enqueue", "--config", cfg, "--vendor", vendor, "--file", "-"); err != nil {
		t.Fatalf("enqueue: %v\n%s", err, out)
	}
	out, err := runShaper(t, "", "stats", "--config", cfg, "--json", "--account", "store-0")
	if err != nil {
		t.Fatalf("stats --json: %v\n%s", err, out)
	}
	var rep StatsReport
	if err := json.Unmarshal([]byte(out), &rep); err != nil {
		t.Fatalf("stats --json: %v\n%s", err, out)
	}
	vs := rep.Vendors[0]
	if vs.Total == nil || vs.Total.Rate != 30 || vs.Total.EffectiveRate != 29.41 || vs.ConfigRate != 20 {
		t.Fatalf("the total in stats --json: %s", out)
	}
	a := vs.Account
	n := *vs.AccountsWithBacklog
	if a == nil || a.ConfigRate != 20 || a.ConfiguredRate != 19.61 || a.ShareRate == nil || n < 1 ||
		*a.ShareRate != report.Round2(min(19.61, 29.41/float64(n))) {
		t.Fatalf("the account's share in stats --json (%d accounts with a backlog): %s", n, out)
	}
	out, err = runShaper(t, "", "stats", "--config", cfg, "--account", "store-0")
	flat := strings.Join(strings.Fields(out), " ")
	for _, want := range []string{
		vendor + ": total 30 per 1s over all accounts, at most 29.41/s with the 20ms guard",
		"account store-0: rate 19.61/s; its own limit 20 per 1s, at most 19.61/s with its guard; its share of the total: at least " +
			report.PerWindow(*a.ShareRate, time.Second),
	} {
		if err != nil || !strings.Contains(flat, want) {
			t.Errorf("stats lacks %q: %v\n%s", want, err, out)
		}
	}
}
