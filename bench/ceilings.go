package main

import (
	"context"
	"fmt"
	"net/http/httptest"
	"os"
	"slices"
	"strings"
	"time"

	"github.com/shaper-dev/shaper/internal/vendorsim"
)

// ceilings measures end-to-end tasks per second with a vendor that never
// limits (shaper against plain asynq, the overhead ratio), and the highest
// rate one vendor can be shaped at with 4 replicas while window safety
// holds.
func ceilings(addr string, calls int, rates []int) string {
	var b strings.Builder
	b.WriteString(overhead(addr, calls))
	b.WriteString("| shaper, 4 replicas, limit/s | calls | HTTP 429s | most calls in a vendor window / limit | utilisation |\n|---|---|---|---|---|\n")
	for _, r := range rates {
		res := run(addr, approaches[0], r, 4, r*5, 15*time.Second)
		fmt.Fprintf(&b, "| %d | %d/%d | %d | %d / %d | %.0f%% |\n", r, res.Done, res.Calls, res.RateLimited, res.MaxWindow, r, 100*res.Utilisation)
	}
	return b.String()
}

// overheadConcurrency is plain asynq's concurrency per replica in the
// recipe (internal/recipes), given to shaper too.
const overheadConcurrency = 20

// overheadRounds is how many times each side runs, alternating, so that
// the machine's drift hits both alike.
const overheadRounds = 3

func median(xs []float64) float64 {
	s := slices.Clone(xs)
	slices.Sort(s)
	return s[len(s)/2]
}

// overhead measures end-to-end tasks per second with a vendor that never
// limits: plain asynq against shaper with the same replicas and
// concurrency.
func overhead(addr string, calls int) string {
	var b strings.Builder
	unlimited := func(a approach, replicas, rate int) float64 {
		vend := &vendorsim.Mock{Rate: 1 << 30, Window: time.Second}
		srv := httptest.NewServer(vend)
		defer srv.Close()
		env := &runEnv{addr: addr, vendorURL: srv.URL, rate: rate, replicas: replicas, calls: calls, concurrency: overheadConcurrency,
			name: fmt.Sprintf("c%d-%s", time.Now().UnixNano(), a.key)}
		ctx, cancel := context.WithCancel(context.Background())
		defer cancel()
		if a.warm != nil {
			if err := a.warm(ctx, env); err != nil {
				return 0
			}
		}
		start := time.Now()
		stop, err := a.start(ctx, env)
		if err != nil {
			return 0
		}
		for time.Since(start) < time.Minute && vend.Summarize().DistinctKeys < calls {
			time.Sleep(20 * time.Millisecond)
		}
		took := time.Since(start)
		stop()
		return float64(vend.Summarize().DistinctKeys) / took.Seconds()
	}
	plain := approach{key: "plain", name: "plain asynq", start: func(ctx context.Context, e *runEnv) (func(), error) {
		return startAsynq(ctx, e, func() admit { return func(context.Context) (bool, time.Duration) { return true, 0 } })
	}}
	b.WriteString("| end to end, vendor never limits, 4 replicas | tasks/s (enqueue to done), median of 3 alternating runs |\n|---|---|\n")
	var pr, sr []float64
	for range overheadRounds {
		pr = append(pr, unlimited(plain, 4, 1))
		sr = append(sr, unlimited(approaches[0], 4, 1_000_000))
	}
	ps, ss := median(pr), median(sr)
	fmt.Fprintf(os.Stderr, "bench: overhead rounds: plain %.0f, shaper %.0f tasks/s\n", pr, sr)
	cold := approaches[0]
	cold.warm = nil
	cs := unlimited(cold, 4, 1_000_000)
	fmt.Fprintf(&b, "| plain asynq (concurrency %d per replica) | %.0f |\n| shaper, rate 1,000,000/s (the gate never binds), same concurrency | %.0f |\n| **shaper / plain asynq** | **%.2f** |\n| shaper, the vendor's very first use (one run: its first calls wait one horizon, 1s, since a vendor Redis never saw looks like one whose state was lost) | %.0f |\n\n",
		overheadConcurrency, ps, ss, ss/max(ps, 1), cs)
	return b.String()
}
