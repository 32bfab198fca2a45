package vendorclients

import (
	"context"
	"errors"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"strings"
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
