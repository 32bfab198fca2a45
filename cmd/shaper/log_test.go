//go:build unix

package main

import (
	"net/http"
	"net/http/httptest"
	"regexp"
	"strings"
	"testing"
	"time"

	"github.com/shaper-dev/shaper/internal/redistest"
)

// TestWorkerLogIsOneFormat runs the worker command in this process and
// makes asynq log (a call the vendor refuses with 400 is archived: asynq
// warns "Retry exhausted") and the queue package log (the shutdown): every
// line of the command's log is a slog text record, none is in asynq's or
// slog.Default's "2006/01/02 15:04:05" format (which would not even reach
// the command's writer, but stderr).
func TestWorkerLogIsOneFormat(t *testing.T) {
	addr := redistest.Addr(t)
	vendor := "onelog-" + redistest.Prefix(t)[5:]
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, _ *http.Request) {
		http.Error(w, "bad request", http.StatusBadRequest)
	}))
	defer srv.Close()
	cfg := writeConfig(t, addr, vendor, srv.URL, 10)
	logs := newLogLines()
	w := startInProcess(t, logs, "--config", cfg)
	logs.wait(t, "worker started", 30*time.Second)
	if out, err := runShaper(t, "", "enqueue", "--config", cfg, "--vendor", vendor, "--path", "/refused"); err != nil {
		t.Fatalf("enqueue: %v\n%s", err, out)
	}
	logs.wait(t, "Retry exhausted", 30*time.Second) // asynq's own line
	if err := w.stop(t); err != nil {
		t.Errorf("worker: %v", err)
	}
	log := logs.String()
	for _, want := range []string{"level=WARN msg=\"Retry exhausted for task id=", "level=INFO msg=\"shutting down: "} {
		if !strings.Contains(log, want) {
			t.Errorf("the log lacks %q:\n%s", want, log)
		}
	}
	record := regexp.MustCompile(`^time=\S+ level=(DEBUG|INFO|WARN|ERROR) msg=`)
	stdlog := regexp.MustCompile(`(^|asynq: pid=\d+ )\d{4}/\d\d/\d\d \d\d:\d\d:\d\d`)
	for _, line := range strings.Split(strings.TrimSpace(log), "\n") {
		if !record.MatchString(line) || stdlog.MatchString(line) {
			t.Errorf("a line not in the worker's log format: %q", line)
		}
	}
}
