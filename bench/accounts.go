package main

import (
	"bufio"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"log/slog"
	"math/rand/v2"
	"net"
	"net/http"
	"os"
	"os/exec"
	"runtime"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/shaper-dev/shaper/internal/vendorsim"
	"github.com/shaper-dev/shaper/internal/windows"
	"github.com/shaper-dev/shaper/queue"
	"github.com/shaper-dev/shaper/shaper"
	"github.com/shaper-dev/shaper/vendorclients"
)

// accountsResult is one run of many accounts of one per-account vendor.
type accountsResult struct {
	Accounts, PerAccount, Replicas int
	Calls, Done, RateLimited       int
	WorstWindow                    int     // most calls of one account in one of its vendor windows
	Delivered                      float64 // calls per second while every account had calls waiting
	Whole                          float64 // calls per second over the whole run, the vendor's first call to its last
	Share                          float64 // Delivered / what the vendor allows (accounts x per-account rate)
	ShareP10                       float64 // 10th percentile over accounts of their own share
	Took                           time.Duration
	Steady                         time.Duration // while every account had calls waiting
	LagP99, LagMax                 time.Duration // from a call's tick to the vendor reading it
	GateTrips                      int           // gate round trips (reservations and ticks given up)
	Spread                         time.Duration // from the vendor's first call to the last account's first
	Longest                        time.Duration // the longest of an account's first call to its last
}

// tickHeader sends each call's tick, for the vendor to measure how late
// it reads the call: the jitter the guard must cover.
type tickHeader struct{}

var benchTransport = &http.Transport{MaxIdleConns: 2000, MaxIdleConnsPerHost: 2000}

func (tickHeader) RoundTrip(r *http.Request) (*http.Response, error) {
	if p := vendorclients.PermitFrom(r.Context()); p != nil {
		r.Header.Set("X-Tick", strconv.FormatInt(p.Tick.UnixNano(), 10))
	}
	return benchTransport.RoundTrip(r)
}

