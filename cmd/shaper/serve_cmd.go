package main

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"net/http"
	"os"
	"time"

	"github.com/redis/go-redis/v9"
	"github.com/spf13/cobra"

	"github.com/shaper-dev/shaper/config"
	"github.com/shaper-dev/shaper/internal/api"
	"github.com/shaper-dev/shaper/internal/httpguard"
	"github.com/shaper-dev/shaper/queue"
)

func newServeCmd() *cobra.Command {
	var addr, token string
	var maxBody int64
	cmd := &cobra.Command{
		Use:   "serve",
		Short: "Serve the HTTP API: POST calls to queue them, GET one to follow it",
		Long: `serve answers HTTP for services in any language, on the same Redis as the
workers:

  POST /v1/calls       one call (application/json) or one per line
                       (application/x-ndjson), each naming its "vendor":
                       checked as shaper enqueue --file checks a call file
                       (nothing is queued from a body with a bad call),
                       202 with the ids; an id already queued answers with
                       that call; 413 above --max-body; a full queue is 429
                       with Retry-After
  GET  /v1/calls/{id}  what the call waits for, or how it ended (the same
                       as shaper explain --json); ?wait=30s holds the
                       request until it ends (at most a minute)
  DELETE /v1/calls/{id}
                       cancels a call that has not started (409 once a
                       worker holds it)
  POST /v1/exports?vendor=NAME[&id=ID]
                       an export: its calls, one per line
                       (application/x-ndjson), as shaper export --file
                       takes them; posted again under its id, it queues
                       nothing twice
  GET  /v1/exports/{id}
                       its progress (shaper export status --json)
  GET  /v1/exports/{id}/results[?follow=true][&state=failed]
                       its answers as NDJSON in its order, streamed
                       (shaper export results)
  POST /v1/exports/{id}/retry, POST /v1/exports/{id}/cancel
                       runs its failed calls again; cancels what has not
                       started
  GET  /v1/openapi.json
                       the OpenAPI 3.1 document of all of it

A call may name "callback": {"url": ...} under the config's [callbacks]
allow: its outcome is POSTed there, signed, when it ends. With
OTEL_EXPORTER_OTLP_ENDPOINT or [tracing] set, a POST's traceparent is
followed and the call's spans join its trace.

It binds to 127.0.0.1 by default. On any other address it needs a token
(--api-token or SHAPER_API_TOKEN), which every request sends as
"Authorization: Bearer TOKEN". It answers only requests whose Host names
its address (any loopback name on a loopback address: 421 otherwise)
and, without a token, refuses what another site's page sends (403); a
body must say its Content-Type (415). See docs/api.md, "Who it answers".`,
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			if token == "" {
				token = os.Getenv("SHAPER_API_TOKEN")
			}
			if err := api.CheckAddr("--addr", addr, token); err != nil {
				return err
			}
			if maxBody < 1 {
				return fmt.Errorf("--max-body %d: a size in bytes, at least 1", maxBody)
			}
			return withClient(cmd, func(ctx context.Context, cfg *config.Config, _ redis.UniversalClient, c *queue.Client) error {
				log := slog.New(slog.NewTextHandler(cmd.ErrOrStderr(), nil))
				stopTracing, err := startTracing(ctx, cfg.Tracing, log)
				if err != nil {
					return err
				}
				defer stopTracing()
				stop, err := startAPI(addr, api.Options{Client: c, Token: token, MaxBody: maxBody}, log)
				if err != nil {
					return err
				}
				defer stop()
				<-ctx.Done()
				return nil
			})
		},
	}
	cmd.Flags().StringVar(&addr, "addr", "127.0.0.1:8081", "serve the API on this address (:0 picks a free port)")
	cmd.Flags().StringVar(&token, "api-token", "", "the token every request must send, required on a non-loopback address (default $SHAPER_API_TOKEN)")
	cmd.Flags().Int64Var(&maxBody, "max-body", api.DefaultMaxBody, "the largest POST body, in bytes (413 above)")
	return cmd
}

// startAPI serves the API on addr until stop, which shuts the server
// down (requests in progress, a waiting GET among them, get 5 s).
func startAPI(addr string, o api.Options, log *slog.Logger) (stop func(), err error) {
	ln, err := net.Listen("tcp", addr)
	if err != nil {
		return nil, fmt.Errorf("serve the API on %s: %w", addr, err)
	}
	o.Addr = httpguard.Bound(addr, ln)
	srv := api.NewServer(o, log)
	done := make(chan struct{})
	go func() {
		defer close(done)
		if err := srv.Serve(ln); err != nil && !errors.Is(err, http.ErrServerClosed) {
			log.Error("the API stopped serving", "err", err)
		}
	}()
	log.Info("serving the API", "url", "http://"+ln.Addr().String()+"/v1/calls", "token", o.Token != "")
	return func() {
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		defer cancel()
		_ = srv.Shutdown(ctx)
		<-done
	}, nil
}
