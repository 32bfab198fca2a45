package main

import (
	"context"
	"fmt"
	"net/http/httptest"
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
	unlimited := func(a approach, replicas, rate int) float64 {
		vend := &vendorsim.Vendor{Rate: 1 << 30, Window: time.Second}
		srv := httptest.NewServer(vend)
		defer srv.Close()
		env := &runEnv{addr: addr, vendorURL: srv.URL, rate: rate, replicas: replicas, calls: calls,
			name: fmt.Sprintf("c%d-%s", time.Now().UnixNano(), a.key)}
		ctx, cancel := context.WithCancel(context.Background())
		defer cancel()
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
	b.WriteString("| end to end, vendor never limits, 4 replicas | tasks/s (enqueue to done) |\n|---|---|\n")
	ps := unlimited(plain, 4, 1)
	ss := unlimited(approaches[0], 4, 1_000_000)
	fmt.Fprintf(&b, "| plain asynq (concurrency 20 per replica) | %.0f |\n| shaper, rate 1,000,000/s (the gate never binds) | %.0f |\n| overhead ratio | %.2f |\n\n", ps, ss, ps/max(ss, 1))

	b.WriteString("| shaper, 4 replicas, limit/s | calls | HTTP 429s | most calls in a vendor window / limit | utilisation |\n|---|---|---|---|---|\n")
	for _, r := range rates {
		res := run(addr, approaches[0], r, 4, r*5, 15*time.Second)
		fmt.Fprintf(&b, "| %d | %d/%d | %d | %d / %d | %.0f%% |\n", r, res.Done, res.Calls, res.RateLimited, res.MaxWindow, r, 100*res.Utilisation)
	}
	return b.String()
}
