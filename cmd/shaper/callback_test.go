package main

import (
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"os"
	"strings"
	"sync"
	"testing"
	"time"

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
