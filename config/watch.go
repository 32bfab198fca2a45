package config

// Live config: reloading the file when it changes, or when the caller asks.

import (
	"context"
	"crypto/sha256"
	"fmt"
	"log/slog"
	"os"
	"path/filepath"
	"time"

	"github.com/fsnotify/fsnotify"
)

const (
	// debounce is how long the file must stay quiet after a change before
	// Watch reloads it: editors save in several steps, and one save can
	// fire several events.
	debounce = 250 * time.Millisecond
	// pollEvery is how often Watch also compares the file's content with
	// the last reload's, in case an event is lost.
	pollEvery = 2 * time.Second
)

// WatchOptions are Watch's optional inputs. The zero value watches the
// file alone.
type WatchOptions struct {
	// Reload asks for a reload even when the file is unchanged; cmd/shaper
	// sends one per SIGHUP. Nil: no requests.
	Reload <-chan struct{}
	// Observe, when set, is told what Watch did: WatchArmed once, then
	// WatchApplied or WatchRejected once per reload attempt. It runs on
	// Watch's goroutine and should return quickly.
	Observe func(WatchEvent)
}

// WatchEvent is what Watch reports to WatchOptions.Observe.
type WatchEvent int

const (
	// WatchArmed: the watch is in place, and a save from now on will be
	// seen. Reported once, before any other event.
	WatchArmed WatchEvent = iota + 1
	// WatchApplied: a reload was valid and apply has returned.
	WatchApplied
	// WatchRejected: a reload was invalid or the file could not be read;
	// it was logged, nothing was applied, the last good config stays.
	WatchRejected
)

func (e WatchEvent) String() string {
	switch e {
	case WatchArmed:
		return "armed"
	case WatchApplied:
		return "applied"
	case WatchRejected:
		return "rejected"
	}
	return fmt.Sprintf("WatchEvent(%d)", int(e))
}

// Watch reloads the config file at path when it changes, and on each
// request from opts.Reload, until ctx ends; then it returns nil. It
// returns an error only when path has no absolute form.
//
// Each reload reads the file, parses and validates it into a fresh viper
// (as Parse does), and only then calls apply with the new config; an
// invalid edit is logged with its file, line and key, and the last good
// config stays in force. A change is reloaded once the file has been quiet
// for 250 ms (one save is often several writes) and only when its content
// differs from the last reload's; a request always reloads. Watch watches
// the file's directory, so saves by rename-over and by delete-and-recreate
// are seen, and compares the file's content every 2 s in case an event is
// lost (or the system gives no file events: that is logged).
//
// Watch installs no signal handler: its caller decides what asks for a
// reload (cmd/shaper sends a request per SIGHUP). apply and opts.Observe
// run on the goroutine that called Watch, one at a time.
func Watch(ctx context.Context, path string, log *slog.Logger, apply func(*Config), opts WatchOptions) error {
	abs, err := filepath.Abs(path)
	if err != nil {
		return fmt.Errorf("config: watch %s: %w", path, err)
	}
	// File events, when the system gives them (inotify has per-user
	// limits); without them the poll and the requests still work.
	var events <-chan fsnotify.Event
	var eventErrs <-chan error
	fw, err := fsnotify.NewWatcher()
	if err == nil {
		defer fw.Close()
		if err = fw.Add(filepath.Dir(abs)); err == nil {
			events, eventErrs = fw.Events, fw.Errors
		}
	}
	if err != nil {
		log.Warn("no file events for the config file; checking it every 2s instead", "path", path, "err", err)
	}
	observe := func(e WatchEvent) {
		if opts.Observe != nil {
			opts.Observe(e)
		}
	}

	last := fileSum(abs)
	// reload reads the file once, so that the content it checks is the
	// content it remembers.
	reload := func(why string, always bool) {
		data, readErr := os.ReadFile(abs)
		var sum [32]byte
		if readErr == nil {
			sum = sha256.Sum256(data)
		}
		if sum == last && !always {
			return
		}
		last = sum // an invalid file is reported once, not at every poll
		var cfg *Config
		var err error
		if readErr != nil {
			err = fmt.Errorf("config: %w", readErr)
		} else {
			cfg, err = Parse(path, data)
		}
		if err != nil {
			log.Error("config reload rejected; the last good config stays in force", "why", why, "err", err)
			observe(WatchRejected)
			return
		}
		log.Info("config reloaded", "why", why, "path", path)
		apply(cfg)
		observe(WatchApplied)
	}
	observe(WatchArmed)

	var settled <-chan time.Time // fires once the file has been quiet for debounce
	poll := time.NewTicker(pollEvery)
	defer poll.Stop()
	for ctx.Err() == nil {
		select {
		case <-ctx.Done():
		case ev, ok := <-events:
			if !ok {
				return nil
			}
			if filepath.Clean(ev.Name) == abs {
				settled = time.After(debounce)
			}
		case err, ok := <-eventErrs:
			if ok {
				log.Warn("config watch error; polling continues", "err", err)
			}
		case <-settled:
			settled = nil
			reload("file changed", false)
		case <-opts.Reload:
			reload("reload requested", true)
		case <-poll.C:
			// A change no event reported: reload it like one, once the
			// file is quiet.
			if settled == nil && fileSum(abs) != last {
				settled = time.After(debounce)
			}
		}
	}
	return nil
}

// fileSum is the hash of the file's content (zero when it cannot be read:
// a file being replaced).
func fileSum(path string) [32]byte {
	b, err := os.ReadFile(path)
	if err != nil {
		return [32]byte{}
	}
	return sha256.Sum256(b)
}
