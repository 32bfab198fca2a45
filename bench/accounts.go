package main

import (
	"context"
	"fmt"
	"io"
	"log/slog"
	"math/rand/v2"
	"net/http"
	"net/http/httptest"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/shaper-dev/shaper/internal/vendorsim"
	"github.com/shaper-dev/shaper/queue"
	"github.com/shaper-dev/shaper/shaper"
	"github.com/shaper-dev/shaper/vendorclients"
)

// accountsResult is one run of many accounts of one per-account vendor.
type accountsResult struct {
	Accounts, PerAccount, Replicas int
	Calls, Done, RateLimited       int
	WorstWindow                    int     // most calls of one account in one of its vendor windows
	Delivered                      float64 // calls per second over the run, first call to last
	Share                          float64 // Delivered / what the vendor allows (accounts x per-account rate)
	ShareP10                       float64 // 10th percentile over accounts of their own share
	Took                           time.Duration
	Steady                         time.Duration // while every account had calls waiting
	LagP99, LagMax                 time.Duration // from a call's tick to the vendor reading it
}

type statusWriter struct {
	http.ResponseWriter
	status int
}

func (w *statusWriter) WriteHeader(code int) {
	w.status = code
	w.ResponseWriter.WriteHeader(code)
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

type lagLog struct {
	mu sync.Mutex
	d  []time.Duration
}

var lags lagLog

func (l *lagLog) add(d time.Duration) { l.mu.Lock(); l.d = append(l.d, d); l.mu.Unlock() }
func (l *lagLog) p99max() (time.Duration, time.Duration) {
	l.mu.Lock()
	defer l.mu.Unlock()
	if len(l.d) == 0 {
		return 0, 0
	}
	slices.Sort(l.d)
	p, m := l.d[len(l.d)*99/100], l.d[len(l.d)-1]
	l.d = nil
	return p, m
}

// accountsRun runs callsEach calls for each of n accounts of a vendor that
// allows perAccount calls per second per account (fixed windows, a random
// phase per account), through replicas workers, and measures window
// safety per account and the share of the vendor's allowance delivered.
func accountsRun(addr string, n, perAccount, callsEach, replicas int) (accountsResult, error) {
	res := accountsResult{Accounts: n, PerAccount: perAccount, Replicas: replicas, Calls: n * callsEach}
	var succeeded atomic.Int64
	vends := make(map[string]*vendorsim.Vendor, n)
	names := make([]string, n)
	for i := range names {
		names[i] = fmt.Sprintf("store-%03d", i)
		vends[names[i]] = &vendorsim.Vendor{Rate: perAccount, Window: time.Second, Phase: time.Duration(rand.Int64N(int64(time.Second)))}
	}
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		rest, _ := strings.CutPrefix(r.URL.Path, "/stores/")
		account, _, _ := strings.Cut(rest, "/")
		v, ok := vends[account]
		if !ok {
			http.Error(w, "no such store", http.StatusNotFound)
			return
		}
		if ns, err := strconv.ParseInt(r.Header.Get("X-Tick"), 10, 64); err == nil {
			lags.add(time.Since(time.Unix(0, ns)))
		}
		sw := &statusWriter{ResponseWriter: w, status: http.StatusOK}
		v.ServeHTTP(sw, r)
		if sw.status < 300 {
			succeeded.Add(1)
		}
	}))
	defer srv.Close()
	env := &runEnv{addr: addr, name: fmt.Sprintf("a%d-accounts", time.Now().UnixNano())}
	defer env.close()
	vendor := queue.Vendor{Vendor: vendorclients.Vendor{Name: env.name, BaseURL: srv.URL + "/stores/{account}"},
		Policy: shaper.Policy{Limits: []shaper.Limit{{Rate: perAccount, Window: time.Second}}}, PerAccount: true}
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	if err := warmShaper(ctx, &runEnv{addr: addr, name: env.name, rate: perAccount}); err != nil {
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
	// Counted as answered, not summarised, while it runs: summaries of
	// 400 vendors five times a second would load the machine under test.
	done := func() int { return int(succeeded.Load()) }
	limit := time.Duration(2*callsEach/perAccount+30) * time.Second
	for time.Since(start) < limit && done() < res.Calls {
		time.Sleep(200 * time.Millisecond)
	}
	res.Took = time.Since(start)
	res.LagP99, res.LagMax = lags.p99max()
	var first, last time.Time
	var allIn, firstOut time.Time // every account has started / the first has finished
	var shares []float64
	var all []time.Time
	for _, v := range vends {
		s := v.Summarize()
		res.Done += s.DistinctKeys
		res.RateLimited += s.RateLimited
		res.WorstWindow = max(res.WorstWindow, s.MaxPerWindow)
		reqs := v.Requests()
		if len(reqs) < 2 {
			continue
		}
		f, l := reqs[0].At, reqs[len(reqs)-1].At
		if first.IsZero() || f.Before(first) {
			first = f
		}
		last = maxTime(last, l)
		allIn = maxTime(allIn, f)
		if firstOut.IsZero() || l.Before(firstOut) {
			firstOut = l
		}
		for _, r := range reqs {
			all = append(all, r.At)
		}
		// An account's own share: calls after its first, over its span,
		// against its allowance.
		shares = append(shares, float64(len(reqs)-1)/l.Sub(f).Seconds()/float64(perAccount))
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
	b.WriteString("| accounts x limit/s | replicas | calls done | HTTP 429s | most calls of one account in one of its windows / limit | calls/s while every account had calls waiting | share of what the vendor allows | p10 of accounts' own share | tick to vendor p99 / max | took |\n|---|---|---|---|---|---|---|---|---|---|\n")
	for _, r := range rs {
		fmt.Fprintf(&b, "| %d x %d | %d | %d/%d | %d | %d / %d | %.0f (over %s) | **%.1f%%** | %.1f%% | %s / %s | %s |\n",
			r.Accounts, r.PerAccount, r.Replicas, r.Done, r.Calls, r.RateLimited, r.WorstWindow, r.PerAccount,
			r.Delivered, r.Steady.Round(100*time.Millisecond), 100*r.Share, 100*r.ShareP10, r.LagP99.Round(100*time.Microsecond), r.LagMax.Round(100*time.Microsecond), r.Took.Round(100*time.Millisecond))
	}
	return b.String()
}