// accountsRun runs callsEach calls for each of n accounts of a vendor that
// allows perAccount calls per second per account (fixed windows, a random
// phase per account), through replicas workers, and measures window
// safety per account and the share of the vendor's allowance delivered.
func accountsRun(addr string, n, perAccount, callsEach, replicas int) (accountsResult, error) {
	res := accountsResult{Accounts: n, PerAccount: perAccount, Replicas: replicas, Calls: n * callsEach}
	names := make([]string, n)
	for i := range names {
		names[i] = fmt.Sprintf("store-%03d", i)
	}
	vendorURL, stopVendor, err := startAccountsVendor(n, perAccount)
	if err != nil {
		return res, err
	}
	defer stopVendor()
	env := &runEnv{addr: addr, name: fmt.Sprintf("a%d-accounts", time.Now().UnixNano())}
	defer env.close()
	vendor := queue.Vendor{Endpoint: vendorclients.Endpoint{Name: env.name, BaseURL: vendorURL + "/stores/{account}"},
		Policy: shaper.Policy{Limits: []shaper.Limit{{Rate: perAccount, Window: time.Second}}}, PerAccount: true}
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	if err := warmAccounts(ctx, addr, env.name, vendor, names[0]); err != nil {
		return res, err
	}
	qc := queue.NewClient(env.client(), queue.ClientConfig{Vendors: []queue.Vendor{vendor}, KeyPrefix: env.name})
	defer qc.Close()
	start := time.Now()
	var wg sync.WaitGroup
	quiet := slog.New(slog.NewTextHandler(io.Discard, nil))
	wctx, stop := context.WithCancel(ctx)
	for range replicas {
		w, err := queue.NewWorker(env.client(), queue.WorkerConfig{Logger: quiet, KeyPrefix: env.name, Vendors: []queue.Vendor{vendor}, Transport: tickHeader{}})
		if err != nil {
			stop()
			return res, err
		}
		wg.Go(func() { _ = w.Run(wctx) })
	}
	defer func() { stop(); wg.Wait() }()
	// One batch per account, the accounts side by side, as a team's
	// integrations would enqueue them.
	var eg sync.WaitGroup
	errs := make(chan error, n)
	sem := make(chan struct{}, 32)
	for _, a := range names {
		calls := make([]queue.Call, callsEach)
		for i := range calls {
			calls[i] = queue.Call{Account: a, ID: fmt.Sprintf("%s-%s-%03d", env.name, a, i), Method: "POST", Path: fmt.Sprintf("/orders/%d", i)}
		}
		sem <- struct{}{}
		eg.Go(func() {
			defer func() { <-sem }()
			if _, err := qc.EnqueueBatch(ctx, env.name, calls); err != nil {
				errs <- err
			}
		})
	}
	eg.Wait()
	close(errs)
	if err := <-errs; err != nil {
		return res, err
	}
	done := func() int {
		var c struct{ Succeeded int }
		_ = getJSON(vendorURL+"/_count", &c)
		return c.Succeeded
	}
	limit := time.Duration(2*callsEach/perAccount+30) * time.Second
	for time.Since(start) < limit && done() < res.Calls {
		time.Sleep(200 * time.Millisecond)
	}
	res.Took = time.Since(start)
	// The gate's round trips: reservations (granted or deferred) and ticks
	// given up (late, or dropped for a pause).
	st, _ := env.client().HGetAll(ctx, env.name+":{"+env.name+"}:stats").Result()
	// granted counts per clock minute too: its total is granted plus
	// both minute slots (shaper's minuteCounterLua).
	for _, f := range []string{"granted", "granted_c0", "granted_c1", "deferred", "late", "dropped"} {
		n, _ := strconv.Atoi(st[f])
		res.GateTrips += n
	}
	var got map[string]accountLog
	if err := getJSON(vendorURL+"/_requests", &got); err != nil {
		return res, err
	}
	var allIn, firstOut time.Time // every account has started / the first has finished
	var shares []float64
	var all []time.Time
	var lagList []time.Duration
	for _, a := range got {
		keys := map[string]bool{}
		ts := make([]time.Time, 0, len(a.Requests))
		for _, r := range a.Requests {
			t := time.Unix(0, r.At)
			ts = append(ts, t)
			all = append(all, t)
			if r.Status == http.StatusTooManyRequests {
				res.RateLimited++
			}
			if r.Status < 300 {
				keys[r.Key] = true
			}
			if r.Tick > 0 {
				lagList = append(lagList, t.Sub(time.Unix(0, r.Tick)))
			}
		}
		res.Done += len(keys)
		res.WorstWindow = max(res.WorstWindow, windows.MaxFixed(ts, time.Second, time.Duration(a.Phase)))
		if len(ts) < 2 {
			continue
		}
		f, l := ts[0], ts[len(ts)-1]
		allIn = maxTime(allIn, f)
		res.Longest = max(res.Longest, l.Sub(f))
		if firstOut.IsZero() || l.Before(firstOut) {
			firstOut = l
		}
		// An account's own share: calls after its first, over its span,
		// against its allowance.
		shares = append(shares, float64(len(ts)-1)/l.Sub(f).Seconds()/float64(perAccount))
	}
	if len(all) > 1 {
		first, last := slices.MinFunc(all, time.Time.Compare), slices.MaxFunc(all, time.Time.Compare)
		res.Whole = float64(len(all)-1) / last.Sub(first).Seconds()
		res.Spread = allIn.Sub(first)
	}
	if len(lagList) > 0 {
		slices.Sort(lagList)
		res.LagP99, res.LagMax = lagList[len(lagList)*99/100], lagList[len(lagList)-1]
	}
	// What the vendor allows is delivered while every account has calls
	// waiting: from the moment the last account started to the moment the
	// first one finished.
	if span := firstOut.Sub(allIn).Seconds(); span > 0 {
		in := 0
		for _, t := range all {
			if !t.Before(allIn) && t.Before(firstOut) {
				in++
			}
		}
		res.Delivered = float64(in) / span
		res.Share = res.Delivered / float64(n*perAccount)
		res.Steady = firstOut.Sub(allIn)
	}
	if len(shares) > 0 {
		slices.Sort(shares)
		res.ShareP10 = shares[len(shares)/10]
	}
	return res, nil
}

