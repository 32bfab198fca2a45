// Package demo runs shaper end to end on one machine with nothing
// installed: an embedded Redis, mock vendors enforcing a fixed window at a
// random phase, three shaper workers, and beside them the common
// alternative (a token bucket per worker, burst = rate, reschedule on 429)
// on an identical vendor, then prints a verdict.
package demo

import (
	"context"
	"fmt"
	"io"
	"log/slog"
	"math/rand/v2"
	"net/http/httptest"
	"sort"
	"strconv"
	"sync"
	"text/tabwriter"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/shaper-dev/shaper/internal/embedded"
	"github.com/shaper-dev/shaper/internal/recipes"
	"github.com/shaper-dev/shaper/internal/vendorsim"
	"github.com/shaper-dev/shaper/queue"
	"github.com/shaper-dev/shaper/shaper"
	"github.com/shaper-dev/shaper/vendorclients"
)

// Options size the demo.
type Options struct {
	Calls   int           // per approach; default 1000
	Rate    int           // the vendor's limit per Window; default 50
	Window  time.Duration // default 1s
	Workers int           // replicas per approach; default 3
	Timeout time.Duration // the demo stops by then whatever happened; default 40s
	// Settle is how long the demo goes on once shaper is done while the
	// alternative is not, when the alternative has already shown what it
	// does (429s, or more calls in a window than the limit); default 3s.
	Settle time.Duration
}

func (o *Options) defaults() {
	if o.Calls <= 0 {
		o.Calls = 1000
	}
	if o.Rate <= 0 {
		o.Rate = 50
	}
	if o.Window <= 0 {
		o.Window = time.Second
	}
	if o.Workers <= 0 {
		o.Workers = 3
	}
	if o.Timeout <= 0 {
		o.Timeout = 40 * time.Second
	}
	if o.Settle <= 0 {
		o.Settle = 3 * time.Second
	}
}

// Verdict is one approach's result.
type Verdict struct {
	Approach     string
	Done         int
	Calls        int
	RateLimited  int // 429s
	MaxPerWindow int // most calls the vendor saw in one of its windows
	Limit        int
	Utilisation  float64 // successful calls per second / the vendor's limit per second
	Took         time.Duration
}

