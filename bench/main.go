// Command bench runs the side-by-side benchmark: the same vendor (fixed
// windows at a random phase, 429 + Retry-After on excess), the same jobs
// and the same replica count for shaper and the approaches teams use
// instead, and writes a markdown table and an SVG chart of calls per vendor
// window over time.
//
//	go run ./bench -out docs            # REDIS_ADDR, default 127.0.0.1:6379
//	go run ./bench -idle -out docs      # idle cost; starts its own redis-server
package main

import (
	"context"
	"flag"
	"fmt"
	"math/rand/v2"
	"net/http/httptest"
	"os"
	"path/filepath"
	"runtime/pprof"
	"sort"
	"strings"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/shaper-dev/shaper/internal/vendorsim"
)

// Result is one run.
type Result struct {
	Approach    string
	Rate        int
	Replicas    int
	Calls       int
	Done        int
	RateLimited int
	MaxWindow   int
	Utilisation float64 // successful calls per second / the limit per second
	P50, P99    time.Duration
	Took        time.Duration // 0: not done within the cap
	PerWindow   []int         // successful+refused calls per vendor window, for the chart
}

func main() {
	out := flag.String("out", "docs", "directory for bench.md and bench.svg (ceilings.md with -ceilings, idle.md with -idle)")
	rates := flag.String("rates", "10,100,1000", "vendor limits per second")
	replicas := flag.String("replicas", "1,4", "worker replicas")
	seconds := flag.Int("seconds", 5, "calls per run = rate x seconds")
	capS := flag.Int("cap", 12, "stop a run after this many seconds")
	ceil := flag.Bool("ceilings", false, "measure the ceilings instead: tasks/s against plain asynq, and the highest rate shaped with 4 replicas")
	ceilRates := flag.String("ceiling-rates", "1000,2000,3000", "rates tried for the shaping ceiling")
	overheadOnly := flag.Bool("overhead", false, "measure only the overhead: tasks/s against plain asynq with a vendor that never limits (printed, nothing written)")
	scale := flag.Bool("scale", false, "measure the two scale ratios side by side: tasks/s against plain asynq, and 400 accounts at 5/s with 4 replicas (writes scale.md)")
	accountsOnly := flag.Bool("accounts", false, "measure only 400 accounts at 5/s each with 4 replicas (printed, nothing written)")
	serveAccountsN := flag.Int("serve-accounts", 0, "internal: run the per-account vendor of -accounts with this many accounts")
	serveRate := flag.Int("serve-rate", 5, "internal: calls per second per account for -serve-accounts")
	accountsN := flag.Int("accounts-n", 400, "accounts for -accounts")
	accountsCalls := flag.Int("accounts-calls", 60, "calls per account for -accounts")
	accountsReplicas := flag.Int("accounts-replicas", 4, "worker replicas for -accounts")
	cpuProfile := flag.String("cpuprofile", "", "write a CPU profile of the bench process to this file")
	idleMode := flag.Bool("idle", false, "measure the idle cost instead: Redis commands/s, goroutines, CPU and heap of vendors served with nothing queued, shaper against plain asynq, on a redis-server of its own (writes idle.md)")
	idleVendors := flag.Int("idle-vendors", 200, "vendors (queues) for -idle")
	idleReplicas := flag.Int("idle-replicas", 3, "worker replicas for -idle")
	idleWindow := flag.Duration("idle-window", 20*time.Second, "measuring window for -idle, after a 5s warm-up")
	learnIn := flag.String("learn", "", "write the learning scenarios' rows from this go test -v output into docs/learning.md (make bench-learn)")
	only := flag.String("only", "", "run only the approach with this key (e.g. shaper; printed, nothing written)")
	learnCmd := flag.String("learn-command", "make bench-learn", "the command -learn's output came from, for the page")
	flag.Parse()
	if *learnIn != "" {
		must(learnDoc(*learnIn, *out, *learnCmd))
		return
	}
	if *serveAccountsN > 0 {
		must(serveAccounts(*serveAccountsN, *serveRate))
		return
	}
	if *idleMode {
		md, err := idle(*idleVendors, *idleReplicas, *idleWindow)
		must(err)
		fmt.Print(md)
		must(os.MkdirAll(*out, 0o755))
		must(os.WriteFile(filepath.Join(*out, "idle.md"), []byte(md), 0o644))
		return
	}
	addr := os.Getenv("REDIS_ADDR")
	if addr == "" {
		addr = "127.0.0.1:6379"
	}
	rdb := redis.NewClient(&redis.Options{Addr: addr})
	if err := rdb.Ping(context.Background()).Err(); err != nil {
		fmt.Fprintf(os.Stderr, "bench: cannot reach Redis at %s (set REDIS_ADDR): %v\n", addr, err)
		os.Exit(1)
	}
	rdb.Close()
	if *cpuProfile != "" {
		f, err := os.Create(*cpuProfile)
		must(err)
		must(pprof.StartCPUProfile(f))
		defer pprof.StopCPUProfile()
	}
	if *scale {
		md := scaleReport(addr)
		fmt.Print(md)
		must(os.MkdirAll(*out, 0o755))
		must(os.WriteFile(filepath.Join(*out, "scale.md"), []byte(md), 0o644))
		return
	}
	if *accountsOnly {
		r, err := accountsRun(addr, *accountsN, 5, *accountsCalls, *accountsReplicas)
		must(err)
		fmt.Print(accountsTable([]accountsResult{r}))
		return
	}
	if *overheadOnly {
		fmt.Print(overhead(addr, 5000))
		return
	}
	if *ceil {
		md := ceilings(addr, 5000, ints(*ceilRates))
		fmt.Print(md)
		must(os.MkdirAll(*out, 0o755))
		must(os.WriteFile(filepath.Join(*out, "ceilings.md"), []byte(md), 0o644))
		return
	}
	var results []Result
	for _, r := range ints(*rates) {
		for _, n := range ints(*replicas) {
			for _, a := range approaches {
				if a.needsReplicas > n || *only != "" && a.key != *only {
					continue
				}
				res := run(addr, a, r, n, r**seconds, time.Duration(*capS)*time.Second)
				fmt.Fprintf(os.Stderr, "%-34s rate %4d x%d: %5d/%d done, %5d 429s, max %4d/window, util %5.1f%%, p50 %s, p99 %s, took %s\n",
					res.Approach, r, n, res.Done, res.Calls, res.RateLimited, res.MaxWindow, 100*res.Utilisation,
					res.P50.Round(time.Millisecond), res.P99.Round(time.Millisecond), tookString(res.Took))
				results = append(results, res)
			}
		}
	}
	if *only != "" {
		fmt.Print(table(results))
		return
	}
	if err := os.MkdirAll(*out, 0o755); err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(1)
	}
	md := table(results)
	fmt.Print(md)
	must(os.WriteFile(filepath.Join(*out, "bench.md"), []byte(md), 0o644))
	must(os.WriteFile(filepath.Join(*out, "bench.svg"), []byte(chart(results, 100, 4)), 0o644))
}

