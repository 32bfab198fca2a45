package main

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"path/filepath"
	"strings"
	"time"

	"github.com/redis/go-redis/v9"
	"github.com/shaper-dev/shaper/internal/embedded"

	"github.com/shaper-dev/shaper/config"
)

// embeddedAddrFile is where a worker running the embedded Redis for a
// config file writes its address, so that enqueue, export and stats from
// another terminal reach it. One file per config path: several configs
// (and several workers of one config) live side by side.
func embeddedAddrFile(cfgPath string) string {
	abs, err := filepath.Abs(cfgPath)
	if err != nil {
		abs = cfgPath
	}
	sum := sha256.Sum256([]byte(abs))
	return filepath.Join(os.TempDir(), "shaper-embedded-"+hex.EncodeToString(sum[:6])+".addr")
}

// connect returns a client of the config's Redis. With redis.addr empty it
// joins the embedded Redis of a running worker; startEmbedded (the worker)
// starts one when none runs. The returned stop closes what connect made.
func connect(ctx context.Context, cfg *config.Config, startEmbedded bool, log *slog.Logger) (redis.UniversalClient, func(), error) {
	addr := cfg.Redis.Addr
	stop := func() {}
	if cfg.Redis.Embedded() {
		file := embeddedAddrFile(cfg.Path)
		if b, err := os.ReadFile(file); err == nil && ping(ctx, strings.TrimSpace(string(b))) == nil {
			addr = strings.TrimSpace(string(b))
		} else if startEmbedded {
			m, err := embedded.Start("127.0.0.1:0")
			if err != nil {
				return nil, nil, fmt.Errorf("start the embedded Redis: %w", err)
			}
			addr = m.Addr()
			if err := os.WriteFile(file, []byte(addr+"\n"), 0o600); err != nil {
				m.Close()
				return nil, nil, fmt.Errorf("write the embedded Redis address to %s: %w", file, err)
			}
			log.Warn("redis.addr is empty: running an embedded in-process Redis. It is NOT durable (queued calls are lost when this worker stops) and only serves this machine; set redis.addr for production",
				"addr", addr, "addr_file", file)
			stop = func() {
				if b, err := os.ReadFile(file); err == nil && strings.TrimSpace(string(b)) == addr {
					os.Remove(file)
				}
				m.Close()
			}
		} else {
			return nil, nil, errors.New("redis.addr is empty (the embedded Redis) and no worker runs the embedded Redis for " + cfg.Path +
				": start `shaper worker --config " + cfg.Path + "` first, or set redis.addr (or SHAPER_REDIS_ADDR) to a real Redis")
		}
	}
	opts, err := cfg.Redis.Options(addr)
	if err != nil {
		stop()
		return nil, nil, err
	}
	rdb := redis.NewUniversalClient(opts)
	pctx, cancel := context.WithTimeout(ctx, 5*time.Second)
	defer cancel()
	if err := rdb.Ping(pctx).Err(); err != nil {
		rdb.Close()
		stop()
		return nil, nil, fmt.Errorf("cannot reach Redis at %s: %v (is it running? check redis.addr or SHAPER_REDIS_ADDR)", addr, err)
	}
	return rdb, func() { rdb.Close(); stop() }, nil
}

func ping(ctx context.Context, addr string) error {
	c := redis.NewClient(&redis.Options{Addr: addr, DialTimeout: time.Second, MaxRetries: -1})
	defer c.Close()
	ctx, cancel := context.WithTimeout(ctx, time.Second)
	defer cancel()
	return c.Ping(ctx).Err()
}
