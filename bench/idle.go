package main

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"os"
	"os/exec"
	"runtime"
	"sort"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"time"

	"github.com/hibiken/asynq"
	"github.com/redis/go-redis/v9"

	"github.com/shaper-dev/shaper/queue"
	"github.com/shaper-dev/shaper/shaper"
	"github.com/shaper-dev/shaper/vendorclients"
)

// idleWarmup is how long a scenario runs before its window opens: servers
// start, register and settle.
const idleWarmup = 5 * time.Second

// idleResult is what one idle scenario cost during its window.
type idleResult struct {
	Scenario   string
	CommandsPS float64            // Redis commands per second, all clients
	PerCommand map[string]float64 // per command, per second (INFO commandstats)
	Goroutines int                // in the bench process, over its baseline
	CPUCores   float64            // bench process, user+sys seconds per second
	RedisCores float64            // redis-server, user+sys seconds per second
	HeapMiB    float64            // HeapInuse over the baseline, after a GC
	RedisConns int                // clients connected to Redis
	StartedIn  time.Duration      // how long start took
	StoppedIn  time.Duration      // how long stop took
	Err        error
}

// idleScenario starts replicas serving the vendors' queues with nothing
// queued, and returns the function that stops them and waits.
type idleScenario struct {
	name  string
	start func(addr string, vendors []string, replicas int) (stop func(), err error)
}

var idleScenarios = []idleScenario{
	{name: "plain asynq: %d asynq.Server, %d queues each", start: startIdleAsynq},
	{name: "shaper: %d queue.Worker, %d vendors at 10/s each", start: startIdleShaper},
}

// idle measures what serving vendors costs when nothing is queued: plain
// asynq against shaper, on a redis-server of the bench's own so that
// nothing else's commands are counted, one scenario after the other.
func idle(vendors, replicas int, window time.Duration) (string, error) {
	srv, err := startRedis()
	if err != nil {
		return "", err
	}
	defer srv.stop()
	rdb := redis.NewClient(&redis.Options{Addr: srv.addr})
	defer rdb.Close()
	names := make([]string, vendors)
	for i := range names {
		names[i] = fmt.Sprintf("v%03d", i)
	}
	var results []idleResult
	for _, s := range idleScenarios {
		name := fmt.Sprintf(s.name, replicas, vendors)
		res := measureIdle(rdb, srv.addr, name, s, names, replicas, window)
		results = append(results, res)
		if res.Err != nil {
			return "", fmt.Errorf("bench: idle scenario %q: %w", name, res.Err)
		}
		if err := rdb.FlushAll(context.Background()).Err(); err != nil {
			return "", fmt.Errorf("bench: flush Redis between scenarios: %w", err)
		}
	}
	return idleTable(results, srv.version, vendors, replicas, window), nil
}

// measureIdle runs one scenario: baseline, start, warm-up, window, stop.
func measureIdle(rdb *redis.Client, addr, name string, s idleScenario, vendors []string, replicas int, window time.Duration) (res idleResult) {
	ctx := context.Background()
	res.Scenario = name
	runtime.GC()
	g0 := runtime.NumGoroutine()
	h0 := heapInuse()
	t0 := time.Now()
	stop, err := s.start(addr, vendors, replicas)
	if err != nil {
		res.Err = err
		return res
	}
	res.StartedIn = time.Since(t0)
	defer func() {
		t := time.Now()
		stop()
		res.StoppedIn = time.Since(t)
		fmt.Fprintf(os.Stderr, "bench: idle %s: started in %s, stopped in %s\n", name, res.StartedIn.Round(time.Millisecond), res.StoppedIn.Round(time.Millisecond))
	}()
	time.Sleep(idleWarmup)

	before, err := redisSample(ctx, rdb)
	if err != nil {
		res.Err = err
		return res
	}
	cpu0, wall0 := processCPU(), time.Now()
	time.Sleep(window)
	cpu1, wall1 := processCPU(), time.Now()
	after, err := redisSample(ctx, rdb)
	if err != nil {
		res.Err = err
		return res
	}
	secs := wall1.Sub(wall0).Seconds()
	rsecs := after.at.Sub(before.at).Seconds()
	res.CommandsPS = float64(after.total-before.total) / rsecs
	res.PerCommand = map[string]float64{}
	for cmd, n := range after.calls {
		if d := n - before.calls[cmd]; d > 0 {
			res.PerCommand[cmd] = float64(d) / rsecs
		}
	}
	res.CPUCores = (cpu1 - cpu0).Seconds() / secs
	res.RedisCores = (after.cpu - before.cpu) / rsecs
	res.RedisConns = after.clients
	res.Goroutines = runtime.NumGoroutine() - g0
	runtime.GC()
	res.HeapMiB = float64(int64(heapInuse())-int64(h0)) / (1 << 20)
	return res
}

