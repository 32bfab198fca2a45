package redistest

import (
	"context"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"
)

// Sentinels is a replicated Redis of a test's own: a master, one replica
// and three sentinels (redis-server --sentinel), all on loopback, stopped
// when the test ends. The sentinels declare the master down after 1 s
// without an answer and promote the replica.
type Sentinels struct {
	// MasterName is the name the sentinels monitor the master under.
	MasterName string
	// Addrs are the sentinels' addresses.
	Addrs []string
	// Master and Replica are the data servers as started; after a
	// failover the Replica is the master.
	Master, Replica *Server
	sentinels       []*exec.Cmd
}

// StartSentinels starts a master, a replica of it and three sentinels
// monitoring it. It needs redis-server on PATH.
func StartSentinels(tb testing.TB) *Sentinels {
	tb.Helper()
	master := start(tb)
	replica := StartReplica(tb, master)
	s := &Sentinels{MasterName: "shaper-test", Master: master, Replica: replica}
	dir := tb.TempDir()
	// Registered before the first start: a failure starting a later
	// sentinel still stops the ones already running.
	tb.Cleanup(func() {
		for _, c := range s.sentinels {
			_ = c.Process.Kill()
			_ = c.Wait()
		}
	})
	for i := range 3 {
		port, err := freePort()
		if err != nil {
			tb.Fatal(err)
		}
		conf := filepath.Join(dir, fmt.Sprintf("sentinel-%d.conf", i))
		body := fmt.Sprintf("port %d\nbind 127.0.0.1\ndir %s\nsentinel monitor %s 127.0.0.1 %d 2\n"+
			"sentinel down-after-milliseconds %s 1000\nsentinel failover-timeout %s 10000\nsentinel parallel-syncs %s 1\n",
			port, dir, s.MasterName, master.port, s.MasterName, s.MasterName, s.MasterName)
		if err := os.WriteFile(conf, []byte(body), 0o600); err != nil {
			tb.Fatal(err)
		}
		cmd := exec.Command("redis-server", conf, "--sentinel", "--loglevel", "warning")
		cmd.SysProcAttr = dieWithParent()
		if err := cmd.Start(); err != nil {
			tb.Fatalf("redistest: start a sentinel: %v", err)
		}
		s.sentinels = append(s.sentinels, cmd)
		s.Addrs = append(s.Addrs, "127.0.0.1:"+strconv.Itoa(port))
	}
	// Ready: the replica is in sync and every sentinel knows both the
	// replica and the other sentinels (or a failover cannot be agreed).
	deadline := time.Now().Add(20 * time.Second)
	for !s.ready() {
		if time.Now().After(deadline) {
			tb.Fatal("redistest: the sentinels did not see the replica and each other within 20 s")
		}
		time.Sleep(100 * time.Millisecond)
	}
	return s
}

func (s *Sentinels) ready() bool {
	ctx := context.Background()
	r := redis.NewClient(&redis.Options{Addr: s.Replica.Addr, MaxRetries: -1})
	defer r.Close()
	info, err := r.Info(ctx, "replication").Result()
	if err != nil || !containsLine(info, "master_link_status:up") {
		return false
	}
	for _, a := range s.Addrs {
		c := redis.NewSentinelClient(&redis.Options{Addr: a, MaxRetries: -1})
		m, err := c.Master(ctx, s.MasterName).Result()
		c.Close()
		if err != nil || m["num-slaves"] != "1" || m["num-other-sentinels"] != "2" {
			return false
		}
	}
	return true
}

// MasterAddr asks a sentinel for the current master's address.
func (s *Sentinels) MasterAddr() (string, error) {
	var last error
	for _, a := range s.Addrs {
		c := redis.NewSentinelClient(&redis.Options{Addr: a, MaxRetries: -1})
		addr, err := c.GetMasterAddrByName(context.Background(), s.MasterName).Result()
		c.Close()
		if err == nil && len(addr) == 2 {
			return addr[0] + ":" + addr[1], nil
		}
		last = err
	}
	return "", fmt.Errorf("redistest: no sentinel names a master: %v", last)
}

// WaitFailover waits until the sentinels name the replica as the master
// and it answers as one, and returns when that was seen.
func (s *Sentinels) WaitFailover(tb testing.TB, d time.Duration) time.Time {
	tb.Helper()
	deadline := time.Now().Add(d)
	r := redis.NewClient(&redis.Options{Addr: s.Replica.Addr, MaxRetries: -1})
	defer r.Close()
	for {
		addr, err := s.MasterAddr()
		if err == nil && addr == s.Replica.Addr {
			if info, err := r.Info(context.Background(), "replication").Result(); err == nil && containsLine(info, "role:master") {
				return time.Now()
			}
		}
		if time.Now().After(deadline) {
			tb.Fatalf("redistest: no failover to %s within %s (sentinels name %q: %v)", s.Replica.Addr, d, addr, err)
		}
		time.Sleep(50 * time.Millisecond)
	}
}

// containsLine reports whether an INFO reply has line (its lines end in
// CRLF).
func containsLine(info, line string) bool {
	return strings.Contains("\n"+info, "\n"+line+"\r\n")
}

// StartReplica starts a redis-server replicating master, for this test
// only, and waits until it is in sync.
func StartReplica(tb testing.TB, master *Server) *Server {
	tb.Helper()
	r := start(tb, "--replicaof", "127.0.0.1", strconv.Itoa(master.port))
	c := redis.NewClient(&redis.Options{Addr: r.Addr, MaxRetries: -1})
	defer c.Close()
	deadline := time.Now().Add(10 * time.Second)
	for {
		info, err := c.Info(context.Background(), "replication").Result()
		if err == nil && containsLine(info, "master_link_status:up") {
			return r
		}
		if time.Now().After(deadline) {
			tb.Fatalf("redistest: the replica %s did not sync with %s within 10 s", r.Addr, master.Addr)
		}
		time.Sleep(20 * time.Millisecond)
	}
}
