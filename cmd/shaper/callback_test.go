package main

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/hibiken/asynq"
	"github.com/redis/go-redis/v9"

	"github.com/shaper-dev/shaper/config"
	"github.com/shaper-dev/shaper/internal/redistest"
	"github.com/shaper-dev/shaper/queue"
)

// TestCallbacksFromTheCLI: a config's [callbacks] table reaches both
// ends. `shaper enqueue` refuses a callback outside allow (naming it) and
// queues one inside it, from --callback and from a call line; `shaper
// worker` reads the secret from the environment and delivers both,
// signed.
func TestCallbacksFromTheCLI(t *testing.T) {
	t.Parallel()
	vendor := "cbcli-" + redistest.Prefix(t)[5:]
	vsrv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		w.WriteHeader(http.StatusCreated)
		fmt.Fprint(w, `{"id":"ord_1"}`)
	}))
	t.Cleanup(vsrv.Close)
	const secret = "cli-s3cret"
	var mu sync.Mutex
	got := map[string]queue.Outcome{}
	var bad []string
	rsrv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		body, _ := io.ReadAll(r.Body)
		mu.Lock()
		defer mu.Unlock()
		var o queue.Outcome
		if err := queue.Verify(secret, r.Header.Get(queue.SignatureHeader), body, time.Minute, time.Now()); err != nil {
			bad = append(bad, err.Error())
		} else if err := json.Unmarshal(body, &o); err != nil {
			bad = append(bad, err.Error())
		}
		got[o.ID] = o
	}))
	t.Cleanup(rsrv.Close)

	cfg := writeConfig(t, redistest.Addr(t), vendor, vsrv.URL, 50)
	f, err := os.OpenFile(cfg, os.O_APPEND|os.O_WRONLY, 0)
	if err != nil {
		t.Fatal(err)
	}
	fmt.Fprintf(f, "\n[callbacks]\nallow = [%q]\nsecret = \"${CBCLI_SECRET}\"\n", rsrv.URL+"/hooks")
	f.Close()

	id := vendor + "-1"
	if out, err := runShaper(t, "", "enqueue", "--config", cfg, "--vendor", vendor, "--path", "/orders", "--id", id+"x",
		"--callback", rsrv.URL+"/other"); err == nil || !strings.Contains(out, "not under any prefix of [callbacks] allow") {
		t.Fatalf("a callback outside allow: %v\n%s", err, out)
	}
	if out, err := runShaper(t, "", "enqueue", "--config", cfg, "--vendor", vendor, "--path", "/orders", "--id", id, "--callback", rsrv.URL+"/hooks/a"); err != nil {
		t.Fatalf("enqueue --callback: %v\n%s", err, out)
	}
	line := fmt.Sprintf(`{"id":"%s-2","path":"/orders","callback":{"url":"%s/hooks/b"}}`+"\n", vendor, rsrv.URL)
	if out, err := runShaper(t, line, "enqueue", "--config", cfg, "--vendor", vendor, "--file", "-"); err != nil {
		t.Fatalf("enqueue --file with a callback: %v\n%s", err, out)
	}

	if out, err := runShaper(t, "", "worker", "--config", cfg); err == nil || !strings.Contains(out, "CBCLI_SECRET") {
		t.Fatalf("a worker without the secret's variable: %v, want an error naming it\n%s", err, out)
	}
	startWorkerEnv(t, []string{"CBCLI_SECRET=" + secret}, cfg)
	deadline := time.Now().Add(30 * time.Second)
	for {
		mu.Lock()
		n := len(got)
		mu.Unlock()
		if n >= 2 {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("%d of 2 callbacks after 30 s", n)
		}
		time.Sleep(50 * time.Millisecond)
	}
	mu.Lock()
	defer mu.Unlock()
	if len(bad) > 0 {
		t.Fatalf("bad deliveries: %v", bad)
	}
	for _, id := range []string{vendor + "-1", vendor + "-2"} {
		if o := got[id]; o.State != "completed" || o.Status != http.StatusCreated || o.Vendor != vendor || o.Body != `{"id":"ord_1"}` {
			t.Errorf("%s: outcome %+v", id, o)
		}
	}
}

