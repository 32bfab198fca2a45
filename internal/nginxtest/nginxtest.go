// Package nginxtest gives tests a real nginx enforcing limit_req: a
// reference rate limiter (a leaky bucket counted in milliseconds) to run
// callers against. Start runs an nginx of the test's own on a free port,
// with its config, logs and temp files in the test's temp directory, and
// stops it when the test ends; Requests reads what it admitted and when
// from its access log.
//
// Without an nginx binary Start skips the test, except when CI is "true":
// then it fails, so that CI never skips silently.
package nginxtest

import (
	"bufio"
	"bytes"
	"errors"
	"fmt"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"
)

// Harness is a running nginx of one test's.
type Harness struct {
	// URL is the server's base URL, http://127.0.0.1:port. Every path
	// answers 200 {"ok":true} (application/json) when admitted, 429 when
	// over the limit.
	URL string

	dir  string // the prefix: config, logs and temp files
	cmd  *exec.Cmd
	done chan struct{} // closed when the process has exited
}

// Request is one request nginx logged.
type Request struct {
	At     time.Time // when nginx logged it, to the millisecond ($msec)
	Status int
}

// searchPath lists where nginx is looked for after PATH: Debian installs
// it in /usr/sbin, which is not on every user's PATH.
var searchPath = []string{"/usr/sbin/nginx", "/usr/local/sbin/nginx", "/usr/local/nginx/sbin/nginx"}

// binary finds the nginx binary.
func binary() (string, error) {
	if p, err := exec.LookPath("nginx"); err == nil {
		return p, nil
	}
	for _, p := range searchPath {
		if fi, err := os.Stat(p); err == nil && !fi.IsDir() && fi.Mode()&0o111 != 0 {
			return p, nil
		}
	}
	return "", fmt.Errorf("no nginx on PATH or in %s", strings.Join(searchPath, ", "))
}

// missing fails the test for want of nginx, saying what to install:
// where it runs is the target's choice (make test-nginx, make test-long),
// not the environment's.
func missing(tb testing.TB, err error) {
	tb.Helper()
	tb.Fatalf("nginxtest: this test needs nginx (apt-get install nginx-light, or nginx): %v", err)
}

// Options says how a test's nginx limits requests.
type Options struct {
	// Rate is limit_req's rate, requests per second, for all requests
	// together (limit_req_zone keyed by server name).
	Rate int
	// Burst is limit_req's burst, with nodelay; 0: no burst at all.
	Burst int
	// RetryAfter, when positive, is sent as "Retry-After: N" (seconds)
	// with every 429, as a front that adds it whatever the limit does
	// (add_header ... always); 0: no Retry-After, as limit_req sends.
	RetryAfter int
}

// Start runs nginx limiting all requests together to ratePerSecond,
// with burst (see Options), and stops it when the test ends. It waits
// until nginx accepts connections.
func Start(tb testing.TB, ratePerSecond, burst int) *Harness {
	tb.Helper()
	return StartWith(tb, Options{Rate: ratePerSecond, Burst: burst})
}

// StartWith is Start with every option.
func StartWith(tb testing.TB, o Options) *Harness {
	tb.Helper()
	if o.Rate <= 0 || o.Burst < 0 || o.RetryAfter < 0 {
		tb.Fatalf("nginxtest: Start(%+v): the rate must be positive, the burst and Retry-After not negative", o)
	}
	bin, err := binary()
	if err != nil {
		missing(tb, err)
		return nil
	}
	// A free port may be taken between finding it and nginx binding it:
	// try a few.
	for attempt := 1; ; attempt++ {
		h, err := start(bin, tb.TempDir(), o)
		if err == nil {
			tb.Cleanup(h.stop)
			return h
		}
		if !errors.Is(err, errPortTaken) || attempt == 3 {
			tb.Fatal(err)
		}
	}
}

var errPortTaken = errors.New("nginxtest: port taken")

