//go:build unix

package main

import (
	"context"
	"io"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"go.uber.org/goleak"

	"github.com/shaper-dev/shaper/internal/redistest"
)

// logLines is the log of a command run in this process. Tests wait for a
// line without polling, and hook, when set before the command starts, runs
// on the logging goroutine before each record is kept: the command waits
// for it, which lets a test act at an exact point of the command's run.
type logLines struct {
	hook func(record string)

	mu   sync.Mutex
	b    strings.Builder
	grew chan struct{} // closed and replaced on every write
}

func newLogLines() *logLines { return &logLines{grew: make(chan struct{})} }

func (l *logLines) Write(p []byte) (int, error) {
	if l.hook != nil {
		l.hook(string(p))
	}
	l.mu.Lock()
	defer l.mu.Unlock()
	l.b.Write(p)
	close(l.grew)
	l.grew = make(chan struct{})
	return len(p), nil
}

func (l *logLines) String() string {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.b.String()
}

// appeared returns a channel closed once the log contains s.
func (l *logLines) appeared(s string) <-chan struct{} {
	ch := make(chan struct{})
	go func() {
		defer close(ch)
		for {
			l.mu.Lock()
			ok, grew := strings.Contains(l.b.String(), s), l.grew
			l.mu.Unlock()
			if ok {
				return
			}
			<-grew
		}
	}()
	return ch
}

// wait returns once the log contains s; the test fails after d.
func (l *logLines) wait(t *testing.T, s string, d time.Duration) {
	t.Helper()
	select {
	case <-l.appeared(s):
	case <-time.After(d):
		t.Fatalf("no %q in the log after %s:\n%s", s, d, l.String())
	}
}

// inProcess is `shaper worker` running in the test process.
type inProcess struct {
	cancel  context.CancelFunc
	stopped chan struct{} // closed when the command has returned
	err     error         // its error, once stopped
	before  goleak.Option // the goroutines that ran before the command
}

// startInProcess runs `shaper worker args...` in this process, logging to log,
// until stop (or the end of the test).
func startInProcess(t *testing.T, log io.Writer, args ...string) *inProcess {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	w := &inProcess{cancel: cancel, stopped: make(chan struct{}), before: goleak.IgnoreCurrent()}
	root := newRootCmd()
	root.SetArgs(append([]string{"worker"}, args...))
	root.SetOut(log)
	root.SetErr(log)
	go func() {
		defer close(w.stopped)
		w.err = root.ExecuteContext(ctx)
	}()
	t.Cleanup(func() {
		cancel()
		select {
		case <-w.stopped:
		case <-time.After(60 * time.Second):
			t.Error("the worker command did not return within 60s of its context ending")
		}
	})
	return w
}

// stop ends the command's context (what SIGINT does), waits for it, and
// checks that every goroutine it started has ended.
func (w *inProcess) stop(t *testing.T) error {
	t.Helper()
	w.cancel()
	select {
	case <-w.stopped:
	case <-time.After(60 * time.Second):
		t.Fatal("the worker command did not return within 60s of its context ending")
	}
	w.checkGoroutines(t)
	return w.err
}

// checkGoroutines fails the test if a goroutine started by the command
// outlives it.
func (w *inProcess) checkGoroutines(t *testing.T) {
	t.Helper()
	http.DefaultClient.CloseIdleConnections()
	if err := goleak.Find(w.before, goleak.IgnoreAnyFunction("github.com/shaper-dev/shaper/cmd/shaper.(*logLines).appeared.func1")); err != nil {
		t.Errorf("goroutines outlived the worker command: %v", err)
	}
}