// startIdleAsynq runs plain asynq: per replica a go-redis client and an
// asynq.Server with the default config except Queues (every vendor's
// queue, weight 1) and a no-op handler.
func startIdleAsynq(addr string, vendors []string, replicas int) (func(), error) {
	queues := make(map[string]int, len(vendors))
	for _, v := range vendors {
		queues[queue.QueueName(v)] = 1
	}
	var clients []*redis.Client
	var servers []*asynq.Server
	stop := func() {
		var wg sync.WaitGroup
		for _, s := range servers {
			wg.Go(s.Shutdown)
		}
		wg.Wait()
		for _, c := range clients {
			c.Close()
		}
	}
	noop := asynq.HandlerFunc(func(context.Context, *asynq.Task) error { return nil })
	for range replicas {
		c := redis.NewClient(&redis.Options{Addr: addr})
		clients = append(clients, c)
		// LogLevel only keeps the start and stop lines off the output;
		// it sends nothing to Redis.
		s := asynq.NewServerFromRedisClient(c, asynq.Config{Queues: queues, LogLevel: asynq.WarnLevel})
		if err := s.Start(noop); err != nil {
			stop()
			return nil, err
		}
		servers = append(servers, s)
	}
	return stop, nil
}

// startIdleShaper runs shaper: per replica a go-redis client and a
// queue.Worker with every vendor at 10 calls per second, through the
// public API only.
func startIdleShaper(addr string, vendors []string, replicas int) (func(), error) {
	vs := make([]queue.Vendor, len(vendors))
	for i, name := range vendors {
		vs[i] = queue.Vendor{
			Endpoint: vendorclients.Endpoint{Name: name, BaseURL: "http://127.0.0.1:1"},
			Policy:   shaper.Policy{Limits: []shaper.Limit{{Rate: 10, Window: time.Second}}},
		}
	}
	quiet := slog.New(slog.NewTextHandler(io.Discard, nil))
	ctx, cancel := context.WithCancel(context.Background())
	var clients []*redis.Client
	var wg sync.WaitGroup
	errs := make(chan error, replicas)
	stop := func() {
		cancel()
		wg.Wait()
		for _, c := range clients {
			c.Close()
		}
	}
	for range replicas {
		c := redis.NewClient(&redis.Options{Addr: addr})
		clients = append(clients, c)
		w, err := queue.NewWorker(c, queue.WorkerConfig{Vendors: vs, Logger: quiet})
		if err != nil {
			stop()
			return nil, err
		}
		wg.Go(func() {
			if err := w.Run(ctx); err != nil {
				errs <- err
			}
		})
	}
	// A worker that fails at start returns at once: give it a moment to.
	select {
	case err := <-errs:
		stop()
		return nil, err
	case <-time.After(500 * time.Millisecond):
	}
	return stop, nil
}

// redisStats is one reading of INFO.
type redisStats struct {
	at      time.Time
	total   int64            // total_commands_processed
	calls   map[string]int64 // per command, from commandstats
	cpu     float64          // used_cpu_user + used_cpu_sys, seconds
	clients int              // connected_clients
}

// redisSample reads the counters the idle bench compares. Its own INFO
// calls count too: one or two commands per window.
func redisSample(ctx context.Context, rdb *redis.Client) (redisStats, error) {
	s := redisStats{calls: map[string]int64{}}
	txt, err := rdb.Info(ctx, "stats", "commandstats", "cpu", "clients").Result()
	if err != nil {
		return s, fmt.Errorf("bench: INFO: %w", err)
	}
	s.at = time.Now()
	sc := bufio.NewScanner(strings.NewReader(txt))
	for sc.Scan() {
		key, val, ok := strings.Cut(strings.TrimSpace(sc.Text()), ":")
		if !ok {
			continue
		}
		switch {
		case key == "total_commands_processed":
			s.total, _ = strconv.ParseInt(val, 10, 64)
		case key == "connected_clients":
			s.clients, _ = strconv.Atoi(val)
		case key == "used_cpu_user" || key == "used_cpu_sys":
			f, _ := strconv.ParseFloat(val, 64)
			s.cpu += f
		case strings.HasPrefix(key, "cmdstat_"):
			// cmdstat_evalsha:calls=12,usec=...
			calls, _, _ := strings.Cut(strings.TrimPrefix(val, "calls="), ",")
			s.calls[strings.TrimPrefix(key, "cmdstat_")], _ = strconv.ParseInt(calls, 10, 64)
		}
	}
	if s.total == 0 {
		return s, errors.New("bench: INFO stats has no total_commands_processed")
	}
	return s, nil
}

// processCPU is the user+system CPU time the bench process has used.
func processCPU() time.Duration {
	var ru syscall.Rusage
	if err := syscall.Getrusage(syscall.RUSAGE_SELF, &ru); err != nil {
		return 0
	}
	return time.Duration(ru.Utime.Nano() + ru.Stime.Nano())
}

func heapInuse() uint64 {
	var m runtime.MemStats
	runtime.ReadMemStats(&m)
	return m.HeapInuse
}

