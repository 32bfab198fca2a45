package main

import (
	"bytes"
	"os"
	"path/filepath"
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
	for _, want := range []string{"ok, 2 vendor(s)", "acme", "1 every 10.2ms", "98.04 per 1s", "5000 per 24h"} {
		if !strings.Contains(out, want) {
			t.Errorf("output lacks %q:\n%s", want, out)
		}
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
	if _, err := runCLI(t, "config", "check", "--config", filepath.Join(t.TempDir(), "missing.toml")); err == nil {
		t.Error("a missing file was accepted")
	}
}
