package main

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"log/slog"
	"os"
	"path/filepath"
	"syscall"
	"time"

	"github.com/redis/go-redis/v9"
	"github.com/shaper-dev/shaper/internal/embedded"

	"github.com/shaper-dev/shaper/config"
	"github.com/shaper-dev/shaper/queue"
)

// embeddedRecord is what a worker running the embedded Redis for a
// config file writes to its address file: where the Redis is, which
// worker runs it (the Redis stops with that process), and, once that
// worker stopped, when.
type embeddedRecord struct {
	Addr    string    `json:"addr"`
	PID     int       `json:"pid"`
	Config  string    `json:"config"`
	Started time.Time `json:"started"`
	Stopped time.Time `json:"stopped,omitzero"`
}

// embeddedDir is the directory of the embedded Redis's address files:
// $XDG_RUNTIME_DIR/shaper, else shaper in the user's cache directory,
// made 0700 so that no other local user can write a file there (a file
// naming their Redis would take this user's calls and credentials).
func embeddedDir() (string, error) {
	base := os.Getenv("XDG_RUNTIME_DIR")
	if !filepath.IsAbs(base) {
		var err error
		if base, err = os.UserCacheDir(); err != nil {
			return "", fmt.Errorf("find a private directory for the embedded Redis's address file (set XDG_RUNTIME_DIR or HOME, or set redis.addr): %w", err)
		}
	}
	dir := filepath.Join(base, "shaper")
	if err := os.MkdirAll(dir, 0o700); err != nil {
		return "", fmt.Errorf("make the directory of the embedded Redis's address file: %w", err)
	}
	fi, err := os.Lstat(dir)
	if err != nil {
		return "", err
	}
	if err := private(dir, fi, true); err != nil {
		return "", err
	}
	return dir, nil
}

// private reports why fi (of path, a directory when dir) could have been
// written by another local user: a symlink, another owner, or a mode
// that lets group or others write.
func private(path string, fi fs.FileInfo, dir bool) error {
	what, fix := "address file", "remove it (rm "+path+") and start the worker again; shaper writes it with mode 0600"
	if dir {
		what, fix = "address file directory", "remove it (rm -r "+path+") or chmod 700 it; shaper makes it with mode 0700"
	}
	switch {
	case dir && !fi.IsDir(), !dir && !fi.Mode().IsRegular():
		return fmt.Errorf("the embedded Redis %s %s is not a plain %s (%s): another local user could have put it there to point shaper at their Redis; %s",
			what, path, map[bool]string{true: "directory", false: "file"}[dir], fi.Mode().Type(), fix)
	}
	if st, ok := fi.Sys().(*syscall.Stat_t); ok && int(st.Uid) != os.Getuid() {
		return fmt.Errorf("the embedded Redis %s %s is owned by uid %d, not by you (uid %d): another local user could have written it to point shaper at their Redis; %s",
			what, path, st.Uid, os.Getuid(), fix)
	}
	if fi.Mode().Perm()&0o022 != 0 {
		return fmt.Errorf("the embedded Redis %s %s is writable by group or others (mode %04o): another local user could have written it to point shaper at their Redis; %s",
			what, path, fi.Mode().Perm(), fix)
	}
	return nil
}

// embeddedAddrFile is where a worker running the embedded Redis for a
// config file writes its record, so that enqueue, export, stats, serve,
// ui and other workers reach it. One file per config path: several
// configs (and several workers of one config) live side by side.
func embeddedAddrFile(cfgPath string) (string, error) {
	dir, err := embeddedDir()
	if err != nil {
		return "", err
	}
	abs, err := filepath.Abs(cfgPath)
	if err != nil {
		abs = cfgPath
	}
	sum := sha256.Sum256([]byte(abs))
	return filepath.Join(dir, "embedded-"+hex.EncodeToString(sum[:6])+".json"), nil
}

// readEmbedded reads the record at file, refusing one that another local
// user could have written (see private). A missing file is
// fs.ErrNotExist.
func readEmbedded(file string) (embeddedRecord, error) {
	var rec embeddedRecord
	f, err := os.OpenFile(file, os.O_RDONLY|syscall.O_NOFOLLOW|syscall.O_NONBLOCK, 0)
	if err != nil {
		if errors.Is(err, fs.ErrNotExist) {
			return rec, err
		}
		if errors.Is(err, syscall.ELOOP) {
			return rec, fmt.Errorf("the embedded Redis address file %s is a symbolic link: another local user could have put it there to point shaper at their Redis; remove it (rm %s) and start the worker again", file, file)
		}
		return rec, fmt.Errorf("read the embedded Redis address file: %w", err)
	}
	defer f.Close()
	fi, err := f.Stat()
	if err != nil {
		return rec, fmt.Errorf("read the embedded Redis address file: %w", err)
	}
	if err := private(file, fi, false); err != nil {
		return rec, err
	}
	b, err := io.ReadAll(io.LimitReader(f, 4096))
	if err != nil {
		return rec, fmt.Errorf("read the embedded Redis address file: %w", err)
	}
	if err := json.Unmarshal(b, &rec); err != nil || rec.Addr == "" {
		return rec, fmt.Errorf("the embedded Redis address file %s is not one shaper wrote (%v); remove it (rm %s) and start the worker again", file, err, file)
	}
	return rec, nil
}

