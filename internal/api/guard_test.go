package api

import (
	"bufio"
	"bytes"
	"context"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"runtime"
	"strings"
	"sync"
	"testing"
	"time"
)

// doWith is do with the request's Host (when not "") and more headers.
func doWith(t *testing.T, method, url, ctype, host string, body []byte, header ...string) answer {
	t.Helper()
	req, err := http.NewRequest(method, url, bytes.NewReader(body))
	if err != nil {
		t.Fatal(err)
	}
	if ctype != "" {
		req.Header.Set("Content-Type", ctype)
	}
	if host != "" {
		req.Host = host
	}
	for i := 0; i+1 < len(header); i += 2 {
		req.Header.Set(header[i], header[i+1])
	}
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	if err != nil {
		t.Fatal(err)
	}
	return answer{resp.StatusCode, resp.Header, b}
}

// TestRefusesAForeignHost: a request whose Host is not the API's address
// (what a page whose name was rebound to 127.0.0.1 sends) is 421 naming
// the Host seen and the names accepted, and queues nothing; any
// loopback name with the API's port is its address.
func TestRefusesAForeignHost(t *testing.T) {
	s := newSetup(t, Options{}, 10, false)
	_, port, _ := net.SplitHostPort(strings.TrimPrefix(s.url, "http://"))
	for _, host := range []string{"evil.example", "evil.example:" + port, "127.0.0.1:1", "localhost"} {
		a := doWith(t, "POST", s.url+"/v1/calls", "application/x-ndjson", host, ndjson(s.vendor, "h-evil"))
		if a.status != http.StatusMisdirectedRequest || !bytes.Contains(a.body, []byte(`Host \"`+host+`\"`)) || !bytes.Contains(a.body, []byte("localhost:"+port)) {
			t.Errorf("POST with Host %s: %d %s, want 421 naming it and localhost:%s", host, a.status, a.body, port)
		}
		if a := doWith(t, "GET", s.url+"/v1/calls/h-evil", "", host, nil); a.status != http.StatusMisdirectedRequest {
			t.Errorf("GET with Host %s: %d %s, want 421", host, a.status, a.body)
		}
	}
	if n, err := s.client.Waiting(context.Background(), s.vendor); err != nil || n != 0 {
		t.Fatalf("%d calls waiting after foreign Hosts (%v), want 0", n, err)
	}
	for i, host := range []string{"localhost:" + port, "[::1]:" + port, "127.0.0.1:" + port} {
		if a := doWith(t, "POST", s.url+"/v1/calls", "application/x-ndjson", host, ndjson(s.vendor, fmt.Sprint("h-", i))); a.status != http.StatusAccepted {
			t.Errorf("POST with Host %s: %d %s, want 202", host, a.status, a.body)
		}
	}
}

// TestRefusesCrossSite: without a token, a request a browser sends for
// another site's page (Origin, Sec-Fetch-Site) is 403 and queues
// nothing; the API's own origin is served; with a token, the token
// decides.
func TestRefusesCrossSite(t *testing.T) {
	s := newSetup(t, Options{}, 10, false)
	for _, h := range [][]string{
		{"Origin", "https://evil.example"},
		{"Origin", "null"},
		{"Origin", "http://localhost:1"},
		{"Sec-Fetch-Site", "cross-site"},
		{"Sec-Fetch-Site", "same-site"},
	} {
		a := doWith(t, "POST", s.url+"/v1/calls", "application/x-ndjson", "", ndjson(s.vendor, "x-evil"), h...)
		if a.status != http.StatusForbidden || !bytes.Contains(a.body, []byte("cross-site")) {
			t.Errorf("POST with %s: %s: %d %s, want 403", h[0], h[1], a.status, a.body)
		}
	}
	if n, err := s.client.Waiting(context.Background(), s.vendor); err != nil || n != 0 {
		t.Fatalf("%d calls waiting after cross-site POSTs (%v), want 0", n, err)
	}
	if a := doWith(t, "POST", s.url+"/v1/calls", "application/x-ndjson", "", ndjson(s.vendor, "x-own"), "Origin", s.url, "Sec-Fetch-Site", "same-origin"); a.status != http.StatusAccepted {
		t.Errorf("POST from the API's own origin: %d %s, want 202", a.status, a.body)
	}
	tok := newSetup(t, Options{Token: "s3cret"}, 10, false)
	if a := doWith(t, "POST", tok.url+"/v1/calls", "application/x-ndjson", "", ndjson(tok.vendor, "x-tok"), "Origin", "https://app.example", "Authorization", "Bearer s3cret"); a.status != http.StatusAccepted {
		t.Errorf("POST with the token from another origin: %d %s, want 202", a.status, a.body)
	}
}