// start writes the config into dir and starts nginx, returning once it
// accepts connections.
func start(bin, dir string, o Options) (*Harness, error) {
	port, err := freePort()
	if err != nil {
		return nil, err
	}
	conf := filepath.Join(dir, "nginx.conf")
	if err := os.WriteFile(conf, []byte(config(dir, port, o, os.Geteuid() == 0)), 0o644); err != nil {
		return nil, fmt.Errorf("nginxtest: write config: %w", err)
	}
	stderr, err := os.Create(filepath.Join(dir, "stderr.log"))
	if err != nil {
		return nil, fmt.Errorf("nginxtest: create stderr log: %w", err)
	}
	defer stderr.Close()
	// -e: the error log from the start, before the config is read (else
	// nginx tries the compiled-in /var/log/nginx/error.log).
	cmd := exec.Command(bin, "-p", dir+"/", "-c", conf, "-e", filepath.Join(dir, "error.log"))
	cmd.Stdout, cmd.Stderr = stderr, stderr
	cmd.SysProcAttr = dieWithParent() // a test binary killed mid-run leaves no nginx behind
	if err := cmd.Start(); err != nil {
		return nil, fmt.Errorf("nginxtest: start %s: %w", bin, err)
	}
	h := &Harness{URL: "http://127.0.0.1:" + strconv.Itoa(port), dir: dir, cmd: cmd, done: make(chan struct{})}
	go func() {
		_ = cmd.Wait()
		close(h.done)
	}()
	addr := "127.0.0.1:" + strconv.Itoa(port)
	deadline := time.Now().Add(10 * time.Second)
	for {
		select {
		case <-h.done:
			logs := h.logs()
			if strings.Contains(logs, "Address already in use") {
				return nil, fmt.Errorf("%w: %s", errPortTaken, logs)
			}
			return nil, fmt.Errorf("nginxtest: nginx exited before accepting connections on %s (%s):\n%s", addr, cmd.ProcessState, logs)
		default:
		}
		c, err := net.DialTimeout("tcp", addr, 200*time.Millisecond)
		if err == nil {
			c.Close()
			return h, nil
		}
		if time.Now().After(deadline) {
			h.stop()
			return nil, fmt.Errorf("nginxtest: nginx did not accept connections on %s within 10 s: %v\n%s", addr, err, h.logs())
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// config is nginx.conf for a server on port enforcing rate and burst,
// everything it writes kept in dir.
func config(dir string, port int, o Options, root bool) string {
	var b strings.Builder
	if root {
		// As root nginx would run as nobody, who may not read the
		// test's temp directory.
		b.WriteString("user root;\n")
	}
	p := func(name string) string { return strconv.Quote(filepath.Join(dir, name)) }
	limit := "limit_req zone=api;"
	if o.Burst > 0 {
		limit = fmt.Sprintf("limit_req zone=api burst=%d nodelay;", o.Burst)
	}
	limited := "" // the 429's own location, for its Retry-After
	if o.RetryAfter > 0 {
		limit += "\n\t\t\terror_page 429 = @limited;"
		limited = fmt.Sprintf(`
		location @limited {
			add_header Retry-After %d always;
			default_type application/json;
			return 429 '{"error":"rate limited"}';
		}
`, o.RetryAfter)
	}
	fmt.Fprintf(&b, `daemon off;
master_process off;
worker_processes 1;
pid %s;
error_log %s warn;

events {
	worker_connections 1024;
}

http {
	log_format timed '$msec $status';
	access_log %s timed;
	root %s;
	client_body_temp_path %s;
	proxy_temp_path %s;
	fastcgi_temp_path %s;
	uwsgi_temp_path %s;
	scgi_temp_path %s;

	# One zone keyed by the server's name: all requests share it (an
	# empty key would not be limited at all).
	limit_req_zone $server_name zone=api:1m rate=%dr/s;
	limit_req_status 429;

	server {
		listen 127.0.0.1:%d;
		server_name nginxtest;

		# return runs in the rewrite phase, before limit_req's preaccess
		# phase, so it would answer unlimited: try_files, after the
		# access phases, hands admitted requests to @ok.
		location / {
			%s
			try_files /nonexistent @ok;
		}

		location @ok {
			default_type application/json;
			return 200 '{"ok":true}';
		}
%s	}
}
`, p("nginx.pid"), p("error.log"), p("access.log"), p("www"),
		p("client_body_temp"), p("proxy_temp"), p("fastcgi_temp"), p("uwsgi_temp"), p("scgi_temp"),
		o.Rate, port, limit, limited)
	return b.String()
}

// freePort returns a TCP port on 127.0.0.1 that was free a moment ago.
func freePort() (int, error) {
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return 0, fmt.Errorf("nginxtest: find a free port: %w", err)
	}
	defer l.Close()
	return l.Addr().(*net.TCPAddr).Port, nil
}

// logs returns nginx's error log and stderr, for failure messages.
func (h *Harness) logs() string {
	var b strings.Builder
	for _, name := range []string{"error.log", "stderr.log"} {
		data, err := os.ReadFile(filepath.Join(h.dir, name))
		if err != nil {
			fmt.Fprintf(&b, "%s: %v\n", name, err)
			continue
		}
		fmt.Fprintf(&b, "%s:\n%s", name, data)
	}
	return b.String()
}

// stop asks nginx to quit gracefully (SIGQUIT), kills it after 5 s, and
// waits for it to exit.
func (h *Harness) stop() {
	_ = h.cmd.Process.Signal(syscall.SIGQUIT)
	select {
	case <-h.done:
	case <-time.After(5 * time.Second):
		_ = h.cmd.Process.Kill()
		<-h.done
	}
}

// Requests returns the requests nginx has logged, in the order it logged
// them. nginx logs a request just after answering it, so a caller that has
// just read an answer may not find it yet: WaitRequests waits for a count.
func (h *Harness) Requests() ([]Request, error) {
	data, err := os.ReadFile(filepath.Join(h.dir, "access.log"))
	if err != nil {
		return nil, fmt.Errorf("nginxtest: read the access log: %w", err)
	}
	return parseLog(data)
}

// WaitRequests returns the logged requests once there are at least n, or
// an error after timeout.
func (h *Harness) WaitRequests(n int, timeout time.Duration) ([]Request, error) {
	deadline := time.Now().Add(timeout)
	for {
		reqs, err := h.Requests()
		if err != nil || len(reqs) >= n {
			return reqs, err
		}
		if time.Now().After(deadline) {
			return reqs, fmt.Errorf("nginxtest: the access log holds %d requests after %v, want %d", len(reqs), timeout, n)
		}
		time.Sleep(10 * time.Millisecond)
	}
}

// parseLog parses access log lines of the form "$msec $status", such as
// "1700000000.123 200". A last line without its newline is still being
// written and is left out.
func parseLog(data []byte) ([]Request, error) {
	if i := bytes.LastIndexByte(data, '\n'); i < len(data)-1 {
		data = data[:i+1]
	}
	var reqs []Request
	sc := bufio.NewScanner(bytes.NewReader(data))
	for line := 1; sc.Scan(); line++ {
		r, err := parseLine(sc.Text())
		if err != nil {
			return nil, fmt.Errorf("nginxtest: access log line %d: %w", line, err)
		}
		reqs = append(reqs, r)
	}
	return reqs, sc.Err()
}

// parseLine parses one "$msec $status" line.
func parseLine(s string) (Request, error) {
	msec, status, ok := strings.Cut(s, " ")
	if !ok {
		return Request{}, fmt.Errorf("%q is not \"$msec $status\"", s)
	}
	secs, millis, ok := strings.Cut(msec, ".")
	if !ok || len(millis) != 3 {
		return Request{}, fmt.Errorf("%q: $msec is not seconds.milliseconds", s)
	}
	sec, err1 := strconv.ParseInt(secs, 10, 64)
	ms, err2 := strconv.ParseInt(millis, 10, 64)
	code, err3 := strconv.Atoi(status)
	if err := errors.Join(err1, err2, err3); err != nil || sec < 0 || ms < 0 {
		return Request{}, fmt.Errorf("%q is not \"$msec $status\": %v", s, err)
	}
	return Request{At: time.Unix(sec, ms*int64(time.Millisecond)), Status: code}, nil
}