// redisServer is the bench's own redis-server on a free loopback port.
type redisServer struct {
	addr    string
	version string
	cmd     *exec.Cmd
}

func startRedis() (*redisServer, error) {
	if _, err := exec.LookPath("redis-server"); err != nil {
		return nil, fmt.Errorf("bench: the idle bench starts a redis-server of its own and needs it on PATH (apt-get install redis-server): %w", err)
	}
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return nil, err
	}
	port := l.Addr().(*net.TCPAddr).Port
	_ = l.Close()
	s := &redisServer{addr: "127.0.0.1:" + strconv.Itoa(port)}
	s.cmd = exec.Command("redis-server", "--port", strconv.Itoa(port), "--bind", "127.0.0.1",
		"--save", "", "--appendonly", "no", "--daemonize", "no", "--loglevel", "warning")
	if err := s.cmd.Start(); err != nil {
		return nil, fmt.Errorf("bench: start redis-server: %w", err)
	}
	c := redis.NewClient(&redis.Options{Addr: s.addr, MaxRetries: -1})
	defer c.Close()
	ctx := context.Background()
	for deadline := time.Now().Add(10 * time.Second); ; {
		info, err := c.Info(ctx, "server").Result()
		if err == nil {
			for _, line := range strings.Split(info, "\n") {
				if v, ok := strings.CutPrefix(strings.TrimSpace(line), "redis_version:"); ok {
					s.version = v
				}
			}
			return s, nil
		}
		if time.Now().After(deadline) {
			s.stop()
			return nil, fmt.Errorf("bench: redis-server on %s did not answer: %w", s.addr, err)
		}
		time.Sleep(20 * time.Millisecond)
	}
}

func (s *redisServer) stop() {
	_ = s.cmd.Process.Kill()
	_ = s.cmd.Wait()
}

// idleTable renders the idle results as markdown.
func idleTable(results []idleResult, version string, vendors, replicas int, window time.Duration) string {
	var b strings.Builder
	fmt.Fprintf(&b, "# Idle cost: %d vendors, %d replicas, nothing queued\n\n", vendors, replicas)
	fmt.Fprintf(&b, "`go run ./bench -idle -out docs`: a redis-server %s of the bench's own on loopback, every replica in the bench process "+
		"(%d CPUs, GOMAXPROCS %d, %s), %s warm-up, then a %s window. Redis commands are counted the way Redis counts them "+
		"(`INFO stats` total_commands_processed): the commands a Lua script runs count too. "+
		"Goroutines and heap are the bench process's, over its baseline before the scenario started.\n\n",
		version, runtime.NumCPU(), runtime.GOMAXPROCS(0), runtime.Version(), idleWarmup, window)
	b.WriteString("| scenario | Redis commands/s | ratio to plain asynq | goroutines | CPU cores (bench process) | CPU cores (redis-server) | heap MiB | Redis clients | top commands /s |\n")
	b.WriteString("|---|---|---|---|---|---|---|---|---|\n")
	plain := results[0].CommandsPS
	for _, r := range results {
		fmt.Fprintf(&b, "| %s | %s | %.2f | %d | %.3f | %.3f | %.1f | %d | %s |\n",
			r.Scenario, thousands(r.CommandsPS), r.CommandsPS/max(plain, 1), r.Goroutines, r.CPUCores, r.RedisCores,
			r.HeapMiB, r.RedisConns, topCommands(r.PerCommand, 5))
	}
	if len(results) == 2 {
		ratio := results[1].CommandsPS / max(plain, 1)
		verdict := "meets"
		if ratio > 1.2 {
			verdict = "misses"
		}
		fmt.Fprintf(&b, "\nThe bound is at most 1.2x plain asynq's Redis commands/s: shaper is at %.2fx, so it %s it.\n", ratio, verdict)
	}
	return b.String()
}

// topCommands lists the n commands called most, per second.
func topCommands(per map[string]float64, n int) string {
	type kv struct {
		cmd string
		ps  float64
	}
	var all []kv
	for c, ps := range per {
		all = append(all, kv{c, ps})
	}
	sort.Slice(all, func(i, j int) bool {
		if all[i].ps != all[j].ps {
			return all[i].ps > all[j].ps
		}
		return all[i].cmd < all[j].cmd
	})
	var parts []string
	for _, e := range all[:min(n, len(all))] {
		parts = append(parts, fmt.Sprintf("%s %s", e.cmd, thousands(e.ps)))
	}
	return strings.Join(parts, ", ")
}

// thousands formats a rate with a thousands separator, no decimals above 10.
func thousands(f float64) string {
	if f < 10 {
		return strconv.FormatFloat(f, 'f', 1, 64)
	}
	s := strconv.FormatInt(int64(f+0.5), 10)
	for i := len(s) - 3; i > 0; i -= 3 {
		s = s[:i] + "," + s[i:]
	}
	return s
}
