package main

import (
	"context"
	"encoding/json"
	"io"
	"log/slog"
	"net/http/httptest"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/shaper-dev/shaper/config"
	"github.com/shaper-dev/shaper/internal/embedded"
	"github.com/shaper-dev/shaper/internal/logtest"
	"github.com/shaper-dev/shaper/internal/redistest"
	"github.com/shaper-dev/shaper/internal/vendorsim"
)

// TestEmbeddedAddrFileIsPrivate: the embedded Redis's address file lives
// in a directory only this user can write (0700), is written 0600, and
// a file another local user could have written — writable by group or
// others, owned by another user, a symbolic link — is refused with an
// error naming the file and what to do, though it names a Redis that
// answers (here the test's real one, standing for another user's).
func TestEmbeddedAddrFileIsPrivate(t *testing.T) {
	dir := t.TempDir()
	t.Setenv("XDG_RUNTIME_DIR", dir)
	t.Setenv("TMPDIR", dir)
	cfg, err := config.Load(writeConfig(t, "", "emb", "http://127.0.0.1:1", 10))
	if err != nil {
		t.Fatal(err)
	}
	file, err := embeddedAddrFile(cfg.Path)
	if err != nil {
		t.Fatal(err)
	}
	if fi, err := os.Stat(filepath.Dir(file)); err != nil || fi.Mode().Perm() != 0o700 {
		t.Errorf("the address file's directory %s: %v, %v; want mode 0700", filepath.Dir(file), fi.Mode(), err)
	}
	hostile, _ := json.Marshal(embeddedRecord{Addr: redistest.Addr(t), PID: os.Getpid(), Config: cfg.Path})
	log := slog.New(slog.NewTextHandler(io.Discard, nil))
	refused := func(name, want string) {
		t.Helper()
		_, rdb, stop, err := connect(context.Background(), cfg, false, log)
		if err == nil {
			stop()
			t.Fatalf("%s: connected to %v through a file another user could have written", name, rdb)
		}
		for _, w := range []string{file, want, "rm " + file} {
			if !strings.Contains(err.Error(), w) {
				t.Errorf("%s: err = %v, want it to say %q", name, err, w)
			}
		}
	}
	for _, mode := range []os.FileMode{0o666, 0o620, 0o602} {
		os.Remove(file)
		if err := os.WriteFile(file, hostile, mode); err != nil {
			t.Fatal(err)
		}
		if err := os.Chmod(file, mode); err != nil { // past the umask
			t.Fatal(err)
		}
		refused("mode "+mode.String(), "writable by group or others")
	}

	os.Remove(file)
	if err := os.WriteFile(file, hostile, 0o600); err != nil {
		t.Fatal(err)
	}
	if os.Getuid() == 0 {
		if err := os.Chown(file, 65534, 65534); err != nil { // nobody
			t.Fatal(err)
		}
		refused("owned by nobody", "owned by uid 65534")
	} else {
		// Only root can give a file away: judge a file root owns.
		fi, err := os.Stat("/")
		if err != nil {
			t.Fatal(err)
		}
		if err := private("/", fi, true); err == nil || !strings.Contains(err.Error(), "owned by uid 0") {
			t.Errorf("a directory owned by root: %v", err)
		}
	}

	os.Remove(file)
	other := filepath.Join(t.TempDir(), "other")
	if err := os.WriteFile(other, hostile, 0o600); err != nil {
		t.Fatal(err)
	}
	if err := os.Symlink(other, file); err != nil {
		t.Fatal(err)
	}
	refused("a symbolic link", "symbolic link")

	// What shaper writes itself is 0600 and read back.
	os.Remove(file)
	rec := embeddedRecord{Addr: "127.0.0.1:1", PID: 1, Config: cfg.Path}
	if err := writeEmbedded(file, rec); err != nil {
		t.Fatal(err)
	}
	if fi, err := os.Lstat(file); err != nil || fi.Mode() != 0o600 {
		t.Errorf("written: %v, %v; want a plain file of mode 0600", fi.Mode(), err)
	}
	if got, err := readEmbedded(file); err != nil || got.Addr != rec.Addr || got.PID != 1 {
		t.Errorf("read back %+v, %v", got, err)
	}
	if left, _ := filepath.Glob(filepath.Join(filepath.Dir(file), ".embedded-*")); len(left) != 0 {
		t.Errorf("temporary files left: %v", left)
	}

	// A directory others can write is refused too.
	os.RemoveAll(filepath.Dir(file))
	if err := os.Mkdir(filepath.Dir(file), 0o777); err != nil {
		t.Fatal(err)
	}
	if err := os.Chmod(filepath.Dir(file), 0o777); err != nil {
		t.Fatal(err)
	}
	if _, err := embeddedAddrFile(cfg.Path); err == nil || !strings.Contains(err.Error(), "writable by group or others") || !strings.Contains(err.Error(), filepath.Dir(file)) {
		t.Errorf("a directory of mode 0777: err = %v", err)
	}
}

