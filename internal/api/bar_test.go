package api

import (
	"context"
	"fmt"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/shaper-dev/shaper/internal/logtest"
	"github.com/shaper-dev/shaper/internal/redistest"
)

// TestBarFromPython is the API's bar, end to end with real processes:
// `shaper serve` and one `shaper worker` (a binary built here), and
// bench/api_bar.py, which serves the vendor (200
// calls a second in fixed windows at a random phase, 429 beyond) and
// drives the API with Python's urllib alone: 1,000 calls in one NDJSON
// POST all done, 0 429s, none twice, a second POST queues nothing, and
// GET ?wait= returns within 100 ms of a call's end. make bench-api runs
// it and prints the figures; -short skips it (about 15 s).
func TestBarFromPython(t *testing.T) {
	if testing.Short() {
		t.Skip("end to end with real processes: make bench-api runs it")
	}
	if out, err := exec.Command("python3", "--version").CombinedOutput(); err != nil {
		t.Fatalf("bench/api_bar.py needs python3 (Debian: apt-get install python3): %v %s", err, out)
	}
	bin := filepath.Join(t.TempDir(), "shaper")
	if out, err := exec.Command("go", "build", "-o", bin, "github.com/shaper-dev/shaper/cmd/shaper").CombinedOutput(); err != nil {
		t.Fatalf("go build: %v\n%s", err, out)
	}
	ln, err := net.Listen("tcp", "127.0.0.1:0") // a free port for the script's vendor
	if err != nil {
		t.Fatal(err)
	}
	vendorAddr := ln.Addr().String()
	ln.Close()
	name := "bar-" + redistest.Prefix(t)[5:]
	cfg := filepath.Join(t.TempDir(), "config.toml")
	err = os.WriteFile(cfg, []byte(fmt.Sprintf(`[redis]
addr = %q

[vendors.%s]
base_url = "http://%s"
rate = 200
`, redistest.Addr(t), name, vendorAddr)), 0o600)
	if err != nil {
		t.Fatal(err)
	}
	serve := start(t, bin, "serve", "--config", cfg, "--addr", "127.0.0.1:0")
	start(t, bin, "worker", "--config", cfg)
	url := ""
	for deadline := time.Now().Add(20 * time.Second); url == ""; time.Sleep(20 * time.Millisecond) {
		if m := regexp.MustCompile(`url=(http://\S+)/v1/calls`).FindStringSubmatch(serve.String()); m != nil {
			url = m[1]
		} else if time.Now().After(deadline) {
			t.Fatalf("shaper serve did not say its address in 20 s:\n%s", serve)
		}
	}
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	script := exec.CommandContext(ctx, "python3", filepath.Join("..", "..", "bench", "api_bar.py"), "--api", url, "--vendor", name,
		"--vendor-listen", vendorAddr, "--calls", strconv.Itoa(1000), "--rate", "200")
	out, err := script.CombinedOutput()
	t.Logf("python3 bench/api_bar.py:\n%s", out)
	if err != nil {
		t.Fatalf("the bar is not met (%v); shaper serve's log:\n%s", err, serve)
	}
}

// start runs bin with args until the test ends (SIGTERM, then its exit),
// its output in the buffer returned.
func start(t *testing.T, bin string, args ...string) *logtest.Buffer {
	t.Helper()
	cmd := exec.Command(bin, args...)
	out := &logtest.Buffer{}
	cmd.Stdout, cmd.Stderr = out, out
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		_ = cmd.Process.Signal(syscall.SIGTERM)
		done := make(chan error, 1)
		go func() { done <- cmd.Wait() }()
		select {
		case <-done:
		case <-time.After(20 * time.Second):
			_ = cmd.Process.Kill()
			<-done
			t.Errorf("shaper %s did not stop within 20 s of SIGTERM:\n%s", strings.Join(args[:1], " "), out)
		}
	})
	return out
}