// writeEmbedded writes rec to file atomically (a temporary file in the
// same directory, mode 0600, renamed over it): a reader sees the old
// record or the new one, never a part.
func writeEmbedded(file string, rec embeddedRecord) error {
	b, err := json.Marshal(rec)
	if err != nil {
		return err
	}
	tmp, err := os.CreateTemp(filepath.Dir(file), ".embedded-*.tmp")
	if err != nil {
		return fmt.Errorf("write the embedded Redis address file: %w", err)
	}
	defer os.Remove(tmp.Name()) // once renamed, there is nothing to remove
	if err := tmp.Chmod(0o600); err != nil {
		tmp.Close()
		return fmt.Errorf("write the embedded Redis address file: %w", err)
	}
	if _, err := tmp.Write(append(b, '\n')); err != nil {
		tmp.Close()
		return fmt.Errorf("write the embedded Redis address file: %w", err)
	}
	if err := tmp.Close(); err != nil {
		return fmt.Errorf("write the embedded Redis address file: %w", err)
	}
	if err := os.Rename(tmp.Name(), file); err != nil {
		return fmt.Errorf("write the embedded Redis address file: %w", err)
	}
	return nil
}

// embeddedGoneError says the embedded Redis a process used stopped with
// the worker that ran it, and took its queued calls with it.
type embeddedGoneError struct {
	rec embeddedRecord
}

func (e *embeddedGoneError) Error() string {
	when := ""
	if !e.rec.Stopped.IsZero() {
		when = " at " + e.rec.Stopped.Format(time.RFC3339)
	}
	return fmt.Sprintf("the embedded Redis of worker PID %d at %s is gone: it stopped with that worker%s; its queued calls are lost — use a real Redis (redis.addr) for anything that matters, or start `shaper worker --config %s` for a new embedded one",
		e.rec.PID, e.rec.Addr, when, e.rec.Config)
}

// embeddedGone returns why ctx (from connect) ended when it is that the
// embedded Redis went away, else nil.
func embeddedGone(ctx context.Context) error {
	var gone *embeddedGoneError
	if err := context.Cause(ctx); errors.As(err, &gone) {
		return gone
	}
	return nil
}