// Run runs the demo, printing progress and the verdict to out.
func Run(ctx context.Context, out io.Writer, o Options) ([]Verdict, error) {
	o.defaults()
	mr, err := embedded.Start("127.0.0.1:0")
	if err != nil {
		return nil, fmt.Errorf("demo: embedded Redis: %w", err)
	}
	defer mr.Close()
	phase := time.Duration(rand.Int64N(int64(o.Window)))
	shapedV := &vendorsim.Mock{Rate: o.Rate, Window: o.Window, Phase: phase}
	naiveV := &vendorsim.Mock{Rate: o.Rate, Window: o.Window, Phase: phase}
	shapedSrv, naiveSrv := httptest.NewServer(shapedV), httptest.NewServer(naiveV)
	defer shapedSrv.Close()
	defer naiveSrv.Close()
	fmt.Fprintf(out, "shaper demo: embedded Redis on %s; two identical mock vendors allowing %d calls per fixed %s window (phase %s, hidden from clients), 429 + Retry-After beyond it\n",
		mr.Addr(), o.Rate, o.Window, phase.Round(time.Millisecond))
	fmt.Fprintf(out, "%d calls each, %d worker replicas each:\n  shaper: one shared release tick in Redis\n  token bucket per worker (burst = rate), reschedule on limit or 429 (asynq's documented recipe)\n\n", o.Calls, o.Workers)

	newClient := func() *redis.Client { return redis.NewClient(&redis.Options{Addr: mr.Addr(), PoolSize: 100}) }
	var clients []*redis.Client
	defer func() {
		for _, c := range clients {
			c.Close()
		}
	}()
	client := func() *redis.Client { c := newClient(); clients = append(clients, c); return c }

	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	quiet := slog.New(slog.NewTextHandler(io.Discard, nil))
	policy := shaper.Policy{Limits: []shaper.Limit{{Rate: o.Rate, Window: o.Window}}}

	// shaper: three workers on vendor "shaped".
	shaped := queue.Vendor{Endpoint: vendorclients.Endpoint{Name: "shaped", BaseURL: shapedSrv.URL}, Policy: policy}
	qc := queue.NewClient(client(), queue.ClientConfig{Vendors: []queue.Vendor{shaped}})
	defer qc.Close()
	calls := make([]queue.Call, o.Calls)
	for i := range calls {
		calls[i] = queue.Call{ID: "shaped-" + strconv.Itoa(i), Method: "POST", Path: "/orders", Body: []byte(`{"demo":true}`)}
	}
	if _, err := qc.EnqueueBatch(ctx, "shaped", calls); err != nil {
		return nil, err
	}
	var wg sync.WaitGroup
	defer wg.Wait()
	defer cancel()
	for range o.Workers {
		w, err := queue.NewWorker(client(), queue.WorkerConfig{Logger: quiet, Vendors: []queue.Vendor{shaped}})
		if err != nil {
			return nil, err
		}
		wg.Go(func() { _ = w.Run(ctx) })
	}

	// The alternative: a token bucket per worker, burst = rate.
	perSecond := float64(o.Rate) / o.Window.Seconds()
	naiveServers, err := recipes.Run(ctx, client, "naive", naiveSrv.URL, o.Calls, o.Workers, recipes.TokenBucket(perSecond, o.Rate))
	if err != nil {
		return nil, err
	}
	defer func() {
		for _, s := range naiveServers {
			s.Shutdown()
		}
	}()

	start := time.Now()
	deadline := start.Add(o.Timeout)
	tick := time.NewTicker(time.Second)
	defer tick.Stop()
	var shapedDone, naiveDone time.Duration
	prev := [2]int{}
	for {
		select {
		case <-ctx.Done():
			return nil, ctx.Err()
		case <-tick.C:
		}
		s, n := shapedV.Summarize(), naiveV.Summarize()
		el := time.Since(start)
		if s.DistinctKeys >= o.Calls && shapedDone == 0 {
			shapedDone = el
		}
		if n.DistinctKeys >= o.Calls && naiveDone == 0 {
			naiveDone = el
		}
		fmt.Fprintf(out, "%5.0fs  shaper: %4d/%d done %3d/s, %4d 429s  |  token bucket: %4d/%d done %3d/s, %4d 429s\n",
			el.Seconds(), s.DistinctKeys, o.Calls, s.DistinctKeys-prev[0], s.RateLimited,
			n.DistinctKeys, o.Calls, n.DistinctKeys-prev[1], n.RateLimited)
		prev = [2]int{s.DistinctKeys, n.DistinctKeys}
		if why := stopWhy(o, el, shapedDone, naiveDone, n); why != "" {
			fmt.Fprintf(out, "\nstopped: %s\n", why)
			break
		}
		if time.Now().After(deadline) {
			fmt.Fprintf(out, "\nstopped: the timeout (%s) passed\n", o.Timeout)
			break
		}
	}
	verdicts := []Verdict{
		verdict("shaper", shapedV, o, shapedDone, time.Since(start)),
		verdict("token bucket per worker", naiveV, o, naiveDone, time.Since(start)),
	}
	fmt.Fprintln(out)
	tw := tabwriter.NewWriter(out, 0, 0, 2, ' ', 0)
	fmt.Fprintln(tw, "APPROACH\tCALLS DONE\tHTTP 429s\tMOST CALLS IN A VENDOR WINDOW\tUTILISATION\tTIME")
	for _, v := range verdicts {
		took := "not done"
		if v.Took > 0 {
			took = v.Took.Round(time.Second).String()
		}
		fmt.Fprintf(tw, "%s\t%d/%d\t%d\t%d (limit %d)\t%.0f%%\t%s\n", v.Approach, v.Done, v.Calls, v.RateLimited, v.MaxPerWindow, v.Limit, 100*v.Utilisation, took)
	}
	tw.Flush()
	return verdicts, nil
}

// stopWhy says why the demo can stop at el, or "" to go on: both
// approaches are done, or shaper is, and the alternative, not done, has
// broken the vendor's limit (its 429s or a window over the limit are the
// verdict) and had Settle more to finish.
func stopWhy(o Options, el, shapedDone, naiveDone time.Duration, naive vendorsim.Summary) string {
	switch {
	case shapedDone > 0 && naiveDone > 0:
		return "both approaches are done"
	case shapedDone > 0 && el-shapedDone >= o.Settle && (naive.RateLimited > 0 || naive.MaxPerWindow > o.Rate):
		return fmt.Sprintf("shaper was done at %s; %s later the token bucket per worker had %d of %d calls done, %d 429s and up to %d calls in a window (limit %d): the verdict is clear",
			shapedDone.Round(time.Second), o.Settle, naive.DistinctKeys, o.Calls, naive.RateLimited, naive.MaxPerWindow, o.Rate)
	}
	return ""
}

func verdict(name string, v *vendorsim.Mock, o Options, took, elapsed time.Duration) Verdict {
	s := v.Summarize()
	var ok []time.Time
	for _, r := range v.Requests() {
		if r.Status < 300 {
			ok = append(ok, r.At)
		}
	}
	util := 0.0
	if len(ok) > 1 {
		sort.Slice(ok, func(i, j int) bool { return ok[i].Before(ok[j]) })
		perSecond := float64(len(ok)-1) / ok[len(ok)-1].Sub(ok[0]).Seconds()
		util = perSecond / (float64(o.Rate) / o.Window.Seconds())
	}
	return Verdict{Approach: name, Done: s.DistinctKeys, Calls: o.Calls, RateLimited: s.RateLimited,
		MaxPerWindow: s.MaxPerWindow, Limit: o.Rate, Utilisation: util, Took: took}
}