func must(err error) {
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(1)
	}
}

func ints(s string) []int {
	var out []int
	for _, f := range strings.Split(s, ",") {
		var n int
		fmt.Sscan(f, &n)
		if n > 0 {
			out = append(out, n)
		}
	}
	return out
}

func tookString(d time.Duration) string {
	if d == 0 {
		return "not done"
	}
	return d.Round(100 * time.Millisecond).String()
}

// run drives one approach against a fresh vendor.
func run(addr string, a approach, rate, replicas, calls int, limit time.Duration) Result {
	vend := &vendorsim.Mock{Rate: rate, Window: time.Second, Phase: time.Duration(rand.Int64N(int64(time.Second)))}
	srv := httptest.NewServer(vend)
	defer srv.Close()
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	env := &runEnv{addr: addr, vendorURL: srv.URL, rate: rate, replicas: replicas, calls: calls,
		name: fmt.Sprintf("b%d-%s", time.Now().UnixNano(), a.key)}
	start := time.Now()
	stop, err := a.start(ctx, env)
	if err != nil {
		fmt.Fprintln(os.Stderr, a.name, err)
		return Result{Approach: a.name, Rate: rate, Replicas: replicas, Calls: calls}
	}
	var took time.Duration
	for time.Since(start) < limit {
		if env.killAt > 0 && time.Since(start) > env.killAt && env.kill != nil {
			env.kill()
			env.kill = nil
		}
		if vend.Summarize().DistinctKeys >= calls {
			took = time.Since(start)
			break
		}
		time.Sleep(50 * time.Millisecond)
	}
	stop()
	return measure(a.name, vend, rate, replicas, calls, start, took)
}

func measure(name string, vend *vendorsim.Mock, rate, replicas, calls int, start time.Time, took time.Duration) Result {
	s := vend.Summarize()
	res := Result{Approach: name, Rate: rate, Replicas: replicas, Calls: calls, Done: s.DistinctKeys,
		RateLimited: s.RateLimited, MaxWindow: s.MaxPerWindow, Took: took}
	var ok []time.Time
	first := map[string]time.Time{}
	for _, r := range vend.Requests() {
		if r.Status < 300 {
			ok = append(ok, r.At)
			if _, seen := first[r.Key]; !seen {
				first[r.Key] = r.At
			}
		}
	}
	if len(ok) > 1 {
		sort.Slice(ok, func(i, j int) bool { return ok[i].Before(ok[j]) })
		res.Utilisation = float64(len(ok)-1) / ok[len(ok)-1].Sub(ok[0]).Seconds() / float64(rate)
	}
	var waits []time.Duration
	for _, t := range first {
		waits = append(waits, t.Sub(start))
	}
	sort.Slice(waits, func(i, j int) bool { return waits[i] < waits[j] })
	if len(waits) > 0 {
		res.P50, res.P99 = waits[len(waits)/2], waits[len(waits)*99/100]
	}
	// Calls per vendor window over time, for the chart.
	w0 := (start.UnixNano() - int64(vend.Phase)) / int64(vend.Window)
	for _, r := range vend.Requests() {
		k := int((r.At.UnixNano()-int64(vend.Phase))/int64(vend.Window) - w0)
		for len(res.PerWindow) <= k {
			res.PerWindow = append(res.PerWindow, 0)
		}
		res.PerWindow[k]++
	}
	return res
}