// TestJoinedClientEndsWhenTheEmbeddedRedisIsGone: in process, connect
// joins the embedded Redis a record names; once that Redis stops and the
// process that ran it is gone, the context connect returned ends, and
// embeddedGone names the worker's PID and address; stop returns.
func TestJoinedClientEndsWhenTheEmbeddedRedisIsGone(t *testing.T) {
	t.Setenv("XDG_RUNTIME_DIR", t.TempDir())
	cfg, err := config.Load(writeConfig(t, "", "emb", "http://127.0.0.1:1", 10))
	if err != nil {
		t.Fatal(err)
	}
	gone := exec.Command("true") // a PID that ran and is gone
	if err := gone.Run(); err != nil {
		t.Fatal(err)
	}
	m, err := embedded.Start("127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer m.Close()
	file, err := embeddedAddrFile(cfg.Path)
	if err != nil {
		t.Fatal(err)
	}
	addr := m.Addr()
	if err := writeEmbedded(file, embeddedRecord{Addr: addr, PID: gone.Process.Pid, Config: cfg.Path}); err != nil {
		t.Fatal(err)
	}
	ctx, rdb, stop, err := connect(context.Background(), cfg, false, slog.New(slog.NewTextHandler(io.Discard, nil)))
	if err != nil {
		t.Fatal(err)
	}
	defer stop()
	if err := rdb.Ping(ctx).Err(); err != nil {
		t.Fatal(err)
	}
	m.Close()
	select {
	case <-ctx.Done():
	case <-time.After(20 * time.Second):
		t.Fatal("the context still runs 20 s after the embedded Redis stopped")
	}
	err = embeddedGone(ctx)
	if err == nil || !strings.Contains(err.Error(), "worker PID "+strconv.Itoa(gone.Process.Pid)+" at "+addr+" is gone") {
		t.Errorf("embeddedGone = %v", err)
	}
}

// startShaper starts the shaper binary with args and env added, and
// kills it when the test ends. exited is closed once it has exited (its
// status is then in cmd.ProcessState).
func startShaper(t *testing.T, env []string, args ...string) (cmd *exec.Cmd, out *logtest.Buffer, exited <-chan struct{}) {
	t.Helper()
	cmd = exec.Command(shaperBin(t), args...)
	cmd.Env = append(os.Environ(), env...)
	out = &logtest.Buffer{}
	cmd.Stdout, cmd.Stderr = out, out
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	done := make(chan struct{})
	go func() { _ = cmd.Wait(); close(done) }()
	t.Cleanup(func() {
		_ = cmd.Process.Kill()
		<-done
	})
	return cmd, out, done
}

// TestEmbeddedRedisSaysWhatItIs: a second worker joining the embedded
// Redis of a first says whose it is and that it is not durable; when the
// first worker dies (SIGKILL), the second worker, `shaper serve` and
// `shaper ui`, which used its Redis, stop with an error naming that
// worker's PID and address and saying the queued calls are lost, instead
// of dialling a dead port; no line says nothing is lost; an enqueue
// afterwards says the same; and after a clean stop of a worker running
// the embedded Redis, an enqueue says when it stopped.
func TestEmbeddedRedisSaysWhatItIs(t *testing.T) {
	t.Parallel()
	env := []string{"XDG_RUNTIME_DIR=" + t.TempDir()}
	srv := httptest.NewServer(&vendorsim.Mock{Rate: 50, Window: time.Second})
	defer srv.Close()
	cfg := writeConfig(t, "", "emb", srv.URL, 50)

	first, fout, firstExited := startShaper(t, env, "worker", "--config", cfg)
	waitUntil(t, 20*time.Second, "the first worker to start the embedded Redis", func() bool { return strings.Contains(fout.String(), "NOT durable") })
	second, wout, workerExited := startShaper(t, env, "worker", "--config", cfg)
	pid := "embedded_pid=" + strconv.Itoa(first.Process.Pid)
	waitUntil(t, 20*time.Second, "the second worker to join", func() bool { return strings.Contains(wout.String(), "joining the embedded Redis of another worker") })
	if !strings.Contains(wout.String(), pid) || !strings.Contains(wout.String(), "stops with that worker") {
		t.Errorf("the joining worker does not say whose Redis it joined (%s) and that it stops with it:\n%s", pid, wout)
	}
	serve, sout, serveExited := startShaper(t, env, "serve", "--config", cfg, "--addr", "127.0.0.1:0")
	pageURL(t, sout)
	page, pout, pageExited := startShaper(t, env, "ui", "--config", cfg, "--addr", "127.0.0.1:0")
	pageURL(t, pout)
	if out, err := runShaperEnv(t, env, "enqueue", "--config", cfg, "--vendor", "emb", "--path", "/x"); err != nil {
		t.Fatalf("enqueue on the embedded Redis: %v\n%s", err, out)
	}

	if err := first.Process.Signal(syscall.SIGKILL); err != nil {
		t.Fatal(err)
	}
	<-firstExited
	gone := "the embedded Redis of worker PID " + strconv.Itoa(first.Process.Pid) + " at 127.0.0.1:"
	for _, p := range []struct {
		name   string
		cmd    *exec.Cmd
		out    *logtest.Buffer
		exited <-chan struct{}
	}{{"the second worker", second, wout, workerExited}, {"serve", serve, sout, serveExited}, {"ui", page, pout, pageExited}} {
		select {
		case <-p.exited:
			if p.cmd.ProcessState.Success() {
				t.Errorf("%s exited 0 after the embedded Redis went away", p.name)
			}
		case <-time.After(30 * time.Second):
			t.Fatalf("%s still runs 30 s after the worker running its embedded Redis died:\n%s", p.name, p.out)
		}
		for _, want := range []string{gone, "is gone: it stopped with that worker; its queued calls are lost", "use a real Redis (redis.addr)"} {
			if !strings.Contains(p.out.String(), want) {
				t.Errorf("%s does not say %q:\n%s", p.name, want, p.out)
			}
		}
		if strings.Contains(p.out.String(), "nothing is lost") {
			t.Errorf("%s says nothing is lost:\n%s", p.name, p.out)
		}
	}
	out, err := runShaperEnv(t, env, "enqueue", "--config", cfg, "--vendor", "emb", "--path", "/x")
	if err == nil || !strings.Contains(out, gone) || !strings.Contains(out, "its queued calls are lost") {
		t.Errorf("enqueue after the embedded Redis died: %v\n%s", err, out)
	}

	// A clean stop: the file says when.
	again, aout, againExited := startShaper(t, env, "worker", "--config", cfg)
	waitUntil(t, 20*time.Second, "a new worker to start a new embedded Redis", func() bool { return strings.Contains(aout.String(), "NOT durable") })
	if !strings.Contains(aout.String(), "is gone; starting a new, empty one") {
		t.Errorf("the new worker does not say the old embedded Redis is gone:\n%s", aout)
	}
	if err := again.Process.Signal(syscall.SIGTERM); err != nil {
		t.Fatal(err)
	}
	<-againExited
	if !again.ProcessState.Success() {
		t.Fatalf("worker after SIGTERM: %v\n%s", again.ProcessState, aout)
	}
	out, err = runShaperEnv(t, env, "enqueue", "--config", cfg, "--vendor", "emb", "--path", "/x")
	if err == nil || !strings.Contains(out, "the embedded Redis of worker PID "+strconv.Itoa(again.Process.Pid)) || !strings.Contains(out, "it stopped with that worker at ") {
		t.Errorf("enqueue after a clean stop: %v\n%s", err, out)
	}
}

// TestEmbeddedWorkerSaysQueuedCallsAreLost: a worker running the
// embedded Redis, stopped with SIGTERM while calls are still queued (a
// vendor at 1 call per second, 10 calls), says how many calls are lost
// with its Redis rather than only that they go back to the queue.
func TestEmbeddedWorkerSaysQueuedCallsAreLost(t *testing.T) {
	t.Parallel()
	env := []string{"XDG_RUNTIME_DIR=" + t.TempDir()}
	srv := httptest.NewServer(&vendorsim.Mock{Rate: 1, Window: time.Second})
	defer srv.Close()
	cfg := writeConfig(t, "", "slow", srv.URL, 1)
	w, out, exited := startShaper(t, env, "worker", "--config", cfg)
	waitUntil(t, 20*time.Second, "the worker to start the embedded Redis", func() bool { return strings.Contains(out.String(), "NOT durable") })
	cmd := exec.Command(shaperBin(t), "enqueue", "--config", cfg, "--vendor", "slow", "--file", "-")
	cmd.Env = append(os.Environ(), env...)
	cmd.Stdin = strings.NewReader(jobLines("slow", 10))
	if o, err := cmd.CombinedOutput(); err != nil {
		t.Fatalf("enqueue: %v\n%s", err, o)
	}
	if err := w.Process.Signal(syscall.SIGTERM); err != nil {
		t.Fatal(err)
	}
	<-exited
	m := regexp.MustCompile(`the calls still queued in it are lost .* calls=(\d+)`).FindStringSubmatch(out.String())
	if m == nil || m[1] == "0" {
		t.Errorf("the worker does not say that the calls queued in its embedded Redis are lost:\n%s", out)
	}
}

// runShaperEnv is runShaper with env added.
func runShaperEnv(t *testing.T, env []string, args ...string) (string, error) {
	t.Helper()
	cmd := exec.Command(shaperBin(t), args...)
	cmd.Env = append(os.Environ(), env...)
	out, err := cmd.CombinedOutput()
	return string(out), err
}
