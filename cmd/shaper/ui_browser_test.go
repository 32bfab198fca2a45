//go:build browser

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
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	cdplog "github.com/chromedp/cdproto/log"
	"github.com/chromedp/cdproto/runtime"
	"github.com/chromedp/chromedp"

	"github.com/shaper-dev/shaper/internal/redistest"
	"github.com/shaper-dev/shaper/internal/vendorsim"
)

// This file is built with -tags browser only (make test-browser, make
// ui-screenshot): make test needs Go alone, and Chromium's protocol
// packages are a large build.

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
	vend := &vendorsim.Mock{Rate: 20, Window: time.Second}
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