func getBody(t *testing.T, url string) (int, string) {
	t.Helper()
	c := &http.Client{Timeout: 10 * time.Second}
	resp, err := c.Get(url)
	if err != nil {
		t.Errorf("GET %s: %v", url, err)
		return 0, ""
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	return resp.StatusCode, string(b)
}

// logValue returns the value of key=... in a text log record.
func logValue(record, key string) string {
	for _, f := range strings.Fields(record) {
		if v, ok := strings.CutPrefix(f, key+"="); ok {
			return strings.Trim(v, `"`)
		}
	}
	return ""
}

// TestWorkerMetricsFromTheFirstScrape scrapes /metrics the moment the
// worker announces the address (a Prometheus that scrapes at once), while
// the command is held at that log line, and again while the worker runs.
// The metrics read the worker's buckets from the HTTP server's goroutine:
// the worker must exist, and be published to that goroutine, before the
// server serves.
func TestWorkerMetricsFromTheFirstScrape(t *testing.T) {
	addr := redistest.Addr(t)
	vendor := "scrape-" + redistest.Prefix(t)[5:]
	srv := httptest.NewServer(http.NotFoundHandler()) // never called: nothing is enqueued
	defer srv.Close()
	cfg := writeConfig(t, addr, vendor, srv.URL, 10)
	want := `shaper_configured_rate{vendor="` + vendor + `"}`

	type scrape struct {
		code int
		body string
	}
	first := make(chan scrape, 1)
	var base string
	logs := newLogLines()
	logs.hook = func(record string) {
		if !strings.Contains(record, "serving metrics") {
			return
		}
		url := logValue(record, "addr")
		base = strings.TrimSuffix(url, "/metrics")
		code, body := getBody(t, url)
		first <- scrape{code, body}
	}
	w := startInProcess(t, logs, "--config", cfg, "--metrics-addr", "127.0.0.1:0")
	logs.wait(t, "worker started", 30*time.Second)
	s := <-first
	if s.code != http.StatusOK || !strings.Contains(s.body, want) {
		t.Errorf("the first scrape: %d, lacks %s:\n%s", s.code, want, s.body)
	}
	for range 3 {
		if code, body := getBody(t, base+"/metrics"); code != http.StatusOK || !strings.Contains(body, want) {
			t.Errorf("a scrape while the worker runs: %d, lacks %s:\n%s", code, want, body)
		}
	}
	if err := w.stop(t); err != nil {
		t.Errorf("worker: %v", err)
	}
}

// TestWorkerWaitsForItsConfigWatch holds the config watch in the middle of
// reading the file (the config file is a FIFO: reading it blocks until the
// test writes it) and asks the worker to stop. The command owns the watch:
// it must stop the watch and wait for it before the worker shuts down
// (a reload never reaches a worker that is shutting down) and before the
// command returns.
func TestWorkerWaitsForItsConfigWatch(t *testing.T) {
	addr := redistest.Addr(t)
	vendor := "owned-" + redistest.Prefix(t)[5:]
	srv := httptest.NewServer(http.NotFoundHandler())
	defer srv.Close()
	text, err := os.ReadFile(writeConfig(t, addr, vendor, srv.URL, 10))
	if err != nil {
		t.Fatal(err)
	}
	path := filepath.Join(t.TempDir(), "config.toml")
	if err := syscall.Mkfifo(path, 0o600); err != nil {
		t.Skipf("mkfifo: %v", err)
	}
	// feed answers one read of the config file; it blocks until someone
	// opens the file to read it.
	feed := func() {
		f, err := os.OpenFile(path, os.O_WRONLY, 0)
		if err != nil {
			t.Error(err)
			return
		}
		_, _ = f.Write(text)
		_ = f.Close()
	}
	logs := newLogLines()
	w := startInProcess(t, logs, "--config", path)
	feed() // the command's first load
	logs.wait(t, "worker started", 30*time.Second)
	// The watch is now (or soon) blocked on its first read of the file.
	w.cancel()
	// Nothing may happen until the watch has finished: on a command that
	// does not wait for it, the worker starts shutting down (and the
	// command returns) within milliseconds. Two seconds is only how long
	// the test looks for that; it synchronises nothing.
	select {
	case <-w.stopped:
		t.Errorf("the command returned while its config watch was still running")
	case <-logs.appeared("shutting down"):
		t.Errorf("the worker began shutting down while its config watch was still running:\n%s", logs)
	case <-time.After(2 * time.Second):
	}
	fed := make(chan struct{})
	go func() { defer close(fed); feed() }() // the watch's read
	select {
	case <-w.stopped:
		if w.err != nil {
			t.Errorf("worker: %v", w.err)
		}
	case <-time.After(60 * time.Second):
		t.Fatalf("the worker command did not return once its config watch could finish:\n%s", logs)
	}
	select {
	case <-fed:
	default:
		t.Errorf("the command returned before its config watch read the file")
		go func() { // let feed's open return
			if f, err := os.OpenFile(path, os.O_RDONLY, 0); err == nil {
				_ = f.Close()
			}
		}()
		<-fed
	}
	w.checkGoroutines(t)
}

// TestWorkerReloadsOnSIGHUP sends SIGHUP to the process running the worker
// command: the command turns it into a reload request, and the unchanged
// file is reloaded.
func TestWorkerReloadsOnSIGHUP(t *testing.T) {
	addr := redistest.Addr(t)
	vendor := "hup-" + redistest.Prefix(t)[5:]
	srv := httptest.NewServer(http.NotFoundHandler())
	defer srv.Close()
	cfg := writeConfig(t, addr, vendor, srv.URL, 10)
	logs := newLogLines()
	w := startInProcess(t, logs, "--config", cfg)
	logs.wait(t, "watching the config file", 30*time.Second)
	if err := syscall.Kill(os.Getpid(), syscall.SIGHUP); err != nil {
		t.Fatal(err)
	}
	logs.wait(t, "config reloaded", 10*time.Second)
	if err := w.stop(t); err != nil {
		t.Errorf("worker: %v", err)
	}
	if l := logs.String(); strings.Contains(l, "rejected") {
		t.Errorf("the reload was rejected:\n%s", l)
	}
}