// connect returns a client of the config's Redis. With redis.addr empty it
// joins the embedded Redis of a running worker; startEmbedded (the worker)
// starts one when none runs. The returned context ends with ctx, or, for
// a process that joined another worker's embedded Redis, when that Redis
// is gone (embeddedGone says so). The returned stop closes what connect
// made.
func connect(ctx context.Context, cfg *config.Config, startEmbedded bool, log *slog.Logger) (context.Context, redis.UniversalClient, func(), error) {
	addr := cfg.Redis.Addr
	stop := func() {}
	var joined *embeddedRecord
	owned := false
	if cfg.Redis.Embedded() {
		file, err := embeddedAddrFile(cfg.Path)
		if err != nil {
			return nil, nil, nil, err
		}
		rec, err := readEmbedded(file)
		switch {
		case err != nil && !errors.Is(err, fs.ErrNotExist):
			return nil, nil, nil, err
		case err == nil && rec.Stopped.IsZero() && ping(ctx, rec.Addr) == nil:
			addr, joined = rec.Addr, &rec
			if startEmbedded {
				log.Warn("redis.addr is empty: joining the embedded Redis of another worker. It is NOT durable: it stops with that worker, and the calls queued in it are lost then; set redis.addr to a real Redis for anything that matters",
					"addr", rec.Addr, "embedded_pid", rec.PID, "addr_file", file)
			}
		case startEmbedded:
			if err == nil {
				log.Warn("the embedded Redis this config used is gone; starting a new, empty one", "err", (&embeddedGoneError{rec}).Error())
			}
			m, err := embedded.Start("127.0.0.1:0")
			if err != nil {
				return nil, nil, nil, fmt.Errorf("start the embedded Redis: %w", err)
			}
			abs, _ := filepath.Abs(cfg.Path)
			own := embeddedRecord{Addr: m.Addr(), PID: os.Getpid(), Config: abs, Started: time.Now().UTC().Truncate(time.Second)}
			if err := writeEmbedded(file, own); err != nil {
				m.Close()
				return nil, nil, nil, err
			}
			addr, owned = own.Addr, true
			log.Warn("redis.addr is empty: running an embedded in-process Redis. It is NOT durable (queued calls are lost when this worker stops, also for the workers, serve and ui that join it) and only serves this machine; set redis.addr for production",
				"addr", addr, "addr_file", file)
			stop = func() {
				if cur, err := readEmbedded(file); err == nil && cur.Addr == own.Addr && cur.PID == own.PID {
					own.Stopped = time.Now().UTC().Truncate(time.Second)
					_ = writeEmbedded(file, own)
				}
				m.Close()
			}
		case err == nil:
			return nil, nil, nil, &embeddedGoneError{rec}
		default:
			return nil, nil, nil, errors.New("redis.addr is empty (the embedded Redis) and no worker runs the embedded Redis for " + cfg.Path +
				": start `shaper worker --config " + cfg.Path + "` first, or set redis.addr (or SHAPER_REDIS_ADDR) to a real Redis")
		}
	}
	opts, err := cfg.Redis.Options(addr)
	if err != nil {
		stop()
		return nil, nil, nil, err
	}
	rdb := redis.NewUniversalClient(opts)
	pctx, cancel := context.WithTimeout(ctx, 5*time.Second)
	defer cancel()
	if err := rdb.Ping(pctx).Err(); err != nil {
		rdb.Close()
		stop()
		return nil, nil, nil, fmt.Errorf("cannot reach Redis at %s: %v (is it running? check redis.addr or SHAPER_REDIS_ADDR)", addr, err)
	}
	if joined == nil {
		return ctx, rdb, func() {
			if owned {
				lostWithEmbedded(cfg, rdb, log)
			}
			rdb.Close()
			stop()
		}, nil
	}
	wctx, cancelGone := context.WithCancelCause(ctx)
	watchCtx, stopWatch := context.WithCancel(wctx)
	done := make(chan struct{})
	go func() {
		defer close(done)
		if err := watchEmbedded(watchCtx, rdb, *joined, cfg.Path, embeddedCheckEvery); err != nil {
			log.Error(err.Error())
			cancelGone(err)
		}
	}()
	return wctx, rdb, func() {
		stopWatch()
		<-done
		cancelGone(nil)
		rdb.Close()
	}, nil
}

// lostWithEmbedded says, as the worker running the embedded Redis stops
// (its calls in flight finished or back in their queues), how many calls
// are still queued in it: they go with it.
func lostWithEmbedded(cfg *config.Config, rdb redis.UniversalClient, log *slog.Logger) {
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
	defer cancel()
	c := queue.NewClient(rdb, cfg.ClientConfig())
	defer c.Close()
	var n int64
	for _, v := range cfg.VendorNames() {
		if w, err := c.Waiting(ctx, v); err == nil {
			n += w
		}
	}
	if n > 0 {
		log.Warn("the embedded Redis stops with this worker: the calls still queued in it are lost (it is not durable; use a real Redis, redis.addr, for anything that matters)", "calls", n)
	}
}

// embeddedCheckEvery is how often a process on another worker's embedded
// Redis checks that it still runs.
const embeddedCheckEvery = time.Second

// watchEmbedded returns an *embeddedGoneError once the embedded Redis
// described by rec is gone, or nil when ctx ends. Gone: it does not
// answer, and its address file says it stopped (or names another one),
// or the worker that ran it no longer runs. A worker that is only slow
// (or stopped with SIGSTOP) is waited for.
func watchEmbedded(ctx context.Context, rdb redis.UniversalClient, rec embeddedRecord, cfgPath string, every time.Duration) error {
	t := time.NewTicker(every)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return nil
		case <-t.C:
		}
		pctx, cancel := context.WithTimeout(ctx, time.Second)
		err := rdb.Ping(pctx).Err() // through the process's client: a pooled connection
		cancel()
		if err == nil || ctx.Err() != nil {
			continue
		}
		file, err := embeddedAddrFile(cfgPath)
		if err != nil {
			continue
		}
		cur, err := readEmbedded(file)
		switch {
		case err == nil && (cur.Addr != rec.Addr || cur.PID != rec.PID):
			return &embeddedGoneError{rec}
		case err == nil && !cur.Stopped.IsZero():
			return &embeddedGoneError{cur}
		case errors.Is(err, fs.ErrNotExist) || !running(rec.PID):
			return &embeddedGoneError{rec}
		}
	}
}

// running reports whether process pid runs (or exists as another user's).
func running(pid int) bool {
	err := syscall.Kill(pid, 0)
	return err == nil || errors.Is(err, syscall.EPERM)
}

func ping(ctx context.Context, addr string) error {
	c := redis.NewClient(&redis.Options{Addr: addr, DialTimeout: time.Second, MaxRetries: -1})
	defer c.Close()
	ctx, cancel := context.WithTimeout(ctx, time.Second)
	defer cancel()
	return c.Ping(ctx).Err()
}
