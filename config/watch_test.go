package config

import (
	"bufio"
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"os"
	"os/exec"
	"os/signal"
	"path/filepath"
	"slices"
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

// watching is a Watch running on a config file of the test's.
type watching struct {
	path   string
	reload chan struct{}
	events chan WatchEvent // every event Watch reports, in order
	logs   *syncBuf
	cancel context.CancelFunc
	done   chan struct{} // closed when Watch has returned
	err    error         // what Watch returned

	mu    sync.Mutex
	rates []int // acme's rate in each config applied
}

// startWatch writes text to a new config file, runs Watch on it and waits
// until it is armed.
func startWatch(t *testing.T, text string) *watching {
	t.Helper()
	w := &watching{
		path:   filepath.Join(t.TempDir(), "config.toml"),
		reload: make(chan struct{}),
		events: make(chan WatchEvent, 64),
		logs:   &syncBuf{},
		done:   make(chan struct{}),
	}
	writeFile(t, w.path, text)
	ctx, cancel := context.WithCancel(context.Background())
	w.cancel = cancel
	apply := func(c *Config) {
		w.mu.Lock()
		defer w.mu.Unlock()
		w.rates = append(w.rates, c.Vendors[0].Rate)
	}
	opts := WatchOptions{Reload: w.reload, Observe: func(e WatchEvent) { w.events <- e }}
	go func() {
		defer close(w.done)
		w.err = Watch(ctx, w.path, slog.New(slog.NewTextHandler(w.logs, nil)), apply, opts)
	}()
	t.Cleanup(func() { cancel(); <-w.done })
	w.expect(t, "arming", WatchArmed)
	return w
}

// expect waits for Watch's next event and fails the test unless it is
// want. Every reload attempt is an event: a step that caused two attempts
// shows up as an unexpected event at the next expect, or at stop.
func (w *watching) expect(t *testing.T, step string, want WatchEvent) {
	t.Helper()
	select {
	case e := <-w.events:
		if e != want {
			t.Fatalf("%s: Watch reported %s, want %s\napplied rates %v\nlogs:\n%s", step, e, want, w.applied(), w.logs)
		}
	case <-time.After(10 * time.Second):
		t.Fatalf("%s: no event within 10s, want %s\nlogs:\n%s", step, want, w.logs)
	}
}

// expectApplied waits for the next event, which must apply rate.
func (w *watching) expectApplied(t *testing.T, step string, rate int) {
	t.Helper()
	w.expect(t, step, WatchApplied)
	if got := w.applied(); got[len(got)-1] != rate {
		t.Fatalf("%s: applied rate %d, want %d", step, got[len(got)-1], rate)
	}
}

func (w *watching) applied() []int {
	w.mu.Lock()
	defer w.mu.Unlock()
	return slices.Clone(w.rates)
}

// stop ends Watch, waits for it to return, and fails the test if it
// reported any event the test did not expect.
func (w *watching) stop(t *testing.T) {
	t.Helper()
	w.cancel()
	<-w.done
	if w.err != nil {
		t.Errorf("Watch: %v", w.err)
	}
	close(w.events)
	for e := range w.events {
		t.Errorf("an event no step caused: %s", e)
	}
}

func writeFile(t *testing.T, path, text string) {
	t.Helper()
	if err := os.WriteFile(path, []byte(text), 0o600); err != nil {
		t.Fatal(err)
	}
}

// TestWatchReloadPaths edits a config file every way editors and
// orchestrators do, and checks that each edit leads to exactly one reload
// attempt: a valid edit applied once, an invalid one rejected and logged.
// The test waits on Watch's events, never on the clock.
func TestWatchReloadPaths(t *testing.T) {
	w := startWatch(t, vendorTOML(10))
	dir := filepath.Dir(w.path)

	// In-place write, twice in a row: one reload (debounced).
	writeFile(t, w.path, vendorTOML(20))
	writeFile(t, w.path, vendorTOML(20)+"\n")
	w.expectApplied(t, "in-place write", 20)

	// Rename over (vim, kubectl ConfigMap-style atomic replace).
	tmp := filepath.Join(dir, ".config.toml.tmp")
	writeFile(t, tmp, vendorTOML(30))
	if err := os.Rename(tmp, w.path); err != nil {
		t.Fatal(err)
	}
	w.expectApplied(t, "rename-over", 30)

	// Delete and recreate at once: one reload, of the new file.
	if err := os.Remove(w.path); err != nil {
		t.Fatal(err)
	}
	writeFile(t, w.path, vendorTOML(40))
	w.expectApplied(t, "delete and recreate", 40)

	// Delete, and the file stays away: rejected (the last good config
	// stays); the watch survives the removal and sees the file come back.
	if err := os.Remove(w.path); err != nil {
		t.Fatal(err)
	}
	w.expect(t, "deleted", WatchRejected)
	if l := w.logs.String(); !strings.Contains(l, "config reload rejected") || !strings.Contains(l, "no such file") {
		t.Errorf("the missing file was not logged:\n%s", l)
	}
	writeFile(t, w.path, vendorTOML(45))
	w.expectApplied(t, "recreated", 45)

	// Garbage: rejected, logged with its file and line, nothing applied.
	writeFile(t, w.path, "[vendors.acme]\nbase_url = \"https://x\"\nrate = 0\n")
	w.expect(t, "invalid edit", WatchRejected)
	if l := w.logs.String(); !strings.Contains(l, "config.toml:3") || !strings.Contains(l, "vendors.acme.rate") {
		t.Errorf("the rejection was not logged with its file, line and key:\n%s", l)
	}

	// Fixed again; then a reload request (what SIGHUP does in cmd/shaper)
	// reloads even the unchanged file.
	writeFile(t, w.path, vendorTOML(50))
	w.expectApplied(t, "fixed edit", 50)
	w.reload <- struct{}{}
	w.expectApplied(t, "reload request", 50)

	w.stop(t)
	if got, want := w.applied(), []int{20, 30, 40, 45, 50, 50}; !slices.Equal(got, want) {
		t.Errorf("applied %v, want %v", got, want)
	}
}

// TestWatchLeavesSignalsAlone runs Watch in a child process that has no
// SIGHUP handler of its own, and sends the child SIGHUP. The child must
// die of it (Go's default for SIGHUP): Watch installed no handler. A Watch
// that caught SIGHUP would reload and the child would say so.
func TestWatchLeavesSignalsAlone(t *testing.T) {
	if path := os.Getenv("SHAPER_TEST_WATCH_CHILD"); path != "" {
		watchChild(path)
		return
	}
	if signal.Ignored(syscall.SIGHUP) {
		t.Skip("this process ignores SIGHUP (nohup?), and so would the child")
	}
	path := filepath.Join(t.TempDir(), "config.toml")
	writeFile(t, path, vendorTOML(10))
	child := exec.Command(os.Args[0], "-test.run=^TestWatchLeavesSignalsAlone$", "-test.count=1")
	child.Env = append(os.Environ(), "SHAPER_TEST_WATCH_CHILD="+path)
	out, err := child.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	child.Stderr = os.Stderr
	if err := child.Start(); err != nil {
		t.Fatal(err)
	}
	watchdog := time.AfterFunc(30*time.Second, func() { _ = child.Process.Kill() })
	defer watchdog.Stop()
	lines := bufio.NewScanner(out)
	if !lines.Scan() || lines.Text() != WatchArmed.String() {
		_ = child.Process.Kill()
		_ = child.Wait()
		t.Fatalf("the child did not arm its watch (first line %q)", lines.Text())
	}
	if err := child.Process.Signal(syscall.SIGHUP); err != nil {
		t.Fatal(err)
	}
	if lines.Scan() {
		_ = child.Process.Kill()
		t.Errorf("after SIGHUP the child's Watch reported %q: it handled the signal", lines.Text())
	}
	_, _ = io.Copy(io.Discard, out)
	err = child.Wait()
	var exit *exec.ExitError
	if !errors.As(err, &exit) {
		t.Fatalf("the child survived SIGHUP: %v", err)
	}
	if ws, ok := exit.Sys().(syscall.WaitStatus); !ok || !ws.Signaled() || ws.Signal() != syscall.SIGHUP {
		t.Errorf("the child ended with %v, want death by SIGHUP", err)
	}
}

// watchChild is the child of TestWatchLeavesSignalsAlone: it prints each
// event of a Watch on path, one a line, until it is killed.
func watchChild(path string) {
	log := slog.New(slog.NewTextHandler(io.Discard, nil))
	err := Watch(context.Background(), path, log, func(*Config) {}, WatchOptions{
		Observe: func(e WatchEvent) { fmt.Println(e) },
	})
	fmt.Println("Watch returned:", err)
	os.Exit(3)
}
