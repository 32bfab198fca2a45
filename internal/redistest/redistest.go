// Package redistest gives tests a real Redis: the server at REDIS_ADDR when
// it is set, else a redis-server started on a free port, else (and it says
// so) an in-process miniredis. Fault tests start servers of their own that
// they can kill and restart.
package redistest

import (
	"context"
	"crypto/rand"
	"crypto/tls"
	"encoding/hex"
	"fmt"
	"net"
	"os"
	"os/exec"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"
	"github.com/shaper-dev/shaper/internal/embedded"
)

var (
	sharedOnce sync.Once
	sharedAddr string
	sharedKind string
	sharedErr  error
	sharedStop func()
)

// Addr returns the address of the Redis shared by a test binary's tests.
func Addr(tb testing.TB) string {
	tb.Helper()
	if err := setup(); err != nil {
		tb.Fatalf("redistest: no Redis for the tests: %v", err)
	}
	return sharedAddr
}

// setup finds or starts the shared Redis, once per test binary.
func setup() error {
	sharedOnce.Do(func() {
		if addr := os.Getenv("REDIS_ADDR"); addr != "" {
			sharedAddr, sharedKind = addr, "REDIS_ADDR"
			return
		}
		if _, err := exec.LookPath("redis-server"); err == nil {
			var s *Server
			s, sharedErr = startServer()
			if sharedErr == nil {
				sharedAddr, sharedKind, sharedStop = s.Addr, "redis-server (spawned)", s.stop
			}
			return
		}
		m, err := embedded.Start("127.0.0.1:0")
		if err != nil {
			sharedErr = err
			return
		}
		sharedAddr, sharedKind, sharedStop = m.Addr(), "embedded miniredis (set REDIS_ADDR or install redis-server for a real one)", m.Close
		fmt.Fprintln(os.Stderr, "redistest: no REDIS_ADDR and no redis-server on PATH: falling back to", sharedKind)
	})
	return sharedErr
}

// Long marks a long scenario (minutes of traffic, a fault run, waiting
// out asynq's lease): -short skips it, so `make test` stays fast, and
// `make test-long` runs it. Call it first in every TestLong... test.
func Long(tb testing.TB) {
	tb.Helper()
	if testing.Short() {
		tb.Skip("long scenario: make test-long runs it")
	}
}

// Kind says which Redis Addr returned.
func Kind() string { return sharedKind }

// Main runs a package's tests and stops the Redis it started, if any. Call
// it from TestMain: os.Exit(redistest.Main(m)). It sets REDIS_ADDR to the
// shared Redis, so that Example functions (which take no *testing.T) can
// read it.
func Main(m *testing.M) int {
	if err := setup(); err != nil {
		fmt.Fprintln(os.Stderr, "redistest: no Redis for the tests:", err)
		return 1
	}
	os.Setenv("REDIS_ADDR", sharedAddr)
	code := m.Run()
	if sharedStop != nil {
		sharedStop()
	}
	return code
}

// Client returns a client of the shared Redis, closed when the test ends.
func Client(tb testing.TB) *redis.Client {
	tb.Helper()
	c := redis.NewClient(&redis.Options{Addr: Addr(tb)})
	tb.Cleanup(func() { _ = c.Close() })
	if err := c.Ping(context.Background()).Err(); err != nil {
		tb.Fatalf("redistest: ping %s: %v", Addr(tb), err)
	}
	return c
}

// Prefix returns a random key prefix, so that tests share one Redis
// without seeing each other's keys.
func Prefix(tb testing.TB) string {
	var b [6]byte
	_, _ = rand.Read(b[:])
	return "test-" + hex.EncodeToString(b[:])
}

// Server is a redis-server of a test's own, which it may kill and restart.
type Server struct {
	Addr string
	port int
	args []string    // extra redis-server arguments
	tls  *tls.Config // for a server that speaks TLS only (StartTLS)
	mu   sync.Mutex
	cmd  *exec.Cmd
}

// Start starts a redis-server on a free port for this test only, with
// args added to its command line; it is stopped when the test ends. It
// needs redis-server on PATH.
func Start(tb testing.TB, args ...string) *Server { return start(tb, args...) }

// StartDurable is Start with an append-only file in a directory of the
// test's, fsynced every write: a restart after Kill keeps every
// acknowledged write.
func StartDurable(tb testing.TB) *Server {
	return start(tb, "--appendonly", "yes", "--appendfsync", "always", "--dir", tb.TempDir())
}

func start(tb testing.TB, args ...string) *Server {
	tb.Helper()
	ownServer(tb)
	if _, err := exec.LookPath("redis-server"); err != nil {
		tb.Fatalf("redistest: this test kills and restarts its own Redis and needs redis-server on PATH (apt-get install redis-server): %v", err)
	}
	// Its files (the snapshot a master writes for a replica's sync) go in
	// a directory of the test's; a --dir in args comes later and wins.
	s, err := startServer(append([]string{"--dir", tb.TempDir()}, args...)...)
	if err != nil {
		tb.Fatal(err)
	}
	tb.Cleanup(s.stop)
	return s
}

// OwnPrefix starts the name of every test, other than the long scenarios
// and benchmarks, that starts a redis-server of its own: make test, which
// needs Go alone, leaves them out, and make test-redis runs them.
const OwnPrefix = "TestOwnRedis"

