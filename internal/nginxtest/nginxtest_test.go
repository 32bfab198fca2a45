package nginxtest

import (
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"go.uber.org/goleak"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

// fakeTB records Skip and Fatal instead of ending the test.
type fakeTB struct {
	testing.TB
	skipped, failed string
}

func (f *fakeTB) Helper()                           {}
func (f *fakeTB) Skip(args ...any)                  { f.skipped = fmt.Sprint(args...) }
func (f *fakeTB) Fatal(args ...any)                 { f.failed = fmt.Sprint(args...) }
func (f *fakeTB) Fatalf(format string, args ...any) { f.failed = fmt.Sprintf(format, args...) }

// TestMissingFails: a test that needs nginx fails without it, saying
// what to install, whatever CI says (no environment variable decides a
// verdict).
func TestMissingFails(t *testing.T) {
	notFound := errors.New("no nginx on PATH")
	for _, ci := range []string{"", "true"} {
		t.Setenv("CI", ci)
		f := &fakeTB{TB: t}
		missing(f, notFound)
		if f.skipped != "" || !strings.Contains(f.failed, "apt-get install nginx-light") {
			t.Fatalf("CI=%q: skipped %q, failed %q; want a failure saying how to install nginx", ci, f.skipped, f.failed)
		}
	}
}

// TestBinarySearchesSbin: nginx off PATH is found where Debian installs
// it (searchPath), and its absence is an error naming where it looked. A
// stand-in executable plays nginx: the test needs no nginx.
func TestBinarySearchesSbin(t *testing.T) {
	t.Setenv("PATH", t.TempDir())
	dir := t.TempDir()
	fake := filepath.Join(dir, "nginx")
	saved := searchPath
	t.Cleanup(func() { searchPath = saved })
	searchPath = []string{filepath.Join(dir, "missing", "nginx"), fake}
	if bin, err := binary(); err == nil || !strings.Contains(err.Error(), fake) {
		t.Fatalf("binary() = %q, %v with nothing installed; want an error naming %s", bin, err, fake)
	}
	if err := os.WriteFile(fake, []byte("#!/bin/sh\n"), 0o755); err != nil {
		t.Fatal(err)
	}
	if bin, err := binary(); err != nil || bin != fake {
		t.Fatalf("binary() = %q, %v with an empty PATH; want %s", bin, err, fake)
	}
	if _, err := exec.LookPath("nginx"); err == nil {
		t.Fatal("PATH was not emptied")
	}
}

func TestConfig(t *testing.T) {
	for _, tt := range []struct {
		burst, retryAfter int
		root              bool
		want              []string
		not               []string
	}{
		{0, 0, false, []string{"limit_req zone=api;", "rate=100r/s;"}, []string{"burst", "nodelay", "user ", "Retry-After", "@limited"}},
		{5, 0, true, []string{"limit_req zone=api burst=5 nodelay;", "user root;"}, []string{"Retry-After"}},
		{0, 1, false, []string{"error_page 429 = @limited;", "location @limited {", "add_header Retry-After 1 always;", "return 429 "}, nil},
	} {
		c := config("/tmp/x", 8080, Options{Rate: 100, Burst: tt.burst, RetryAfter: tt.retryAfter}, tt.root)
		for _, s := range append(tt.want, "listen 127.0.0.1:8080;", "limit_req_status 429;", `access_log "/tmp/x/access.log" timed;`,
			"daemon off;", "master_process off;", "limit_req_zone $server_name zone=api:1m") {
			if !strings.Contains(c, s) {
				t.Errorf("burst %d: config lacks %q:\n%s", tt.burst, s, c)
			}
		}
		for _, s := range tt.not {
			if strings.Contains(c, s) {
				t.Errorf("burst %d: config has %q:\n%s", tt.burst, s, c)
			}
		}
	}
}

func TestParseLog(t *testing.T) {
	reqs, err := parseLog([]byte("1700000000.123 200\n1700000000.004 429\n1700000001.0"))
	if err != nil {
		t.Fatal(err)
	}
	want := []Request{
		{time.Unix(1_700_000_000, 123_000_000), 200},
		{time.Unix(1_700_000_000, 4_000_000), 429},
	}
	if len(reqs) != len(want) {
		t.Fatalf("parsed %d requests, want %d (a partial last line is left out)", len(reqs), len(want))
	}
	for i := range want {
		if !reqs[i].At.Equal(want[i].At) || reqs[i].Status != want[i].Status {
			t.Fatalf("request %d = %+v, want %+v", i, reqs[i], want[i])
		}
	}
	for _, bad := range []string{"1700000000 200\n", "1700000000.12 200\n", "x.123 200\n", "1700000000.123 ok\n", "1700000000.123\n"} {
		if _, err := parseLog([]byte(bad)); err == nil || !strings.HasPrefix(err.Error(), "nginxtest: access log line 1") {
			t.Errorf("parseLog(%q) = %v, want an error naming line 1", bad, err)
		}
	}
}
