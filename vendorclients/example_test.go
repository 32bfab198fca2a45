package vendorclients_test

import (
	"context"
	"errors"
	"fmt"
	"io"
	"log"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"os"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/shaper-dev/shaper/shaper"
	"github.com/shaper-dev/shaper/vendorclients"
)

// A client of one vendor: every request waits for the vendor's tick, a
// 429 pauses the vendor for every replica and comes back as a
// *RateLimitedError, and a path cannot leave the vendor's base_url. The
// example needs a Redis at REDIS_ADDR (the tests set it).
func Example() {
	ctx := context.Background()
	vendor := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.URL.Path == "/v1/busy" {
			w.Header().Set("Retry-After", "2")
			w.WriteHeader(http.StatusTooManyRequests)
			return
		}
		fmt.Fprintln(w, "ok")
	}))
	defer vendor.Close()

	rdb := redis.NewClient(&redis.Options{Addr: os.Getenv("REDIS_ADDR")})
	defer rdb.Close()
	// A fresh key prefix per run keeps the example repeatable; production
	// uses the default.
	gate := shaper.NewGate(rdb, shaper.Config{KeyPrefix: fmt.Sprintf("example-%d", time.Now().UnixNano())})
	bucket, err := gate.Bucket("acme", shaper.Policy{Limits: []shaper.Limit{{Rate: 10, Window: time.Second}}})
	if err != nil {
		log.Fatal(err)
	}
	acme, err := vendorclients.New(vendorclients.Endpoint{Name: "acme", BaseURL: vendor.URL + "/v1"}, bucket,
		vendorclients.Options{Logger: slog.New(slog.NewTextHandler(io.Discard, nil))})
	if err != nil {
		log.Fatal(err)
	}

	req, _ := acme.NewRequest(ctx, http.MethodGet, "/orders/42", nil)
	resp, err := acme.Do(req) // waits for acme's tick
	if err != nil {
		log.Fatal(err)
	}
	resp.Body.Close()
	fmt.Println("orders/42:", resp.StatusCode)

	req, _ = acme.NewRequest(ctx, http.MethodGet, "/busy", nil)
	_, err = acme.Do(req)
	var rl *vendorclients.RateLimitedError
	if errors.As(err, &rl) {
		fmt.Println("busy: rate-limited, acme paused for", rl.RetryAfter.Round(time.Second))
	}

	_, err = acme.NewRequest(ctx, http.MethodGet, "/orders/../../admin", nil)
	fmt.Println("leaving base_url refused:", errors.Is(err, vendorclients.ErrBadPath))
	// Output:
	// orders/42: 200
	// busy: rate-limited, acme paused for 2s
	// leaving base_url refused: true
}
