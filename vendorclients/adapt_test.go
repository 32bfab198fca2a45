package vendorclients

import (
	"context"
	"errors"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/shaper-dev/shaper/internal/logtest"
	"github.com/shaper-dev/shaper/internal/redistest"
	"github.com/shaper-dev/shaper/shaper"
)

// TestOwnRedisPauseFailureIsLoggedAsSuch: the vendor answers 429 while Redis is
// gone, so the pause cannot be set. The log must say the pause failed,
// and the error must not claim a pause in force. (Before, it logged
// "vendor paused for every replica" whatever Pause returned.)
func TestOwnRedisPauseFailureIsLoggedAsSuch(t *testing.T) {
	srv := redistest.Start(t)
	rdb := redis.NewClient(&redis.Options{Addr: srv.Addr, MaxRetries: -1, DialTimeout: 200 * time.Millisecond})
	defer rdb.Close()
	vendor := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		srv.Kill() // Redis dies while the vendor answers
		w.Header().Set("Retry-After", "30")
		w.WriteHeader(http.StatusTooManyRequests)
	}))
	defer vendor.Close()
	gate := shaper.NewGate(rdb, shaper.Config{KeyPrefix: redistest.Prefix(t)})
	bucket, err := gate.Bucket("acme", shaper.Policy{Limits: []shaper.Limit{{Rate: 1000, Window: time.Second}}, Horizon: time.Millisecond})
	if err != nil {
		t.Fatal(err)
	}
	logs := &logtest.Buffer{}
	c, err := New(Endpoint{Name: "acme", BaseURL: vendor.URL}, bucket, Options{Logger: slog.New(slog.NewTextHandler(logs, nil))})
	if err != nil {
		t.Fatal(err)
	}
	req, _ := c.NewRequest(context.Background(), http.MethodGet, "/x", nil)
	_, err = c.Do(req)
	var rl *RateLimitedError
	if !errors.As(err, &rl) {
		t.Fatalf("err = %v, want a *RateLimitedError", err)
	}
	if rl.RetryAfter != 0 {
		t.Errorf("RetryAfter = %s: no pause could be set", rl.RetryAfter)
	}
	out := logs.String()
	if !strings.Contains(out, "could not pause the vendor") {
		t.Errorf("the failed pause is not logged:\n%s", out)
	}
	if strings.Contains(out, "vendor paused for every replica") {
		t.Errorf("the log claims a pause that failed:\n%s", out)
	}
}

// TestNewerShaperStateIsLogged: while a newer shaper owns a vendor's gate
// state (its layout tag above this version's), calls are sent back to
// wait, none reaches the vendor, and the worker says why, with what to
// do, once a minute rather than once a call.
func TestNewerShaperStateIsLogged(t *testing.T) {
	rdb := redistest.Client(t)
	ctx := context.Background()
	var sent atomic.Int64
	vendor := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) { sent.Add(1) }))
	defer vendor.Close()
	prefix := redistest.Prefix(t)
	gate := shaper.NewGate(rdb, shaper.Config{KeyPrefix: prefix})
	bucket, err := gate.Bucket("acme", shaper.Policy{Limits: []shaper.Limit{{Rate: 100, Window: time.Second}}, Horizon: 50 * time.Millisecond})
	if err != nil {
		t.Fatal(err)
	}
	logs := &logtest.Buffer{}
	c, err := New(Endpoint{Name: "acme", BaseURL: vendor.URL}, bucket, Options{MaxWait: 10 * time.Millisecond, Logger: slog.New(slog.NewTextHandler(logs, nil))})
	if err != nil {
		t.Fatal(err)
	}
	do := func() error {
		req, _ := c.NewRequest(ctx, http.MethodGet, "/x", nil)
		resp, err := c.Do(req)
		if err == nil {
			resp.Body.Close()
		}
		return err
	}
	// A bucket's first call waits a horizon (a state never seen may be
	// a lost one), beyond MaxWait: ask again until it goes.
	for err := do(); err != nil; err = do() {
		var we *WaitError
		if !errors.As(err, &we) {
			t.Fatal(err)
		}
		time.Sleep(we.Wait)
	}
	key := prefix + ":{acme}:gate"
	run, err := rdb.HGet(ctx, key, "run").Result()
	if err != nil || !strings.HasPrefix(run, "l") || !strings.Contains(run, ":") {
		t.Fatalf("%s's run is %q (%v); want l<layout>:<run_id>", key, run, err)
	}
	if err := rdb.HSet(ctx, key, "run", "l999:"+run[strings.Index(run, ":")+1:]).Err(); err != nil {
		t.Fatal(err)
	}
	for range 3 {
		var we *WaitError
		if err := do(); !errors.As(err, &we) {
			t.Fatalf("a call under a newer shaper's state: %v; want a *WaitError", err)
		}
	}
	if n := sent.Load(); n != 1 {
		t.Errorf("the vendor got %d calls, want 1 (the one before the newer state)", n)
	}
	if n := strings.Count(logs.String(), "a newer version of shaper wrote this vendor's gate state"); n != 1 {
		t.Errorf("said %d times in 3 calls, want once:\n%s", n, logs)
	}
}
