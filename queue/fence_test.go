package queue

import (
	"context"
	"io"
	"net"
	"sort"
	"sync"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/shaper-dev/shaper/internal/vendorsim"
	"github.com/shaper-dev/shaper/shaper"
)

// cutProxy is a TCP proxy to Redis that a test can cut: its connections
// are closed and new ones refused until it is restored, as a network
// partition between one worker and Redis would.
type cutProxy struct {
	ln     net.Listener
	target string

	mu    sync.Mutex
	cut   bool
	conns map[net.Conn]bool
	wg    sync.WaitGroup
}

func startCutProxy(t *testing.T, target string) *cutProxy {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	p := &cutProxy{ln: ln, target: target, conns: map[net.Conn]bool{}}
	p.wg.Add(1)
	go p.serve()
	t.Cleanup(func() {
		ln.Close()
		p.Cut()
		p.wg.Wait()
	})
	return p
}

func (p *cutProxy) Addr() string { return p.ln.Addr().String() }

func (p *cutProxy) serve() {
	defer p.wg.Done()
	for {
		c, err := p.ln.Accept()
		if err != nil {
			return
		}
		p.mu.Lock()
		if p.cut {
			p.mu.Unlock()
			c.Close()
			continue
		}
		up, err := net.Dial("tcp", p.target)
		if err != nil {
			p.mu.Unlock()
			c.Close()
			continue
		}
		p.conns[c], p.conns[up] = true, true
		p.mu.Unlock()
		p.wg.Add(2)
		pipe := func(dst, src net.Conn) {
			defer p.wg.Done()
			_, _ = io.Copy(dst, src)
			dst.Close()
			src.Close()
		}
		go pipe(up, c)
		go pipe(c, up)
	}
}

// Cut closes every connection and refuses new ones until Restore.
func (p *cutProxy) Cut() {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.cut = true
	for c := range p.conns {
		c.Close()
		delete(p.conns, c)
	}
}

func (p *cutProxy) Restore() {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.cut = false
}

// TestFencedWorkerSendsEachCallOnce: two workers drain a backlog; one
// is cut off from Redis for 10 s (its connections refused, the vendor
// still reachable) while it holds granted calls. The other gives the
// silent one's unstarted calls back after deadAfter and sends them; the
// cut-off one starts none of them (the fence) and, once Redis answers,
// records nothing over the runs that took them (settle). Every call
// reaches the vendor exactly once, counted by Idempotency-Key, within
// the limit.
func TestFencedWorkerSendsEachCallOnce(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	vend := &vendorsim.Mock{Rate: 50, Window: time.Second, Phase: randomPhase(time.Second)}
	name := e.vendor("fence", shaper.Policy{Limits: []shaper.Limit{{Rate: 50, Window: time.Second}}, Horizon: 3 * time.Second}, 0, vend)
	c := e.newClient()
	const n = 750
	enqueueN(t, c, name, n)
	proxy := startCutProxy(t, e.addr)
	cutOff := redis.NewClient(&redis.Options{Addr: proxy.Addr(), PoolSize: 300, MaxRetries: -1})
	t.Cleanup(func() { _ = cutOff.Close() })
	e.startWorkerOn(cutOff, nil)
	e.startWorker(nil)
	waitFor(t, time.Minute, "the first calls", func() bool { return vend.Summarize().DistinctKeys >= 150 })
	proxy.Cut()
	cutAt := time.Now()
	time.Sleep(10 * time.Second)
	proxy.Restore()
	waitFor(t, 3*time.Minute, "every call", func() bool { return vend.Summarize().DistinctKeys == n })
	// A call sent twice would come from a run that took it after the
	// first: wait until nothing is left in the vendor's queues.
	rdb := e.rdb()
	waitFor(t, 2*time.Minute, "the vendor's queues to empty", func() bool {
		qs, err := readQueueStats(context.Background(), rdb, name, queueCounts)
		return err == nil && qs.Pending+qs.Active+qs.Retry+qs.Scheduled == 0
	})
	time.Sleep(2 * time.Second)
	s := vend.Summarize()
	sent := map[string]int{}
	for _, r := range vend.Requests() {
		sent[r.Key]++
	}
	var twice []string
	for k, m := range sent {
		if m > 1 {
			twice = append(twice, k)
		}
	}
	sort.Strings(twice)
	t.Logf("%d calls, %d requests, %d distinct keys, cut at %s for 10 s; most in one vendor window %d (limit 50)",
		n, s.Requests, s.DistinctKeys, cutAt.Format("15:04:05.000"), s.MaxPerWindow)
	if len(twice) > 0 || s.Requests != n {
		t.Errorf("%d calls reached the vendor more than once (%v); %d requests for %d calls", len(twice), twice, s.Requests, n)
	}
	if s.MaxPerWindow > 50 {
		t.Errorf("%d calls in one vendor window, limit 50", s.MaxPerWindow)
	}
}
