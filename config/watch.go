package config

import (
	"context"
	"crypto/sha256"
	"log/slog"
	"os"
	"os/signal"
	"path/filepath"
	"syscall"
	"time"

	"github.com/fsnotify/fsnotify"
)

// Debounce is how long Watch waits after a change event before it reloads:
// editors save in several steps, and one save can fire several events.
const Debounce = 250 * time.Millisecond

// Watch reloads the config file at path whenever it changes, and on
// SIGHUP, until ctx ends. Each reload reads the file into a fresh viper,
// validates it, and only then calls apply with the new config; an invalid
// edit is logged with its file, line and key, and the last good config
// stays in force. It watches the file's directory, so saves by
// rename-over and delete-and-recreate are seen, and it also polls the
// file every 2 s in case an event is lost.
func Watch(ctx context.Context, path string, log *slog.Logger, apply func(*Config)) error {
	abs, err := filepath.Abs(path)
	if err != nil {
		return err
	}
	fw, err := fsnotify.NewWatcher()
	if err != nil {
		return err
	}
	defer fw.Close()
	if err := fw.Add(filepath.Dir(abs)); err != nil {
		return err
	}
	hup := make(chan os.Signal, 1)
	signal.Notify(hup, syscall.SIGHUP)
	defer signal.Stop(hup)

	last := fileSum(abs)
	reload := func(why string) {
		sum := fileSum(abs)
		if sum == last {
			return
		}
		cfg, err := Load(path)
		if err != nil {
			log.Error("config reload rejected; the last good config stays in force", "why", why, "err", err)
			last = sum // do not repeat the same complaint until the file changes again
			return
		}
		last = sum
		log.Info("config reloaded", "why", why, "path", path)
		apply(cfg)
	}
	var debounce <-chan time.Time
	poll := time.NewTicker(2 * time.Second)
	defer poll.Stop()
	for {
		select {
		case <-ctx.Done():
			return nil
		case ev, ok := <-fw.Events:
			if !ok {
				return nil
			}
			if filepath.Clean(ev.Name) == abs {
				debounce = time.After(Debounce)
			}
		case err, ok := <-fw.Errors:
			if ok {
				log.Warn("config watch error; polling continues", "err", err)
			}
		case <-debounce:
			debounce = nil
			reload("file changed")
		case <-hup:
			last = [32]byte{} // SIGHUP always reloads
			reload("SIGHUP")
		case <-poll.C:
			reload("file changed (poll)")
		}
	}
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
