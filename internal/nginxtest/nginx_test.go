//go:build nginx

package nginxtest

import (
	"io"
	"net/http"
	"os"
	"strings"
	"syscall"
	"testing"
	"time"
)

// These tests run a real nginx: built with -tags nginx only (make
// test-nginx), so that make test needs Go alone.

// caller sends requests to one URL, checking admitted answers.
type caller struct {
	t      *testing.T
	url    string
	client *http.Client
}

func newCaller(t *testing.T, url string) *caller {
	tr := &http.Transport{}
	t.Cleanup(tr.CloseIdleConnections)
	return &caller{t: t, url: url + "/call", client: &http.Client{Transport: tr, Timeout: 5 * time.Second}}
}

// call sends one request and returns its status.
func (c *caller) call() int {
	c.t.Helper()
	resp, err := c.client.Get(c.url)
	if err != nil {
		c.t.Fatal(err)
	}
	body, err := io.ReadAll(resp.Body)
	resp.Body.Close()
	if err != nil {
		c.t.Fatal(err)
	}
	if resp.StatusCode == http.StatusOK {
		if string(body) != `{"ok":true}` || resp.Header.Get("Content-Type") != "application/json" {
			c.t.Fatalf("200 answer %q with Content-Type %q", body, resp.Header.Get("Content-Type"))
		}
	}
	return resp.StatusCode
}

// get sends n requests one after another, sleeping gap after each answer,
// and returns the statuses.
func get(t *testing.T, url string, n int, gap time.Duration) []int {
	t.Helper()
	c := newCaller(t, url)
	statuses := make([]int, 0, n)
	for range n {
		statuses = append(statuses, c.call())
		if gap > 0 {
			time.Sleep(gap)
		}
	}
	return statuses
}

// logged waits for n requests in h's access log and checks that they have
// the statuses the caller saw, in order.
func logged(t *testing.T, h *Harness, statuses []int) []Request {
	t.Helper()
	reqs, err := h.WaitRequests(len(statuses), 5*time.Second)
	if err != nil {
		t.Fatal(err)
	}
	if len(reqs) != len(statuses) {
		t.Fatalf("access log holds %d requests, want %d", len(reqs), len(statuses))
	}
	for i, r := range reqs {
		if r.Status != statuses[i] {
			t.Fatalf("access log request %d has status %d, the caller saw %d", i, r.Status, statuses[i])
		}
		if d := time.Since(r.At); d < 0 || d > time.Minute {
			t.Fatalf("access log request %d at %v, %v ago", i, r.At, d)
		}
	}
	return reqs
}

// TestRateNoBurst sends requests one after another as fast as it can at
// 100/s with no burst (at least 200, and on until 10 were admitted, so
// that there are gaps to check): nginx rejects some and admits the others
// at least 10 ms apart (9 ms allows for $msec and limit_req reading the
// clock apart), and no more than 100/s.
func TestRateNoBurst(t *testing.T) {
	h := Start(t, 100, 0)
	c := newCaller(t, h.URL)
	var statuses []int
	for admitted := 0; len(statuses) < 200 || admitted < 10; {
		if len(statuses) == 100_000 {
			t.Fatalf("%d of %d requests admitted", admitted, len(statuses))
		}
		s := c.call()
		if s == http.StatusOK {
			admitted++
		}
		statuses = append(statuses, s)
	}
	reqs := logged(t, h, statuses)
	var admitted []time.Time
	for _, r := range reqs {
		switch r.Status {
		case http.StatusOK:
			admitted = append(admitted, r.At)
		case http.StatusTooManyRequests:
		default:
			t.Fatalf("status %d, want 200 or 429", r.Status)
		}
	}
	if len(admitted) == len(reqs) {
		t.Fatalf("all %d requests admitted, want some rejected", len(reqs))
	}
	for i := 1; i < len(admitted); i++ {
		if gap := admitted[i].Sub(admitted[i-1]); gap < 9*time.Millisecond {
			t.Fatalf("admitted requests %d and %d are %v apart, want at least 9 ms", i-1, i, gap)
		}
	}
	span := reqs[len(reqs)-1].At.Sub(reqs[0].At)
	if most := int(span/(10*time.Millisecond)) + 2; len(admitted) > most {
		t.Fatalf("%d admitted over %v, want at most %d at 100/s", len(admitted), span, most)
	}
	t.Logf("%d of %d admitted over %v", len(admitted), len(reqs), span)
}

// TestRateSpaced sends 200 requests at least 12 ms apart at 100/s: nginx
// admits them all.
func TestRateSpaced(t *testing.T) {
	h := Start(t, 100, 0)
	statuses := get(t, h.URL, 200, 12*time.Millisecond)
	for _, r := range logged(t, h, statuses) {
		if r.Status != http.StatusOK {
			t.Fatalf("a request spaced 12 ms from the last got %d, want 200", r.Status)
		}
	}
}

// TestBurst sends 30 requests at once at 1/s with a burst of 10: nginx
// admits the first and the burst, without delay, and rejects the rest.
func TestBurst(t *testing.T) {
	h := Start(t, 1, 10)
	statuses := get(t, h.URL, 30, 0)
	admitted := 0
	for _, s := range statuses {
		if s == http.StatusOK {
			admitted++
		}
	}
	if admitted != 11 {
		t.Fatalf("admitted %d of 30, want 11 (1 + a burst of 10)", admitted)
	}
	logged(t, h, statuses)
}

// TestStopLeavesNoProcess checks that nginx is gone when the test ends.
func TestStopLeavesNoProcess(t *testing.T) {
	var h *Harness
	t.Run("run", func(t *testing.T) { h = Start(t, 10, 0) })
	if h == nil {
		t.Fatal("nginx did not start (see the run subtest)")
	}
	select {
	case <-h.done:
	default:
		t.Fatal("nginx still running after its test ended")
	}
	if err := h.cmd.Process.Signal(syscall.Signal(0)); err == nil {
		t.Fatal("nginx process still signalable after its test ended")
	}
	if pid, err := os.ReadFile(h.dir + "/nginx.pid"); err == nil {
		t.Fatalf("nginx left its pid file (%s) behind", strings.TrimSpace(string(pid)))
	}
}

// TestRetryAfter: with RetryAfter set, every 429 carries it, and an
// admitted request does not.
func TestRetryAfter(t *testing.T) {
	h := StartWith(t, Options{Rate: 1, RetryAfter: 1})
	var limited int
	for i := range 5 {
		resp, err := http.Get(h.URL + "/x")
		if err != nil {
			t.Fatal(err)
		}
		resp.Body.Close()
		ra := resp.Header.Get("Retry-After")
		switch {
		case resp.StatusCode == http.StatusOK && ra != "":
			t.Errorf("request %d admitted with Retry-After %q", i, ra)
		case resp.StatusCode == http.StatusTooManyRequests && ra != "1":
			t.Errorf("request %d: 429 with Retry-After %q, want \"1\"", i, ra)
		case resp.StatusCode == http.StatusTooManyRequests:
			limited++
		case resp.StatusCode != http.StatusOK:
			t.Errorf("request %d: status %d, want 200 or 429", i, resp.StatusCode)
		}
	}
	if limited == 0 {
		t.Fatal("5 requests at once at 1/s: none refused")
	}
}
