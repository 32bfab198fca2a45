//go:build orderbar

package queue

import (
	"fmt"
	"net/http"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/shaper-dev/shaper/internal/vendorsim"
	"github.com/shaper-dev/shaper/shaper"
)

// TestOrderBar is make bench-order's measurement (docs/results.md): 3
// workers drain 1,500 calls queued in order to a fixed-window vendor at
// 100/s, steady and with the rate edited 100 -> 60 -> 100 and one 429
// (Retry-After: 1) on the way; make bench-order runs it beside two
// CPU-bound processes. It asserts safety (no vendor window over its
// limit, every call once) and logs how far calls started from their
// enqueue order.
func TestOrderBar(t *testing.T) {
	for _, edits := range []bool{false, true} {
		name := "steady"
		if edits {
			name = "rate edited and a 429"
		}
		t.Run(name, func(t *testing.T) {
			e := newEnv(t)
			vend := &vendorsim.Mock{Rate: 100, Window: time.Second, Phase: randomPhase(time.Second)}
			var seen atomic.Int64
			var once sync.Once
			h := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
				if edits && seen.Add(1) == 700 {
					refused := false
					once.Do(func() { refused = true })
					if refused {
						w.Header().Set("Retry-After", "1")
						w.WriteHeader(http.StatusTooManyRequests)
						return
					}
				}
				vend.ServeHTTP(w, r)
			})
			policy := func(rate int) shaper.Policy {
				return shaper.Policy{Limits: []shaper.Limit{{Rate: rate, Window: time.Second}}}
			}
			vendor := e.vendor("order", policy(100), 0, h)
			c := e.newClient()
			const n = 1500
			enqueueN(t, c, vendor, n)
			var workers []*Worker
			for range 3 {
				e.startWorker(func(w *Worker) { workers = append(workers, w) })
			}
			if edits {
				edit := func(rate int) {
					v := e.vendors[0]
					v.Policy = policy(rate)
					for _, w := range workers {
						if _, err := w.Apply([]Vendor{v}); err != nil {
							t.Error(err)
						}
					}
				}
				waitFor(t, time.Minute, "300 calls", func() bool { return vend.Summarize().DistinctKeys >= 300 })
				edit(60)
				waitFor(t, time.Minute, "500 calls", func() bool { return vend.Summarize().DistinctKeys >= 500 })
				edit(100)
			}
			waitFor(t, 3*time.Minute, "every call", func() bool { return vend.Summarize().DistinctKeys == n })
			reqs := vend.Requests()
			rate := float64(len(reqs)-1) / reqs[len(reqs)-1].At.Sub(reqs[0].At).Seconds()
			largest, far := 0, 0
			var pos int
			var moved strings.Builder // where the calls that moved more than 5 went: call@place+seconds
			for _, r := range reqs {
				if r.Status != http.StatusOK {
					continue
				}
				var i int
				fmt.Sscanf(r.Key[strings.LastIndex(r.Key, "-")+1:], "%d", &i)
				largest = max(largest, abs(pos-i))
				if abs(pos-i) > 5 {
					far++
					fmt.Fprintf(&moved, " %d@%d+%.2fs", i, pos, r.At.Sub(reqs[0].At).Seconds())
				}
				pos++
			}
			t.Logf("moved more than 5 (call@place+time):%s", moved.String())
			s, st := vend.Summarize(), e.stats(vendor)
			t.Logf("%s: %d calls, 3 workers: most in one vendor window %d (limit 100), %d sent twice; largest move %d places, %d (%.1f%%) moved more than 5; %d ticks given up late, %d dropped; %.1f calls/s from the first to the last",
				name, n, s.MaxPerWindow, s.DuplicateKeys, largest, far, 100*float64(far)/n, st.Late, st.Dropped, rate)
			if s.MaxPerWindow > 100 || s.DuplicateKeys > 0 {
				t.Errorf("%d calls in one vendor window (limit 100), %d sent twice", s.MaxPerWindow, s.DuplicateKeys)
			}
		})
	}
}
