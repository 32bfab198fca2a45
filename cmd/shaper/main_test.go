package main

import (
	"bytes"
	"errors"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strings"
	"testing"
)

func runCLI(t *testing.T, args ...string) (string, error) {
	t.Helper()
	cmd := newRootCmd()
	var out bytes.Buffer
	cmd.SetOut(&out)
	cmd.SetErr(&out)
	cmd.SetArgs(args)
	err := cmd.Execute()
	return out.String(), err
}

func TestConfigCheck(t *testing.T) {
	out, err := runCLI(t, "config", "check", "--config", "../../config.toml")
	if err != nil {
		t.Fatalf("config check of the example: %v", err)
	}
	for _, want := range []string{"ok, 3 vendor(s)", "acme", "1 every 10.2ms", "98.04 per 1s", "5000 per 24h"} {
		if !strings.Contains(out, want) {
			t.Errorf("output lacks %q:\n%s", want, out)
		}
	}
	// The per-account vendor: a row for each account's bucket, one per
	// override and one for the total, each with its tick.
	for _, want := range []string{
		`(?m)^shop +each account +2 per 1s +1 +measured +1 every 510ms +1\.961 per 1s +100000 +no cap$`,
		`(?m)^shop +account big-store +20 per 1s +1 +measured +1 every 51ms +19\.61 per 1s +no cap$`,
		`(?m)^shop +all accounts \(total\) +40 per 1s +1 +20ms +1 every 25\.5ms +39\.22 per 1s +no cap$`,
		`(?m)^acme +the vendor +100 per 1s `,
	} {
		if !regexp.MustCompile(want).MatchString(out) {
			t.Errorf("output lacks a row matching %s:\n%s", want, out)
		}
	}
}

func TestConfigCheckPerAccount(t *testing.T) {
	path := filepath.Join(t.TempDir(), "accounts.toml")
	toml := `[vendors.plain]
base_url = "https://x"
rate = 10

[vendors.portal]
base_url = "https://{account}.portal.example/api"
per_account = true
rate = 5
burst = 5
max_in_flight = 2
account_overrides = [
  { account = "acme-eu", rate = 50, max_in_flight = 8 },
  { account = "slow", window = "1m", burst = 1 },
]
`
	if err := os.WriteFile(path, []byte(toml), 0o600); err != nil {
		t.Fatal(err)
	}
	out, err := runCLI(t, "config", "check", "--config", path)
	if err != nil {
		t.Fatalf("config check: %v", err)
	}
	for _, want := range []string{
		`(?m)^plain +the vendor +10 per 1s `,
		`(?m)^portal +each account +5 per 1s +5 +measured +5 every 1\.02s +4\.902 per 1s +100000 +2$`,
		`(?m)^portal +account acme-eu +50 per 1s +5 +measured +5 every 102ms +49\.02 per 1s +8$`,
		`(?m)^portal +account slow +5 per 1m +1 +measured +1 every 12\.004s +4\.998 per 1m +2$`,
	} {
		if !regexp.MustCompile(want).MatchString(out) {
			t.Errorf("output lacks a row matching %s:\n%s", want, out)
		}
	}
	if strings.Contains(out, "total") {
		t.Errorf("a vendor without [vendors.portal.total] printed a total:\n%s", out)
	}
}

func TestConfigCheckRejects(t *testing.T) {
	path := filepath.Join(t.TempDir(), "bad.toml")
	if err := os.WriteFile(path, []byte("[vendors.acme]\nbase_url = \"https://x\"\nrate = 10\nburst = 50\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	_, err := runCLI(t, "config", "check", "--config", path)
	if err == nil || !strings.Contains(err.Error(), "bad.toml:4") || !strings.Contains(err.Error(), "burst <= 10") {
		t.Errorf("err = %v, want the line and the fix", err)
	}
	// Per-account keys: every problem at once, each with its line.
	bad := `[vendors.shop]
base_url = "https://api.shop.example/{account}"
rate = 2
account_overrides = [ { account = "big store", rate = 20 } ]

[vendors.shop.total]
rate = 0
`
	if err := os.WriteFile(path, []byte(bad), 0o600); err != nil {
		t.Fatal(err)
	}
	_, err = runCLI(t, "config", "check", "--config", path)
	for _, want := range []string{
		"bad.toml:2: invalid config: vendors.shop.base_url", "add per_account = true",
		"bad.toml:4: invalid config: vendors.shop.account_overrides: needs per_account = true",
		`bad.toml:4: invalid config: vendors.shop.account_overrides item 1 (account "big store")`,
		"bad.toml:6: invalid config: vendors.shop.total: needs per_account = true",
		"bad.toml:7: invalid config: vendors.shop.total.rate: 0: must be at least 1",
	} {
		if err == nil || !strings.Contains(err.Error(), want) {
			t.Errorf("err = %v\nwant it to contain %q", err, want)
		}
	}
	if _, err := runCLI(t, "config", "check", "--config", filepath.Join(t.TempDir(), "missing.toml")); err == nil {
		t.Error("a missing file was accepted")
	}
}

// TestMissingConfigNamesTheFlag: a command run where there is no
// config.toml, or given a --config path that does not exist, says which
// file is missing and names --config.
func TestMissingConfigNamesTheFlag(t *testing.T) {
	t.Parallel()
	dir := t.TempDir()
	missing := filepath.Join(dir, "nope.toml")
	for _, tc := range []struct {
		name string
		args []string
		want []string
	}{
		{"default path", []string{"stats"}, []string{
			"shaper: config file config.toml not found in ", "pass --config PATH (or run in the directory that holds config.toml)"}},
		{"config check", []string{"config", "check"}, []string{"config file config.toml not found", "pass --config PATH"}},
		{"a path given", []string{"worker", "--config", missing}, []string{
			"shaper: config file " + missing + " not found: check the path given to --config"}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			cmd := exec.Command(shaperBin(t), tc.args...)
			cmd.Dir = dir
			out, err := cmd.CombinedOutput()
			if err == nil {
				t.Fatalf("succeeded without a config file:\n%s", out)
			}
			for _, w := range tc.want {
				if !strings.Contains(string(out), w) {
					t.Errorf("output lacks %q:\n%s", w, out)
				}
			}
			if strings.Contains(string(out), "no such file or directory") {
				t.Errorf("output still has the bare open error:\n%s", out)
			}
		})
	}
}

func TestExplainLeavesOtherErrorsAlone(t *testing.T) {
	err := errors.New("boom")
	if got := explain(err); got != err {
		t.Errorf("explain(%v) = %v", err, got)
	}
}