// ownServer fails a test that starts a redis-server of its own but would
// run in make test: one not named OwnPrefix..., TestLong... or
// Benchmark....
func ownServer(tb testing.TB) {
	tb.Helper()
	name := tb.Name()
	for _, p := range []string{OwnPrefix, "TestLong", "Benchmark"} {
		if strings.HasPrefix(name, p) {
			return
		}
	}
	tb.Fatalf("redistest: %s starts a redis-server of its own, which make test (Go alone) must not need: name it %s... so that make test-redis runs it instead", name, OwnPrefix)
}

// freePort returns a loopback port that was free a moment ago.
// taken holds the ports this process's servers were given: a server
// keeps its port for life (Restart binds it again after a Kill), so no
// other server of the process may be handed it while it is down.
var taken sync.Map

func freePort() (int, error) {
	for range 100 {
		l, err := net.Listen("tcp", "127.0.0.1:0")
		if err != nil {
			return 0, err
		}
		port := l.Addr().(*net.TCPAddr).Port
		l.Close()
		if _, dup := taken.LoadOrStore(port, true); !dup {
			return port, nil
		}
	}
	return 0, fmt.Errorf("redistest: no free port not already given to a server")
}

func startServer(args ...string) (*Server, error) {
	port, err := freePort()
	if err != nil {
		return nil, err
	}
	s := &Server{Addr: "127.0.0.1:" + strconv.Itoa(port), port: port, args: args}
	return s, s.Restart()
}

// Kill stops the server at once with SIGKILL; its data is lost.
func (s *Server) Kill() {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.cmd != nil {
		_ = s.cmd.Process.Kill()
		_ = s.cmd.Wait()
		s.cmd = nil
	}
}

func (s *Server) stop() { s.Kill() }

// Freeze stops the server answering (SIGSTOP) while it keeps its port:
// a client's commands time out, as with a server that hangs or a network
// that drops packets. A killed server's port can be taken at once by
// another test's new server (ports are picked free, then bound), so a
// test that asserts "Redis is unreachable" freezes rather than kills.
// The server is killed when the test ends, frozen or not.
func (s *Server) Freeze() error {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.cmd == nil {
		return fmt.Errorf("redistest: Freeze: the server on %s is not running", s.Addr)
	}
	return s.cmd.Process.Signal(syscall.SIGSTOP)
}

// Restart starts the server again on the same port — empty, or with its
// append-only file for StartDurable — and waits until it answers.
func (s *Server) Restart() error {
	s.mu.Lock()
	defer s.mu.Unlock()
	args := []string{"--port", strconv.Itoa(s.port), "--bind", "127.0.0.1",
		"--save", "", "--appendonly", "no", "--daemonize", "no", "--loglevel", "warning"}
	args = append(args, s.args...)
	if s.tls != nil {
		args = append(args, "--port", "0", "--tls-port", strconv.Itoa(s.port))
	}
	cmd := exec.Command("redis-server", args...)
	cmd.SysProcAttr = dieWithParent() // a test binary killed mid-run leaves no server behind
	if err := cmd.Start(); err != nil {
		return fmt.Errorf("redistest: start redis-server: %w", err)
	}
	s.cmd = cmd
	c := redis.NewClient(&redis.Options{Addr: s.Addr, MaxRetries: -1, TLSConfig: s.tls})
	defer c.Close()
	deadline := time.Now().Add(10 * time.Second)
	for {
		if err := c.Ping(context.Background()).Err(); err == nil {
			return nil
		} else if time.Now().After(deadline) {
			_ = cmd.Process.Kill() // a server that never answered is not left behind
			_ = cmd.Wait()
			s.cmd = nil
			return fmt.Errorf("redistest: redis-server on %s did not answer: %w", s.Addr, err)
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// StartCluster starts a Redis Cluster of n masters (no replicas) on free
// ports, each a redis-server of the test's own, and returns their
// addresses once every node reports the cluster ok. The servers stop when
// the test ends.
func StartCluster(tb testing.TB, n int) []string {
	tb.Helper()
	ctx := context.Background()
	var addrs []string
	var nodes []*redis.Client
	for range n {
		s := Start(tb, "--cluster-enabled", "yes", "--dir", tb.TempDir(), "--cluster-node-timeout", "2000")
		c := redis.NewClient(&redis.Options{Addr: s.Addr})
		tb.Cleanup(func() { _ = c.Close() })
		addrs, nodes = append(addrs, s.Addr), append(nodes, c)
	}
	const slots = 16384
	for i, c := range nodes {
		lo, hi := i*slots/n, (i+1)*slots/n-1
		if err := c.Do(ctx, "CLUSTER", "ADDSLOTSRANGE", lo, hi).Err(); err != nil {
			tb.Fatalf("redistest: cluster slots %d-%d on %s: %v", lo, hi, addrs[i], err)
		}
		if i > 0 {
			host, port, _ := net.SplitHostPort(addrs[i])
			if err := nodes[0].ClusterMeet(ctx, host, port).Err(); err != nil {
				tb.Fatalf("redistest: cluster meet %s: %v", addrs[i], err)
			}
		}
	}
	deadline := time.Now().Add(20 * time.Second)
	for _, c := range nodes {
		for {
			info, err := c.ClusterInfo(ctx).Result()
			if err == nil && strings.Contains(info, "cluster_state:ok") && strings.Contains(info, fmt.Sprintf("cluster_known_nodes:%d", n)) {
				break
			}
			if time.Now().After(deadline) {
				tb.Fatalf("redistest: the cluster of %v is not ok after 20s: %v\n%s", addrs, err, info)
			}
			time.Sleep(50 * time.Millisecond)
		}
	}
	return addrs
}