func maxTime(a, b time.Time) time.Time {
	if b.After(a) {
		return b
	}
	return a
}

// accountsTable renders runs of accountsRun.
func accountsTable(rs []accountsResult) string {
	var b strings.Builder
	b.WriteString("| accounts x limit/s | replicas | calls done | HTTP 429s | most calls of one account in one of its windows / limit | calls/s while every account had calls waiting | share of what the vendor allows | p10 of accounts' own share | tick to vendor p99 / max | gate round trips per call | calls/s, first call to last | first calls spread / longest account | took |\n|---|---|---|---|---|---|---|---|---|---|---|---|---|\n")
	for _, r := range rs {
		fmt.Fprintf(&b, "| %d x %d | %d | %d/%d | %d | %d / %d | %.0f (over %s) | **%.1f%%** | %.1f%% | %s / %s | %.2f | %.0f | %s / %s | %s |\n",
			r.Accounts, r.PerAccount, r.Replicas, r.Done, r.Calls, r.RateLimited, r.WorstWindow, r.PerAccount,
			r.Delivered, r.Steady.Round(100*time.Millisecond), 100*r.Share, 100*r.ShareP10, r.LagP99.Round(100*time.Microsecond), r.LagMax.Round(100*time.Microsecond), float64(r.GateTrips)/float64(max(r.Done, 1)), r.Whole,
			r.Spread.Round(10*time.Millisecond), r.Longest.Round(10*time.Millisecond), r.Took.Round(100*time.Millisecond))
	}
	return b.String()
}

// accountLog is what the vendor process saw of one account.
type accountLog struct {
	Phase    int64 // ns
	Requests []loggedRequest
}

type loggedRequest struct {
	At, Tick int64 // ns; Tick from the X-Tick header, 0 if none
	Status   int
	Key      string
}

func getJSON(url string, v any) error {
	resp, err := http.Get(url)
	if err != nil {
		return err
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		return fmt.Errorf("GET %s: %s", url, resp.Status)
	}
	return json.NewDecoder(resp.Body).Decode(v)
}

// startAccountsVendor runs the per-account vendor in a process of its own
// (this binary with -serve-accounts), so that its clock reads a request
// when it arrives, not when the loaded bench process gets round to it.
func startAccountsVendor(n, perAccount int) (url string, stop func(), err error) {
	exe, err := os.Executable()
	if err != nil {
		return "", nil, err
	}
	cmd := exec.Command(exe, "-serve-accounts", strconv.Itoa(n), "-serve-rate", strconv.Itoa(perAccount))
	cmd.Stderr = os.Stderr
	out, err := cmd.StdoutPipe()
	if err != nil {
		return "", nil, err
	}
	if err := cmd.Start(); err != nil {
		return "", nil, err
	}
	stop = func() { _ = cmd.Process.Kill(); _ = cmd.Wait() }
	line, err := bufio.NewReader(out).ReadString('\n')
	if err != nil {
		stop()
		return "", nil, fmt.Errorf("the vendor process did not say where it listens: %w", err)
	}
	return strings.TrimSpace(line), stop, nil
}