// TestCallbacksReloadFromTheConfigFile: a running worker takes an edit of
// [callbacks] from its config file: a receiver removed from it receives
// nothing more (a delivery queued by an enqueuer still on the old config
// is archived, not sent), a receiver whose secret changed gets the next
// deliveries signed with the new one, and the log says which receivers
// changed, never a secret.
func TestCallbacksReloadFromTheConfigFile(t *testing.T) {
	addr := redistest.Addr(t)
	vendor := "cbreload-" + redistest.Prefix(t)[5:]
	vsrv := httptest.NewServer(http.HandlerFunc(func(http.ResponseWriter, *http.Request) {}))
	t.Cleanup(vsrv.Close)
	secrets := map[string]string{"CBR_A1": "a-first-s3cret", "CBR_A2": "a-second-s3cret", "CBR_B": "b-only-s3cret"}
	for k, v := range secrets {
		t.Setenv(k, v)
	}
	type rcv struct {
		srv    *httptest.Server
		mu     sync.Mutex
		secret string
		got    []string // ids
		bad    []string
	}
	newRcv := func(secret string) *rcv {
		r := &rcv{secret: secret}
		r.srv = httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, req *http.Request) {
			body, _ := io.ReadAll(req.Body)
			r.mu.Lock()
			defer r.mu.Unlock()
			var o queue.Outcome
			if err := queue.Verify(r.secret, req.Header.Get(queue.SignatureHeader), body, time.Minute, time.Now()); err != nil {
				r.bad = append(r.bad, err.Error())
				http.Error(w, err.Error(), http.StatusBadRequest)
				return
			}
			_ = json.Unmarshal(body, &o)
			r.got = append(r.got, o.ID)
		}))
		t.Cleanup(r.srv.Close)
		return r
	}
	count := func(r *rcv) int {
		r.mu.Lock()
		defer r.mu.Unlock()
		return len(r.got)
	}
	ra, rb := newRcv(secrets["CBR_A1"]), newRcv(secrets["CBR_B"])
	cfg := writeConfig(t, addr, vendor, vsrv.URL, 50)
	base, err := os.ReadFile(cfg)
	if err != nil {
		t.Fatal(err)
	}
	receiver := func(prefix, secret string) string {
		return fmt.Sprintf("\n[[callbacks.receivers]]\nprefix = %q\nsecret = %q\n", prefix, secret)
	}
	write := func(path, receivers string) {
		t.Helper()
		if err := os.WriteFile(path, []byte(string(base)+"\n[callbacks]\n"+receivers), 0o600); err != nil {
			t.Fatal(err)
		}
	}
	write(cfg, receiver(ra.srv.URL+"/hooks", "${CBR_A1}")+receiver(rb.srv.URL+"/hooks", "${CBR_B}"))
	// An enqueuer that keeps the first config (a `shaper serve` not yet
	// restarted).
	stale := filepath.Join(t.TempDir(), "stale.toml")
	write(stale, receiver(ra.srv.URL+"/hooks", "${CBR_A1}")+receiver(rb.srv.URL+"/hooks", "${CBR_B}"))
	staleCfg, err := config.Load(stale)
	if err != nil {
		t.Fatal(err)
	}
	rdb := redis.NewClient(&redis.Options{Addr: addr})
	t.Cleanup(func() { _ = rdb.Close() })
	c := queue.NewClient(rdb, staleCfg.ClientConfig())
	t.Cleanup(func() { _ = c.Close() })
	enqueue := func(id, url string) {
		t.Helper()
		if _, err := c.Enqueue(context.Background(), queue.Call{ID: id, Vendor: vendor, Path: "/x", Callback: &queue.Callback{URL: url}}); err != nil {
			t.Fatal(err)
		}
	}
	waitUntil := func(what string, cond func() bool) {
		t.Helper()
		deadline := time.Now().Add(30 * time.Second)
		for !cond() {
			if time.Now().After(deadline) {
				t.Fatalf("timed out waiting for %s", what)
			}
			time.Sleep(50 * time.Millisecond)
		}
	}

	logs := newLogLines()
	w := startInProcess(t, logs, "--config", cfg)
	logs.wait(t, "watching the config file", 30*time.Second)
	enqueue(vendor+"-a1", ra.srv.URL+"/hooks/x")
	waitUntil("the first callback", func() bool { return count(ra) == 1 })

	write(cfg, receiver(ra.srv.URL+"/hooks", "${CBR_A2}"))
	logs.wait(t, "receiver "+rb.srv.URL+"/hooks removed", 10*time.Second)
	logs.wait(t, "receiver "+ra.srv.URL+"/hooks: its secret changed", 10*time.Second)
	ra.mu.Lock()
	ra.secret = secrets["CBR_A2"]
	ra.mu.Unlock()
	enqueue(vendor+"-a2", ra.srv.URL+"/hooks/x")
	enqueue(vendor+"-b1", rb.srv.URL+"/hooks/x")
	waitUntil("the callback after the reload", func() bool { return count(ra) == 2 })
	insp := asynq.NewInspectorFromRedisClient(rdb)
	var info *asynq.TaskInfo
	waitUntil("the delivery to the removed receiver to end", func() bool {
		info, err = insp.GetTaskInfo(queue.CallbackQueueName("shaper"), vendor+":"+vendor+"-b1")
		return err == nil && (info.State == asynq.TaskStateArchived || info.State == asynq.TaskStateCompleted)
	})
	if info.State != asynq.TaskStateArchived || !strings.Contains(info.LastErr, "not sent") {
		t.Errorf("the delivery to the removed receiver: %s, %q; want archived, not sent", info.State, info.LastErr)
	}
	if n := count(rb); n != 0 {
		t.Errorf("the removed receiver got %d callbacks", n)
	}
	ra.mu.Lock()
	if len(ra.bad) > 0 {
		t.Errorf("a's deliveries did not verify with its secret of the moment: %v", ra.bad)
	}
	ra.mu.Unlock()
	if err := w.stop(t); err != nil {
		t.Errorf("worker: %v", err)
	}
	for _, s := range secrets {
		if strings.Contains(logs.String(), s) {
			t.Errorf("the log holds a secret:\n%s", logs.String())
		}
	}
}