// TestRefusesABodyWithoutContentType: a body without a Content-Type is
// 415 naming the types taken, and nothing is queued (it used to be read
// as JSON, which is what a page's no-cors fetch sends).
func TestRefusesABodyWithoutContentType(t *testing.T) {
	s := newSetup(t, Options{}, 10, false)
	for _, ctype := range []string{"", "text/plain"} {
		a := do(t, "POST", s.url+"/v1/calls", ctype, "", []byte(fmt.Sprintf(`{"vendor":%q,"id":"no-ct","path":"/a"}`, s.vendor)))
		if a.status != http.StatusUnsupportedMediaType || !bytes.Contains(a.body, []byte("application/json")) || !bytes.Contains(a.body, []byte("application/x-ndjson")) {
			t.Errorf("POST with Content-Type %q: %d %s, want 415 naming application/json and application/x-ndjson", ctype, a.status, a.body)
		}
	}
	if n, err := s.client.Waiting(context.Background(), s.vendor); err != nil || n != 0 {
		t.Fatalf("%d calls waiting after bodies without a Content-Type (%v), want 0", n, err)
	}
}

// TestRefusesAHugeDeclaredBody: a body that announces more than MaxBody
// is 413 at once, before any of it is read: the client has sent 100
// bytes of the terabyte it announced and the answer comes anyway.
func TestRefusesAHugeDeclaredBody(t *testing.T) {
	s := newSetup(t, Options{MaxBody: 4096}, 10, false)
	host := strings.TrimPrefix(s.url, "http://")
	conn, err := net.Dial("tcp", host)
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	_ = conn.SetDeadline(time.Now().Add(20 * time.Second))
	fmt.Fprintf(conn, "POST /v1/calls HTTP/1.1\r\nHost: %s\r\nContent-Type: application/x-ndjson\r\nContent-Length: %d\r\n\r\n%s", host, int64(1)<<40, bytes.Repeat([]byte("x"), 100))
	resp, err := http.ReadResponse(bufio.NewReader(conn), nil)
	if err != nil {
		t.Fatalf("no answer to a body announced at 1 TiB (the server waits for it?): %v", err)
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	if resp.StatusCode != http.StatusRequestEntityTooLarge || !bytes.Contains(b, []byte("larger than 4096 bytes")) {
		t.Errorf("a body announced at 1 TiB: %d %s, want 413 naming the limit", resp.StatusCode, b)
	}
}

// TestReadBodyAllocatesWhatArrives: a body that announces 8 MiB and
// sends 2 bytes costs what arrived, not what it announced.
func TestReadBodyAllocatesWhatArrives(t *testing.T) {
	r := httptest.NewRequest("POST", "/v1/calls", strings.NewReader("{}"))
	r.ContentLength = DefaultMaxBody
	var before, after runtime.MemStats
	runtime.ReadMemStats(&before)
	body, err := readBody(httptest.NewRecorder(), r, DefaultMaxBody)
	runtime.ReadMemStats(&after)
	if err != nil || string(body) != "{}" {
		t.Fatalf("readBody = %q, %v", body, err)
	}
	if n := after.TotalAlloc - before.TotalAlloc; n > 1<<20 {
		t.Errorf("reading 2 bytes announced as %d allocated %d bytes", DefaultMaxBody, n)
	}
}

// TestWaitingIsBounded: with MaxWaiting GETs holding a ?wait=, one more
// is 503 with Retry-After saying why; once they end, a GET with ?wait=
// is taken again.
func TestWaitingIsBounded(t *testing.T) {
	s := newSetup(t, Options{MaxWaiting: 2}, 10, false) // no worker: the call stays pending
	if a := do(t, "POST", s.url+"/v1/calls", "application/x-ndjson", "", ndjson(s.vendor, "w-1")); a.status != http.StatusAccepted {
		t.Fatalf("POST: %d %s", a.status, a.body)
	}
	// Two hold (each asks again while the probe below has its slot),
	// until the call is cancelled.
	var holders sync.WaitGroup
	for range 2 {
		holders.Go(func() {
			for do(t, "GET", s.url+"/v1/calls/w-1?wait=50s", "", "", nil).status == http.StatusServiceUnavailable {
				time.Sleep(time.Millisecond)
			}
		})
	}
	// Once both hold, one more is refused; before, it may be taken (and
	// answers at once: its wait is 1 ms).
	var a answer
	deadline := time.Now().Add(30 * time.Second)
	for a = do(t, "GET", s.url+"/v1/calls/w-1?wait=1ms", "", "", nil); a.status != http.StatusServiceUnavailable && time.Now().Before(deadline); {
		time.Sleep(10 * time.Millisecond)
		a = do(t, "GET", s.url+"/v1/calls/w-1?wait=1ms", "", "", nil)
	}
	if a.status != http.StatusServiceUnavailable || a.header.Get("Retry-After") == "" || !bytes.Contains(a.body, []byte("2 requests already wait")) {
		t.Fatalf("a third GET ?wait= beside two: %d %s (Retry-After %q), want 503 with Retry-After saying 2 already wait", a.status, a.body, a.header.Get("Retry-After"))
	}
	if a := do(t, "GET", s.url+"/v1/calls/w-1", "", "", nil); a.status != http.StatusOK {
		t.Errorf("a GET without ?wait= beside them: %d %s, want 200", a.status, a.body)
	}
	// Cancelling the call ends both holders (it is gone).
	if a := do(t, "DELETE", s.url+"/v1/calls/w-1", "", "", nil); a.status != http.StatusOK {
		t.Fatalf("DELETE: %d %s", a.status, a.body)
	}
	holders.Wait()
	if a := do(t, "GET", s.url+"/v1/calls/w-1?wait=1ms", "", "", nil); a.status != http.StatusNotFound {
		t.Errorf("GET ?wait= after the holders ended: %d %s, want 404 (taken, and the call is gone)", a.status, a.body)
	}
}

// TestServerTimeouts: the API's server has read, write and idle
// timeouts, and its write timeout outlasts the longest ?wait=.
func TestServerTimeouts(t *testing.T) {
	for _, wait := range []time.Duration{0, 5 * time.Minute} {
		srv := NewServer(Options{MaxWait: wait}, nil)
		longest := max(wait, DefaultMaxWait)
		if srv.ReadHeaderTimeout <= 0 || srv.ReadTimeout <= 0 || srv.IdleTimeout <= 0 || srv.WriteTimeout <= srv.ReadTimeout+longest {
			t.Errorf("MaxWait %s: read header %s, read %s, write %s, idle %s; want each set, write beyond read + %s",
				wait, srv.ReadHeaderTimeout, srv.ReadTimeout, srv.WriteTimeout, srv.IdleTimeout, longest)
		}
	}
}

// TestPollSlowsWithWaiters: up to pollShare waiting GETs each look
// every Poll; beyond, each looks less often, so that together they
// read Redis about pollShare times per Poll.
func TestPollSlowsWithWaiters(t *testing.T) {
	s := &server{o: Options{Poll: 20 * time.Millisecond}, waiting: make(chan struct{}, DefaultMaxWaiting)}
	for _, tc := range []struct {
		waiting int
		want    time.Duration
	}{{1, 20 * time.Millisecond}, {50, 20 * time.Millisecond}, {51, 40 * time.Millisecond}, {100, 40 * time.Millisecond}, {1000, 400 * time.Millisecond}} {
		for len(s.waiting) < tc.waiting {
			s.waiting <- struct{}{}
		}
		if got := s.poll(); got != tc.want {
			t.Errorf("%d waiting: poll %s, want %s", tc.waiting, got, tc.want)
		}
	}
}