// serveAccounts is the vendor process: n accounts, each a fixed-window
// vendor of perAccount calls per second at a random phase, under
// /stores/<account>/; /_count and /_requests report.
func serveAccounts(n, perAccount int) error {
	vends := make(map[string]*vendorsim.Mock, n)
	ticks := map[string]int64{} // Idempotency-Key + arrival -> tick, by request
	var mu sync.Mutex
	var succeeded atomic.Int64
	for i := range n {
		vends[fmt.Sprintf("store-%03d", i)] = &vendorsim.Mock{Rate: perAccount, Window: time.Second, Phase: time.Duration(rand.Int64N(int64(time.Second)))}
	}
	mux := http.NewServeMux()
	mux.HandleFunc("/stores/", func(w http.ResponseWriter, r *http.Request) {
		rest, _ := strings.CutPrefix(r.URL.Path, "/stores/")
		account, _, _ := strings.Cut(rest, "/")
		v, ok := vends[account]
		if !ok {
			http.Error(w, "no such store", http.StatusNotFound)
			return
		}
		sw := &statusWriter{ResponseWriter: w, status: http.StatusOK}
		v.ServeHTTP(sw, r)
		if sw.status < 300 {
			succeeded.Add(1)
		}
		if tick, err := strconv.ParseInt(r.Header.Get("X-Tick"), 10, 64); err == nil {
			mu.Lock()
			ticks[account+"|"+r.Header.Get("Idempotency-Key")+"|"+strconv.Itoa(sw.status)] = tick
			mu.Unlock()
		}
	})
	mux.HandleFunc("/_count", func(w http.ResponseWriter, r *http.Request) {
		_ = json.NewEncoder(w).Encode(map[string]int64{"Succeeded": succeeded.Load()})
	})
	mux.HandleFunc("/_requests", func(w http.ResponseWriter, r *http.Request) {
		out := make(map[string]accountLog, len(vends))
		mu.Lock()
		defer mu.Unlock()
		for name, v := range vends {
			l := accountLog{Phase: int64(v.Phase)}
			for _, q := range v.Requests() {
				l.Requests = append(l.Requests, loggedRequest{At: q.At.UnixNano(), Status: q.Status, Key: q.Key,
					Tick: ticks[name+"|"+q.Key+"|"+strconv.Itoa(q.Status)]})
			}
			out[name] = l
		}
		_ = json.NewEncoder(w).Encode(out)
	})
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return err
	}
	fmt.Printf("http://%s\n", ln.Addr())
	return http.Serve(ln, mux)
}

type statusWriter struct {
	http.ResponseWriter
	status int
}

func (w *statusWriter) WriteHeader(code int) {
	w.status = code
	w.ResponseWriter.WriteHeader(code)
}

// scaleReport is `make bench`'s scale section: the overhead against plain
// asynq, and three runs of 400 accounts at 5/s each with 4 replicas.
func scaleReport(addr string) string {
	var b strings.Builder
	fmt.Fprintf(&b, "# Scale: overhead and many accounts\n\n`go run ./bench -scale -out docs` (part of `make bench`), Redis at %s, %d CPUs, %s.\n\n", addr, runtime.NumCPU(), runtime.Version())
	b.WriteString("## Overhead: a vendor that never limits\n\n")
	b.WriteString(overhead(addr, 5000))
	b.WriteString("## 400 accounts at 5 calls/s each (2,000/s in all), 4 replicas\n\n")
	b.WriteString("Each account is a fixed-window vendor (5 per second, a random phase of its own) in a process of its own, so that it reads a call when it arrives; 60 calls per account, enqueued per account while the workers run. The share is counted while every account had calls waiting; the vendor allows 5 per second per account, shaper's default guard (20 ms) spaces them to 4.9.\n\n")
	var rs []accountsResult
	for range 3 {
		r, err := accountsRun(addr, 400, 5, 60, 4)
		if err != nil {
			fmt.Fprintf(&b, "run failed: %v\n\n", err)
			continue
		}
		rs = append(rs, r)
	}
	b.WriteString(accountsTable(rs))
	return b.String()
}

// warmAccounts uses the per-account vendor v once, through one account,
// as a vendor in service has been: the first call of a group Redis has
// never seen waits one horizon. (Through the vendor-level bucket, as
// warmShaper does for a vendor of one bucket, its grant would record
// itself in a list where the group's accounts keep a sorted set of their
// held calls: every account's grant then failed with WRONGTYPE until the
// list expired, 13% of the allowance delivered.)
func warmAccounts(ctx context.Context, addr, prefix string, v queue.Vendor, account string) error {
	rdb := redis.NewClient(&redis.Options{Addr: addr})
	defer rdb.Close()
	g := shaper.NewGate(rdb, shaper.Config{KeyPrefix: prefix})
	grp, err := g.Group(v.Name, v.Total)
	if err != nil {
		return err
	}
	b, err := grp.Bucket(account, v.Policy)
	if err != nil {
		return err
	}
	_, err = b.Acquire(ctx)
	return err
}
