package queue_test

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"log"
	"time"

	"github.com/hibiken/asynq"
	"github.com/redis/go-redis/v9"

	"github.com/shaper-dev/shaper/queue"
	"github.com/shaper-dev/shaper/shaper"
	"github.com/shaper-dev/shaper/vendorclients"
)

// This example enqueues a built-in vendor call and a task of the user's own
// type bound to the same vendor, and runs the worker that shapes both: every
// request the custom task makes through its vendor client waits for the
// vendor's tick, per call, not per job. (It needs a Redis, so it is compiled
// but not run by go test.)
func Example() {
	ctx := context.Background()
	rdb := redis.NewClient(&redis.Options{Addr: "127.0.0.1:6379"})
	defer rdb.Close()

	acme := queue.Vendor{
		Endpoint:   vendorclients.Endpoint{Name: "acme", BaseURL: "https://api.acme.example/v1"},
		Policy:     shaper.Policy{Limits: []shaper.Limit{{Rate: 100, Window: time.Second}}},
		QueueLimit: 100_000,
	}
	client := queue.NewClient(rdb, queue.ClientConfig{
		Vendors: []queue.Vendor{acme},
	})
	defer client.Close()

	// A vendor call. The id makes enqueueing idempotent and is sent as the
	// Idempotency-Key on every attempt.
	id, err := client.Enqueue(ctx, queue.Call{
		Vendor: "acme", ID: "order-1042", Method: "POST", Path: "/orders",
		Body: json.RawMessage(`{"sku":"X-1","qty":2}`),
	})
	if err != nil {
		log.Fatal(err) // ErrUnknownVendor, ErrQueueFull, ErrBadCall, ErrDuplicate
	}
	fmt.Println("queued", id)

	// A task of our own on acme's queue: one export page, several calls.
	if _, err := client.EnqueueTask(ctx, queue.Target{Vendor: "acme"}, asynq.NewTask("export:page", []byte(`{"page":3}`))); err != nil {
		log.Fatal(err)
	}

	worker, err := queue.NewWorker(rdb, queue.WorkerConfig{Vendors: []queue.Vendor{acme}})
	if err != nil {
		log.Fatal(err)
	}
	err = worker.Handle("export:page", func(ctx context.Context, t *asynq.Task, acme *vendorclients.Client) error {
		for _, order := range []string{"1", "2", "3"} {
			req, err := acme.NewRequest(ctx, "GET", "/orders/"+order, nil)
			if err != nil {
				return err
			}
			resp, err := acme.Do(req) // waits for acme's tick; a 429 pauses acme everywhere
			if err != nil {
				return err // waits and 429s go back to the queue without using a retry
			}
			_, _ = io.Copy(io.Discard, resp.Body)
			resp.Body.Close()
		}
		return nil
	})
	if err != nil {
		log.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(ctx, time.Minute)
	defer cancel()
	if err := worker.Run(ctx); err != nil { // until ctx ends (SIGTERM in shaper worker)
		log.Fatal(err)
	}
}
