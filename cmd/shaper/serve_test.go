package main

import (
	"io"
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

// TestServeCommand runs `shaper serve`: a call posted to it is queued
// (202) where `shaper explain` finds it, a bad one is a 400 naming its
// line, and a non-loopback --addr without a token is refused naming the
// flags that set one.
func TestServeCommand(t *testing.T) {
	t.Parallel()
	p := "serve" + redistest.Prefix(t)[5:]
	cfg := filepath.Join(t.TempDir(), "config.toml")
	err := os.WriteFile(cfg, []byte(`[redis]
addr = "`+redistest.Addr(t)+`"

[vendors.`+p+`]
base_url = "https://api.crm.example"
rate = 5
`), 0o600)
	if err != nil {
		t.Fatal(err)
	}
	cmd := exec.Command(shaperBin(t), "serve", "--config", cfg, "--addr", "127.0.0.1:0")
	out := &logtest.Buffer{}
	cmd.Stdout, cmd.Stderr = out, out
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = cmd.Process.Kill(); _ = cmd.Wait() })
	url := pageURL(t, out)
	post := func(body string) (int, string) {
		resp, err := http.Post(url, "application/x-ndjson", strings.NewReader(body))
		if err != nil {
			t.Fatal(err)
		}
		defer resp.Body.Close()
		b, err := io.ReadAll(resp.Body)
		if err != nil {
			t.Fatal(err)
		}
		return resp.StatusCode, string(b)
	}
	if code, body := post(`{"vendor":"` + p + `","id":"` + p + `-1","path":"/a"}`); code != http.StatusAccepted || !strings.Contains(body, p+"-1") {
		t.Fatalf("POST one call: %d %s, want 202 with its id", code, body)
	}
	if o, err := runShaper(t, "", "explain", "--config", cfg, p+"-1"); err != nil || !strings.Contains(o, p) {
		t.Errorf("explain the posted call: %v\n%s", err, o)
	}
	if code, body := post("{\"vendor\":\"" + p + "\",\"path\":\"/a\"}\n{\"vendor\":\"" + p + "\",\"method\":\"get\"}\n"); code != http.StatusBadRequest || !strings.Contains(body, `"line":2`) {
		t.Errorf("POST a bad line: %d %s, want 400 naming line 2", code, body)
	}
	one := `{"vendor":"` + p + `","id":"` + p + `-refused","path":"/a"}`
	for _, tc := range []struct {
		name, host, ctype string
		header            []string
		status            int
	}{
		{"another Host", "evil.example", "application/json", nil, http.StatusMisdirectedRequest},
		{"another site's page", "", "application/json", []string{"Origin", "https://evil.example"}, http.StatusForbidden},
		{"no Content-Type", "", "", nil, http.StatusUnsupportedMediaType},
	} {
		if code, body := send(t, "POST", url, tc.host, tc.ctype, one, tc.header...); code != tc.status {
			t.Errorf("POST with %s: %d %s, want %d", tc.name, code, body, tc.status)
		}
	}
	if o, err := runShaper(t, "", "explain", "--config", cfg, p+"-refused"); err == nil {
		t.Errorf("a refused POST queued its call:\n%s", o)
	}
	if o, err := runShaper(t, "", "serve", "--config", cfg, "--addr", "0.0.0.0:0"); err == nil || !strings.Contains(o, "--api-token") {
		t.Errorf("serve on 0.0.0.0 without a token: %v\n%s, want it refused naming --api-token", err, o)
	}
}

// TestWorkerServesTheAPI: `shaper worker --api-addr` serves the same API
// beside its work, and refuses a non-loopback address without a token.
func TestWorkerServesTheAPI(t *testing.T) {
	t.Parallel()
	p := "wapi" + redistest.Prefix(t)[5:]
	vendor := newOKVendor(t)
	cfg := filepath.Join(t.TempDir(), "config.toml")
	err := os.WriteFile(cfg, []byte(`[redis]
addr = "`+redistest.Addr(t)+`"

[vendors.`+p+`]
base_url = "`+vendor+`"
rate = 20
`), 0o600)
	if err != nil {
		t.Fatal(err)
	}
	cmd := exec.Command(shaperBin(t), "worker", "--config", cfg, "--api-addr", "127.0.0.1:0")
	out := &logtest.Buffer{}
	cmd.Stdout, cmd.Stderr = out, out
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = cmd.Process.Kill(); _ = cmd.Wait() })
	url := pageURL(t, out)
	resp, err := http.Post(url, "application/json", strings.NewReader(`{"vendor":"`+p+`","id":"`+p+`-1","path":"/a"}`))
	if err != nil {
		t.Fatal(err)
	}
	posted, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	if resp.StatusCode != http.StatusAccepted {
		t.Fatalf("POST to the worker's API at %s: %d %s, want 202; the worker's log:\n%s", url, resp.StatusCode, posted, out)
	}
	resp, err = http.Get(strings.TrimSuffix(url, "/v1/calls") + "/v1/calls/" + p + "-1?wait=20s")
	if err != nil {
		t.Fatal(err)
	}
	b, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	if !strings.Contains(string(b), `"state":"completed"`) {
		t.Errorf("GET ?wait=20s from the worker that ran it: %d %s, want completed; the worker's log:\n%s", resp.StatusCode, b, out)
	}
	if o, err := runShaper(t, "", "worker", "--config", cfg, "--api-addr", "0.0.0.0:0"); err == nil || !strings.Contains(o, "--api-token") {
		t.Errorf("worker --api-addr 0.0.0.0:0 without a token: %v\n%s, want it refused naming --api-token", err, o)
	}
}

// newOKVendor is a vendor that answers every call 200, until the test
// ends; it returns its base URL.
func newOKVendor(t *testing.T) string {
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, _ *http.Request) {
		w.Header().Set("Content-Type", "application/json")
		_, _ = io.WriteString(w, `{"ok":true}`)
	}))
	t.Cleanup(srv.Close)
	return srv.URL
}

// send is one request to a server the test started: Host host (when not
// ""), Content-Type ctype (when not ""), more headers; it returns the
// status and the body.
func send(t *testing.T, method, url, host, ctype, body string, header ...string) (int, string) {
	t.Helper()
	req, err := http.NewRequest(method, url, strings.NewReader(body))
	if err != nil {
		t.Fatal(err)
	}
	if host != "" {
		req.Host = host
	}
	if ctype != "" {
		req.Header.Set("Content-Type", ctype)
	}
	for i := 0; i+1 < len(header); i += 2 {
		req.Header.Set(header[i], header[i+1])
	}
	resp, err := (&http.Client{Timeout: 10 * time.Second}).Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	return resp.StatusCode, string(b)
}
