package main

import (
	"context"
	"io"
	"net/http"
	"net/http/httptest"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync/atomic"
	"testing"

	"github.com/shaper-dev/shaper/internal/logtest"
	"github.com/shaper-dev/shaper/internal/redistest"
)

// TestDotAccountRefusedFromOutside: from outside, through the CLI and
// the HTTP API (shaper serve), a call whose account is ".", ".." or "..."
// on a vendor whose base_url is .../stores/{account}/api is refused with
// an error naming the account, the vendor and the rule; nothing is
// queued, and a worker running meanwhile sends the vendor nothing.
func TestDotAccountRefusedFromOutside(t *testing.T) {
	t.Parallel()
	var got atomic.Int64
	srv := httptest.NewServer(http.HandlerFunc(func(http.ResponseWriter, *http.Request) { got.Add(1) }))
	defer srv.Close()
	vendor := "dots-" + redistest.Prefix(t)[5:]
	cfg := filepath.Join(t.TempDir(), "config.toml")
	if err := os.WriteFile(cfg, []byte(`[redis]
addr = "`+redistest.Addr(t)+`"

[vendors.`+vendor+`]
base_url = "`+srv.URL+`/stores/{account}/api"
rate = 50
per_account = true
`), 0o600); err != nil {
		t.Fatal(err)
	}
	startWorker(t, cfg)
	for _, account := range []string{".", "..", "..."} {
		out, err := runShaper(t, "", "enqueue", "--config", cfg, "--vendor", vendor, "--account", account, "--path", "/orders")
		if err == nil || !strings.Contains(out, `account "`+account+`"`) || !strings.Contains(out, vendor) || !strings.Contains(out, "only dots") {
			t.Errorf("enqueue --account %s: %v\n%s", account, err, out)
		}
	}
	out, err := runShaper(t, "{\"path\":\"/a\",\"account\":\"store-1\"}\n{\"path\":\"/b\",\"account\":\"..\"}\n", "enqueue", "--config", cfg, "--vendor", vendor, "--file", "-")
	if err == nil || !strings.Contains(out, "stdin:2:") || !strings.Contains(out, "only dots") || !strings.Contains(out, "nothing was enqueued") {
		t.Errorf("a file with the account \"..\" on line 2: %v\n%s", err, out)
	}

	serve := exec.Command(shaperBin(t), "serve", "--config", cfg, "--addr", "127.0.0.1:0")
	sout := &logtest.Buffer{}
	serve.Stdout, serve.Stderr = sout, sout
	if err := serve.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = serve.Process.Kill(); _ = serve.Wait() })
	resp, err := http.Post(pageURL(t, sout), "application/json", strings.NewReader(`{"vendor":"`+vendor+`","account":"..","path":"/orders"}`))
	if err != nil {
		t.Fatal(err)
	}
	body, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	if resp.StatusCode != http.StatusBadRequest || !strings.Contains(string(body), `\"..\"`) || !strings.Contains(string(body), "only dots") {
		t.Errorf("POST with the account \"..\": %d %s, want 400 naming the account and the rule", resp.StatusCode, body)
	}

	rdb := redistest.Client(t)
	ctx := context.Background()
	for _, q := range []string{"vendor:" + vendor, "vendor:" + vendor + ":high"} {
		for _, state := range []string{"pending", "active", "scheduled", "retry"} {
			key := "asynq:{" + q + "}:" + state
			if n := rdb.LLen(ctx, key).Val() + rdb.ZCard(ctx, key).Val(); n != 0 {
				t.Errorf("%d tasks in %s", n, key)
			}
		}
	}
	if n := got.Load(); n != 0 {
		t.Errorf("the vendor received %d requests", n)
	}
}
