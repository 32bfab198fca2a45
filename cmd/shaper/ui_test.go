package main

import (
	"fmt"
	"net/http"
	"net/http/httptest"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/shaper-dev/shaper/internal/logtest"
	"github.com/shaper-dev/shaper/internal/redistest"
)

// pageURL waits for the live page's address in a command's log.
func pageURL(t *testing.T, out *logtest.Buffer) string {
	t.Helper()
	var url string
	waitUntil(t, 20*time.Second, "the live page's address in the log", func() bool {
		for _, f := range strings.Fields(out.String()) {
			if u, ok := strings.CutPrefix(f, "url=http://"); ok {
				url = "http://" + u
				return true
			}
		}
		return false
	})
	return url
}

// TestUICommand runs `shaper ui` against a deployment with two vendors,
// one per-account: / answers 200 naming both, /asynq/ serves asynqmon
// read-only, an unknown vendor or task is a 404 with a message, and a
// non-loopback --addr without a token is refused naming the flag.
func TestUICommand(t *testing.T) {
	t.Parallel()
	p := "ui" + redistest.Prefix(t)[5:]
	cfg := filepath.Join(t.TempDir(), "config.toml")
	err := os.WriteFile(cfg, []byte(`[redis]
addr = "`+redistest.Addr(t)+`"

[vendors.`+p+`-crm]
base_url = "https://api.crm.example"
rate = 5

[vendors.`+p+`-shop]
base_url = "https://api.shop.example"
rate = 2
per_account = true
total = { rate = 10, window = "1s" }
`), 0o600)
	if err != nil {
		t.Fatal(err)
	}
	if out, err := runShaper(t, `{"path":"/a?key=SECRETKEY","headers":{"Authorization":"Bearer SECRETTOKEN"}}`+"\n",
		"enqueue", "--config", cfg, "--vendor", p+"-crm", "--file", "-"); err != nil {
		t.Fatalf("enqueue: %v\n%s", err, out)
	}
	cmd := exec.Command(shaperBin(t), "ui", "--config", cfg, "--addr", "127.0.0.1:0")
	out := &logtest.Buffer{}
	cmd.Stdout, cmd.Stderr = out, out
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = cmd.Process.Kill(); _ = cmd.Wait() })
	base := strings.TrimSuffix(pageURL(t, out), "/")
	code, body := getBody(t, base+"/")
	for _, v := range []string{p + "-crm", p + "-shop"} {
		if code != 200 || !strings.Contains(body, `data-vendor="`+v+`"`) {
			t.Errorf("/ = %d, want 200 naming vendor %s:\n%s", code, v, body)
		}
	}
	if !strings.Contains(body, "one account") || !strings.Contains(body, "2/s each account") {
		t.Errorf("/ lacks the per-account vendor's account view or its limit:\n%s", body)
	}
	if code, body := getBody(t, base+"/asynq/"); code != 200 || !strings.Contains(body, "<html") {
		t.Errorf("/asynq/ = %d, want asynqmon's page:\n%.300s", code, body)
	}
	code, body = getBody(t, base+"/asynq/api/queues/vendor:"+p+"-crm/pending_tasks")
	if code != 200 || !strings.Contains(body, "GET /a?… (query not shown), 1 header(s) (values not shown)") || strings.Contains(body, "SECRET") {
		t.Errorf("asynqmon's pending tasks = %d, want the call described without its query or header value:\n%s", code, body)
	}
	req, _ := http.NewRequest("DELETE", base+"/asynq/api/queues/vendor:"+p+"-crm", nil)
	if resp, err := http.DefaultClient.Do(req); err != nil || resp.StatusCode != http.StatusMethodNotAllowed {
		t.Errorf("DELETE through asynqmon: %v %v, want 405 (read-only)", resp, err)
	} else {
		resp.Body.Close()
	}
	if code, body := send(t, "GET", base+"/", "evil.example", "", ""); code != http.StatusMisdirectedRequest || !strings.Contains(body, "evil.example") {
		t.Errorf("GET / with Host evil.example: %d %s, want 421 naming it", code, body)
	}
	if code, body := send(t, "POST", base+"/asynq/api/queues/vendor:"+p+"-crm:pause", "", "", "", "Origin", "https://evil.example"); code != http.StatusForbidden {
		t.Errorf("POST to asynqmon from another site's page: %d %s, want 403", code, body)
	}
	for path, want := range map[string]string{
		"/vendors/nope":     `no vendor \"nope\" in the config`,
		"/api/explain/nope": "no such task",
		"/api/vendors/" + p + "-shop/accounts/bad%20name": "an account name is",
	} {
		if code, body := getBody(t, base+path); (code != 404 && code != 400) || !strings.Contains(body, want) || strings.Contains(body, "goroutine") {
			t.Errorf("%s = %d %s, want 404/400 with %q", path, code, body, want)
		}
	}
	code, body = getBody(t, base+"/api/vendors/"+p+"-shop/accounts/store-1")
	if code != 200 || !strings.Contains(body, `"account":{"account":"store-1"`) || !strings.Contains(body, `"share_rate":`) {
		t.Errorf("one account's view = %d, want store-1's rate and share of the total:\n%s", code, body)
	}
	o, err := runShaper(t, "", "ui", "--config", cfg, "--addr", "0.0.0.0:0")
	if err == nil || !strings.Contains(o, "--addr 0.0.0.0:0 is not a loopback address") || !strings.Contains(o, "--ui-token") {
		t.Errorf("ui on 0.0.0.0 without a token: %v\n%s", err, o)
	}
	o, err = runShaper(t, "", "worker", "--config", cfg, "--ui-addr", ":0")
	if err == nil || !strings.Contains(o, "--ui-addr :0 is not a loopback address") {
		t.Errorf("worker --ui-addr :0 without a token: %v\n%s", err, o)
	}
}

