package config

import (
	"bytes"
	"context"
	"fmt"
	"log/slog"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"
)

func vendorTOML(rate int) string {
	return fmt.Sprintf("[vendors.acme]\nbase_url = \"https://x\"\nrate = %d\n", rate)
}

type syncBuf struct {
	mu sync.Mutex
	b  bytes.Buffer
}

func (s *syncBuf) Write(p []byte) (int, error) { s.mu.Lock(); defer s.mu.Unlock(); return s.b.Write(p) }
func (s *syncBuf) String() string              { s.mu.Lock(); defer s.mu.Unlock(); return s.b.String() }

// TestWatchReloadPaths edits a config file every way editors and
// orchestrators do, and checks that each valid edit is applied once and an
// invalid one never.
func TestWatchReloadPaths(t *testing.T) {
	dir := t.TempDir()
	path := filepath.Join(dir, "config.toml")
	if err := os.WriteFile(path, []byte(vendorTOML(10)), 0o600); err != nil {
		t.Fatal(err)
	}
	var mu sync.Mutex
	var rates []int
	logs := &syncBuf{}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() {
		defer close(done)
		_ = Watch(ctx, path, slog.New(slog.NewTextHandler(logs, nil)), func(c *Config) {
			mu.Lock()
			rates = append(rates, c.Vendors[0].Rate)
			mu.Unlock()
		})
	}()
	defer func() { cancel(); <-done }()
	time.Sleep(200 * time.Millisecond)
	applied := func() []int { mu.Lock(); defer mu.Unlock(); return append([]int(nil), rates...) }
	expect := func(what string, want []int) {
		t.Helper()
		deadline := time.Now().Add(4 * time.Second)
		for time.Now().Before(deadline) {
			if fmt.Sprint(applied()) == fmt.Sprint(want) {
				return
			}
			time.Sleep(50 * time.Millisecond)
		}
		t.Fatalf("%s: applied %v, want %v\nlogs:\n%s", what, applied(), want, logs.String())
	}

	// In-place write, twice in a row: one reload (debounced).
	os.WriteFile(path, []byte(vendorTOML(20)), 0o600)
	os.WriteFile(path, []byte(vendorTOML(20)+"\n"), 0o600)
	expect("in-place write", []int{20})
	// Rename over (vim, kubectl ConfigMap-style atomic replace).
	tmp := filepath.Join(dir, ".config.toml.tmp")
	os.WriteFile(tmp, []byte(vendorTOML(30)), 0o600)
	os.Rename(tmp, path)
	expect("rename-over", []int{20, 30})
	// Delete and recreate.
	os.Remove(path)
	time.Sleep(100 * time.Millisecond)
	os.WriteFile(path, []byte(vendorTOML(40)), 0o600)
	expect("delete and recreate", []int{20, 30, 40})
	// Garbage: rejected, logged with its line, nothing applied.
	os.WriteFile(path, []byte("[vendors.acme]\nbase_url = \"https://x\"\nrate = 0\n"), 0o600)
	time.Sleep(time.Second)
	if got := applied(); len(got) != 3 {
		t.Fatalf("an invalid edit was applied: %v", got)
	}
	if l := logs.String(); !strings.Contains(l, "config reload rejected") || !strings.Contains(l, "config.toml:3") {
		t.Errorf("the rejection was not logged with its line:\n%s", l)
	}
	// Fixed again, then SIGHUP reloads even an unchanged file.
	os.WriteFile(path, []byte(vendorTOML(50)), 0o600)
	expect("fixed edit", []int{20, 30, 40, 50})
	syscall.Kill(os.Getpid(), syscall.SIGHUP)
	expect("SIGHUP", []int{20, 30, 40, 50, 50})
}
