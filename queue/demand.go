package queue

import (
	"context"
	"fmt"
	"sync"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/shaper-dev/shaper/internal/redisonce"
)

// Servers on demand. A vendor's asynq server (and its supervisor) runs in
// a worker only while the vendor's queue holds work: pending, active,
// scheduled or retry tasks. An idle vendor costs no goroutine and no Redis
// command, so a worker configured with hundreds of vendors costs what the
// busy ones cost. Three things start a vendor's server:
//
//   - a work signal: every Client enqueue bumps the vendor in a sorted
//     set and a sequence number (at most once per signalEvery per client
//     and vendor); workers read the sequence every workPollEvery, and the
//     set when it moved;
//   - a sweep of every idle vendor's queue (one pipelined round trip) when
//     Run starts, every sweepEvery (tasks put in a queue by other means,
//     or a lost signal), and after a server stops (work that came during
//     the stop);
//   - nothing else: the server of a vendor whose queue has been empty for
//     idleStopAfter stops.
//
// A throttled signal is safe: an enqueue that does not signal comes at
// most signalEvery after one that did, while the server that signal
// started cannot yet have seen its queue empty for idleStopAfter.
const (
	workPollEvery  = 250 * time.Millisecond
	sweepEvery     = 30 * time.Second
	idleCheckEvery = 2 * time.Second
	idleStopAfter  = 10 * time.Second
	signalEvery    = time.Second
)

// Work signal keys: the vendors' counters and their sum, in one hash slot.
func workKey(prefix string) string    { return prefix + ":{work}" }
func workSeqKey(prefix string) string { return prefix + ":{work}:seq" }

var signalScript = redis.NewScript(`
redis.call('ZINCRBY', KEYS[1], 1, ARGV[1])
return redis.call('INCR', KEYS[2])`)

// signaller throttles a client's work signals per vendor. Its map holds
// one entry per configured vendor at most.
type signaller struct {
	mu   sync.Mutex
	last map[string]time.Time
}

// signal tells workers that vendor has work, unless this client told
// them less than signalEvery ago. A failed signal is tried again on the
// next enqueue; the work is found by the next sweep meanwhile.
func (c *Client) signal(ctx context.Context, vendor string) {
	s := &c.signals
	now := time.Now()
	s.mu.Lock()
	if now.Sub(s.last[vendor]) < signalEvery {
		s.mu.Unlock()
		return
	}
	s.last[vendor] = now
	s.mu.Unlock()
	keys := []string{workKey(c.cfg.KeyPrefix), workSeqKey(c.cfg.KeyPrefix)}
	if err := redisonce.Run(ctx, c.rdb, signalScript, keys, vendor).Err(); err != nil {
		s.mu.Lock()
		delete(s.last, vendor)
		s.mu.Unlock()
	}
}

// workWatch is a worker's view of the work signals.
type workWatch struct {
	seq    int64
	counts map[string]float64 // by configured vendor
}

// pollWork returns the vendors signalled since the last poll (nil when
// none, or on the first poll, which only takes the baseline).
func (w *Worker) pollWork(ctx context.Context, ww *workWatch) ([]string, error) {
	seq, err := w.rdb.Get(ctx, workSeqKey(w.cfg.KeyPrefix)).Int64()
	if err != nil && err != redis.Nil {
		return nil, err
	}
	if ww.counts != nil && seq == ww.seq {
		return nil, nil
	}
	all, err := w.rdb.ZRangeWithScores(ctx, workKey(w.cfg.KeyPrefix), 0, -1).Result()
	if err != nil {
		return nil, err
	}
	first := ww.counts == nil
	counts := make(map[string]float64, len(all))
	var moved []string
	for _, z := range all {
		name, _ := z.Member.(string)
		counts[name] = z.Score
		if !first && ww.counts[name] != z.Score {
			moved = append(moved, name)
		}
	}
	ww.seq, ww.counts = seq, counts
	return moved, nil
}

// waitingCounts returns, for each vendor, how many tasks its queues (both
// lanes) hold (pending, active, scheduled and retry): one pipelined round
// trip.
func waitingCounts(ctx context.Context, rdb redis.UniversalClient, vendors []string) ([]int64, error) {
	pipe := rdb.Pipeline()
	cmds := make([][8]*redis.IntCmd, len(vendors))
	for i, v := range vendors {
		for j, key := range []func(string, string) string{queueKey, highQueueKey} {
			cmds[i][4*j], cmds[i][4*j+1] = pipe.LLen(ctx, key(v, "pending")), pipe.LLen(ctx, key(v, "active"))
			cmds[i][4*j+2], cmds[i][4*j+3] = pipe.ZCard(ctx, key(v, "scheduled")), pipe.ZCard(ctx, key(v, "retry"))
		}
	}
	if _, err := pipe.Exec(ctx); err != nil {
		return nil, fmt.Errorf("queue: count the vendors' queues: %w", err)
	}
	out := make([]int64, len(vendors))
	for i, c := range cmds {
		for _, n := range c {
			out[i] += n.Val()
		}
	}
	return out, nil
}

// sweep starts the server of every vendor in rts that has work and none.
// It runs on Run's goroutine, as do all starts and stops.
func (w *Worker) sweep(ctx context.Context, rts []*vendorRuntime) error {
	var idle []*vendorRuntime
	var names []string
	for _, rt := range rts {
		if rt.server == nil {
			idle = append(idle, rt)
			names = append(names, rt.vendor.Name)
		}
	}
	if len(idle) == 0 {
		return nil
	}
	n, err := waitingCounts(ctx, w.rdb, names)
	if err != nil {
		return err
	}
	for i, rt := range idle {
		if n[i] > 0 {
			w.ensure(ctx, rt)
		}
	}
	return nil
}

// ensure starts rt's server if it has none.
func (w *Worker) ensure(ctx context.Context, rt *vendorRuntime) {
	if rt.server != nil {
		return
	}
	if err := w.start(ctx, rt); err != nil {
		w.log.Warn("could not start serving a vendor with work; trying again at the next signal or sweep", "vendor", rt.vendor.Name, "err", err)
	}
}

// runtimes returns the current vendors' runtimes; named limits them to
// those vendors (unknown names are skipped).
func (w *Worker) runtimes(named []string) []*vendorRuntime {
	w.mu.Lock()
	defer w.mu.Unlock()
	if named == nil {
		out := make([]*vendorRuntime, 0, len(w.vendors))
		for _, rt := range w.vendors {
			out = append(out, rt)
		}
		return out
	}
	var out []*vendorRuntime
	for _, name := range named {
		if rt, ok := w.vendors[name]; ok {
			out = append(out, rt)
		}
	}
	return out
}