// TestWorkerPageFollowsReloadsAndStops runs `shaper worker --ui-addr` in
// this process: the page names the configured vendor, names a vendor
// added by a config edit once the worker applies it, and every goroutine
// it started (its sampler, its server) ends with the command.
func TestWorkerPageFollowsReloadsAndStops(t *testing.T) {
	addr := redistest.Addr(t)
	vendor := "pagew-" + redistest.Prefix(t)[5:]
	srv := httptest.NewServer(http.NotFoundHandler()) // never called: nothing is enqueued
	defer srv.Close()
	cfg := writeConfig(t, addr, vendor, srv.URL, 10)
	logs := newLogLines()
	w := startInProcess(t, logs, "--config", cfg, "--ui-addr", "127.0.0.1:0")
	logs.wait(t, "worker started", 30*time.Second)
	logs.wait(t, "watching the config file", 30*time.Second)
	var base string
	for _, line := range strings.Split(logs.String(), "\n") {
		if strings.Contains(line, "serving the live page") {
			base = strings.TrimSuffix(logValue(line, "url"), "/")
		}
	}
	if code, body := getBody(t, base+"/"); code != 200 || !strings.Contains(body, `data-vendor="`+vendor+`"`) {
		t.Fatalf("/ = %d, want 200 naming %s:\n%s", code, vendor, body)
	}
	b, err := os.ReadFile(cfg)
	if err != nil {
		t.Fatal(err)
	}
	added := vendor + "-added"
	b = append(b, []byte(fmt.Sprintf("\n[vendors.%s]\nbase_url = %q\nrate = 3\n", added, srv.URL))...)
	if err := os.WriteFile(cfg, b, 0o600); err != nil {
		t.Fatal(err)
	}
	waitUntil(t, 20*time.Second, "the page to name the added vendor", func() bool {
		code, body := getBody(t, base+"/api/state")
		return code == 200 && strings.Contains(body, `"vendor":"`+added+`"`)
	})
	if err := w.stop(t); err != nil {
		t.Errorf("worker: %v", err)
	}
	if resp, err := http.Get(base + "/"); err == nil {
		resp.Body.Close()
		t.Errorf("the page answers %d after the worker stopped", resp.StatusCode)
	}
}
