package main

import (
	"bytes"
	"context"
	"flag"
	"fmt"
	"net/http"
	"net/http/httptest"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	cdplog "github.com/chromedp/cdproto/log"
	"github.com/chromedp/cdproto/runtime"
	"github.com/chromedp/chromedp"

	"github.com/shaper-dev/shaper/internal/logtest"
	"github.com/shaper-dev/shaper/internal/redistest"
	"github.com/shaper-dev/shaper/internal/vendorsim"
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

// chromium finds a Chromium or Chrome binary on PATH. The browser test
// needs one wherever it runs, as the fault tests need redis-server:
// without one it fails and says what to install (.ci/run installs it).
func chromium(t *testing.T) string {
	t.Helper()
	for _, name := range []string{"chromium", "chromium-browser", "google-chrome", "headless-shell"} {
		if p, err := exec.LookPath(name); err == nil {
			return p
		}
	}
	t.Fatal("the live page's browser test (make test-browser) needs Chromium on PATH: apt-get install chromium (or any of chromium-browser, google-chrome, headless-shell)")
	return ""
}

// screenshot, when set, is where TestPageInBrowser saves the page it
// checked (make ui-screenshot: -args -screenshot docs/ui.png).
var screenshot = flag.String("screenshot", "", "TestPageInBrowser: save a screenshot of the live page to this PNG file")

// TestPageInBrowser loads the live page of a real worker in headless
// Chromium while calls go out, and checks that the chart and the numbers
// move, that a 429 pause shows with its reason, that explain answers on
// the page, and that the page logs no console error. It logs the chart's
// latest value beside the rate the vendor really saw (wall clock: logged,
// not asserted; TestHistory asserts the figure on simulated time). It
// takes a screenshot of the page, and saves it with -screenshot (make
// ui-screenshot writes docs/ui.png).
func TestPageInBrowser(t *testing.T) {
	t.Parallel() // its figures are logged, not asserted: it runs beside the other light tests
	chrome := chromium(t)
	p := "page" + redistest.Prefix(t)[5:]
	vend := &vendorsim.Vendor{Rate: 20, Window: time.Second}
	var refuse atomic.Int32 // answers left to refuse with a 429
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if refuse.Add(-1) >= 0 {
			w.Header().Set("Retry-After", "3")
			w.WriteHeader(http.StatusTooManyRequests)
			return
		}
		vend.ServeHTTP(w, r)
	}))
	defer srv.Close()
	cfg := writeConfig(t, redistest.Addr(t), p, srv.URL, 10)
	_, out := startWorker(t, cfg, "--ui-addr", "127.0.0.1:0")
	url := pageURL(t, out)
	if o, err := runShaper(t, jobLines(p, 300), "enqueue", "--config", cfg, "--vendor", p, "--file", "-"); err != nil {
		t.Fatalf("enqueue: %v\n%s", err, o)
	}

	actx, cancelAlloc := chromedp.NewExecAllocator(context.Background(), append(chromedp.DefaultExecAllocatorOptions[:],
		chromedp.ExecPath(chrome), chromedp.NoSandbox, chromedp.DisableGPU, chromedp.Flag("disable-dev-shm-usage", true),
		chromedp.WindowSize(1100, 900))...)
	defer cancelAlloc()
	var mu sync.Mutex
	var consoleErrors []string
	ctx, cancel := chromedp.NewContext(actx, chromedp.WithListener(func(ev any) {
		mu.Lock()
		defer mu.Unlock()
		switch e := ev.(type) {
		case *runtime.EventConsoleAPICalled:
			if e.Type == runtime.ConsoleAPICalledTypeError || e.Type == runtime.ConsoleAPICalledTypeWarning {
				var args []string
				for _, a := range e.Args {
					args = append(args, string(a.Value))
				}
				consoleErrors = append(consoleErrors, fmt.Sprintf("console.%s: %s", e.Type, strings.Join(args, " ")))
			}
		case *runtime.EventExceptionThrown:
			consoleErrors = append(consoleErrors, fmt.Sprintf("exception: %s (line %d)", e.ExceptionDetails.Text, e.ExceptionDetails.LineNumber))
		case *cdplog.EventEntryAdded: // failed loads, CSP violations
			if e.Entry.Level == cdplog.EntryLevelError || e.Entry.Level == cdplog.EntryLevelWarning {
				consoleErrors = append(consoleErrors, fmt.Sprintf("%s %s: %s %s", e.Entry.Source, e.Entry.Level, e.Entry.Text, e.Entry.URL))
			}
		}
	}))
	defer cancel()
	ctx, cancelTimeout := context.WithTimeout(ctx, 90*time.Second)
	defer cancelTimeout()
	sel := `section.vendor[data-vendor="` + p + `"]`
	if err := chromedp.Do(ctx, chromedp.Navigate(url), chromedp.WaitVisible(chromedp.CSS(sel+` svg.plot`))); err != nil {
		t.Fatalf("load %s: %v", url, err)
	}
	// read returns the chart's latest value, its points and a number.
	eval := func(expr string) string {
		t.Helper()
		v, err := chromedp.Run(ctx, chromedp.Evaluate[string](expr))
		if err != nil {
			t.Fatalf("evaluate %s: %v", expr, err)
		}
		return v
	}
	read := func(key string) (latest float64, points int, text string) {
		t.Helper()
		latest, _ = strconv.ParseFloat(eval(`document.querySelector('`+sel+` svg.plot').dataset.latest || ""`), 64)
		points, _ = strconv.Atoi(eval(`document.querySelector('` + sel + ` svg.plot').dataset.points || "0"`))
		return latest, points, eval(`document.querySelector('` + sel + ` [data-k="` + key + `"]').textContent`)
	}
	var latest float64
	var points int
	var queued string
	waitUntil(t, 30*time.Second, "the chart to draw 6 intervals with calls going out", func() bool {
		latest, points, queued = read("queued")
		return points >= 6 && latest > 0
	})
	// The vendor's own count over the 5 s the page's figure spans.
	now := time.Now()
	var seen int
	for _, r := range vend.Requests() {
		if r.Status == 200 && r.At.After(now.Add(-5*time.Second)) {
			seen++
		}
	}
	t.Logf("chart's latest value %.2f calls/s; the vendor saw %.2f/s over the last 5 s (%+.1f%%)", latest, float64(seen)/5,
		100*(latest-float64(seen)/5)/(float64(seen)/5))
	time.Sleep(2 * time.Second)
	_, points2, queued2 := read("queued")
	q1, _ := strconv.Atoi(queued)
	q2, _ := strconv.Atoi(queued2)
	if points2 <= points || q2 >= q1 {
		t.Errorf("after 2 s the chart has %d points (was %d) and %d queued (was %d): want both to move", points2, points, q2, q1)
	}

	refuse.Store(1)
	var pauseNow, pauses string
	waitUntil(t, 20*time.Second, "the page to show the pause with its reason", func() bool {
		pauseNow = eval(`(function(){const e=document.querySelector('` + sel + ` [data-k="pause-now"]'); return e.hidden ? "" : e.textContent})()`)
		pauses = eval(`document.querySelector('` + sel + ` [data-k="pauses"]').textContent`)
		return strings.Contains(pauseNow, "HTTP 429, Retry-After: 3") && strings.Contains(pauses, "Retry-After: 3")
	})
	t.Logf("pause shown: %q; timeline: %q", pauseNow, pauses)

	id := fmt.Sprintf("%s-%05d", p, 299)
	err := chromedp.Do(ctx,
		chromedp.SetValue(chromedp.ID("explain-id"), id),
		chromedp.Click(chromedp.CSS(`#explain-form button`)))
	if err == nil {
		_, err = chromedp.Run(ctx, chromedp.Poll[bool](`document.querySelector('#explain-out').textContent.includes('`+id+`')`,
			chromedp.WithPollingTimeout(10*time.Second)))
	}
	explained := eval(`document.querySelector('#explain-out').textContent`)
	if err != nil || !strings.Contains(explained, "estimated start") {
		t.Errorf("explain on the page: %v %q, want the call's estimated start", err, explained)
	}
	t.Logf("explain on the page: %q", explained)

	png, err := chromedp.Run(ctx, chromedp.FullScreenshot(100))
	if err != nil || !bytes.HasPrefix(png, []byte("\x89PNG")) {
		t.Errorf("screenshot: %d bytes, %v; want a PNG", len(png), err)
	} else if *screenshot != "" {
		if err := os.WriteFile(*screenshot, png, 0o644); err != nil {
			t.Fatal(err)
		}
		t.Logf("screenshot: %s", *screenshot)
	}
	mu.Lock()
	defer mu.Unlock()
	if len(consoleErrors) > 0 {
		t.Errorf("the page logged %d console errors or warnings:\n%s", len(consoleErrors), strings.Join(consoleErrors, "\n"))
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
