package shaper

import (
	"context"
	"net"
	"runtime"
	"sync"
	"sync/atomic"
	"time"
	"weak"

	"github.com/redis/go-redis/v9"

	"github.com/shaper-dev/shaper/internal/redisonce"
)

// The gate must tell when the Redis server behind a bucket is not the one
// that granted its last ticks (a replica promoted by a failover, a
// restart from a snapshot): such a copy may lack those ticks, and its
// state counts as lost. A server is named by its run_id (INFO server, new
// for every server process). Asking INFO on every grant cost more Redis
// time than the rest of a grant, so the gate asks once and passes the
// answer to the scripts, and asks again when the answer may have changed:
//
//   - a new connection was dialed by the gate's client (a failover or a
//     restart always means new connections: the gate counts dials with a
//     go-redis dial hook, one per client whatever the gates on it);
//   - a grant came back over a connection dialed after its arguments were
//     built (the grant is given up and asked again);
//   - serverCheck passed since the last answer (a proxy that keeps client
//     connections across a failover is seen within it).
//
// Where the gate cannot count dials (a client other than *redis.Client
// and *redis.ClusterClient), every grant asks INFO, as the full reserve
// script always did.

// serverCheck is how long a server's run_id is trusted without a dial.
const serverCheck = time.Second

// maxServers bounds the run_ids a gate keeps (one per group: on Redis
// Cluster groups live on different servers).
const maxServers = 4096

// noServer is the run_id the scripts report where INFO is not allowed:
// only missing states are detected there.
const noServer = "-"

// servers is a gate's knowledge of the servers its groups live on.
type servers struct {
	hooked bool           // dials are counted
	dials  *atomic.Uint64 // connections dialed by the gate's client (by every gate on it)

	mu  sync.Mutex
	ids map[string]serverID // by group
}

// serverID is a group's server as last seen: its run_id, the dial count
// when it was asked and the local time of the answer.
type serverID struct {
	id    string
	dials uint64
	at    time.Time
}

// dialCounts holds the dial count of each client a gate was made on, so
// that the gates of one client share one hook: a hook added per gate
// stayed on the client for good, and a page or a program that makes a
// gate per config reload piled them up. It is process-wide because the
// hook is (it lives on a client every gate of the process may share), and
// weak: it holds no client, and an entry goes once its client is
// collected. Keys are weak.Pointers to *redis.Client or
// *redis.ClusterClient; values *dialCount. A cluster's node clients are
// keyed too, with the cluster's count, so that each node gets one hook.
var dialCounts sync.Map

// dialCount is the dial count of one client: one hook adds to it.
type dialCount struct {
	n     atomic.Uint64
	setup sync.Once // the client's hook (or a cluster's OnNewNode), added once
}

// dialCountOf returns c's dial count, made (with a cleanup that drops it
// when c is collected) on first use.
func dialCountOf[T any](c *T) *dialCount {
	key := weak.Make(c)
	if v, ok := dialCounts.Load(key); ok {
		return v.(*dialCount)
	}
	v, loaded := dialCounts.LoadOrStore(key, &dialCount{})
	if !loaded {
		runtime.AddCleanup(c, func(k weak.Pointer[T]) { dialCounts.Delete(k) }, key)
	}
	return v.(*dialCount)
}

// hookNode adds d's hook to a node client of a cluster unless it has
// one (a node is keyed with the cluster's count).
func hookNode(n *redis.Client, d *dialCount) {
	key := weak.Make(n)
	if _, loaded := dialCounts.LoadOrStore(key, d); loaded {
		return
	}
	runtime.AddCleanup(n, func(k weak.Pointer[redis.Client]) { dialCounts.Delete(k) }, key)
	n.AddHook(dialCounter{n: &d.n})
}

// watchDials counts the connections rdb dials, where the client type
// allows it, with one hook per client whatever the number of gates on it.
func (s *servers) watchDials(rdb redis.UniversalClient) {
	s.ids = map[string]serverID{}
	s.dials = new(atomic.Uint64) // not counted: known always asks
	switch c := rdb.(type) {
	case *redis.Client:
		d := dialCountOf(c)
		d.setup.Do(func() { c.AddHook(dialCounter{n: &d.n}) })
		s.dials, s.hooked = &d.n, true
	case *redis.ClusterClient:
		// Node clients made from now on, then those that exist (each
		// gate tries: a first try may find the cluster unreachable).
		d := dialCountOf(c)
		d.setup.Do(func() { c.OnNewNode(func(n *redis.Client) { hookNode(n, d) }) })
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		defer cancel()
		add := func(_ context.Context, n *redis.Client) error { hookNode(n, d); return nil }
		s.dials = &d.n
		s.hooked = c.ForEachMaster(ctx, add) == nil && c.ForEachSlave(ctx, add) == nil
	}
}

// known returns the run_id to pass the scripts for group ("": ask INFO)
// and the dial count it stands for.
func (s *servers) known(group string, now time.Time) (string, uint64) {
	d := s.dials.Load()
	if !s.hooked {
		return "", d
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	id, ok := s.ids[group]
	if !ok || id.dials != d || now.Sub(id.at) > serverCheck || now.Before(id.at) {
		return "", d
	}
	return id.id, d
}

// learn records the run_id a script read for group with dial count d, as
// long as no connection was dialed since.
func (s *servers) learn(group, id string, d uint64, now time.Time) {
	if !s.hooked || id == "" || s.dials.Load() != d {
		return
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	if len(s.ids) >= maxServers {
		clear(s.ids)
	}
	s.ids[group] = serverID{id: id, dials: d, at: now}
}

// checkScript reads the run_id of the server that holds a group's keys,
// with a write (a short-lived key), so that a replica, which refuses
// writes, cannot answer for a primary.
//
// KEYS[1] the group's check key. Returns the run_id (noServer where INFO
// is refused).
var checkScript = redis.NewScript(`
local NO_SERVER = '` + noServer + `'
local k_check = KEYS[1]
redis.call('SET', k_check, '1', 'PX', 1000)
local info = redis.pcall('INFO', 'server')
if type(info) ~= 'string' then return NO_SERVER end
return string.match(info, 'run_id:(%w+)') or NO_SERVER
`)

// check asks the server holding group's keys (key: its check key) for
// its run_id, learns it, and reports whether it is want.
func (s *servers) check(ctx context.Context, rdb redis.UniversalClient, group, key, want string, now time.Time) (bool, error) {
	d := s.dials.Load()
	id, err := redisonce.Run(ctx, rdb, checkScript, []string{key}).Text()
	if err != nil {
		return false, err
	}
	s.learn(group, id, d, now)
	return id == want, nil
}

// still reports whether no connection was dialed since dial count d: a
// reply to arguments built at d came from the server they name.
func (s *servers) still(d uint64) bool { return s.dials.Load() == d }

// dialCounter is a go-redis hook that counts dialed connections.
type dialCounter struct{ n *atomic.Uint64 }

func (h dialCounter) DialHook(next redis.DialHook) redis.DialHook {
	return func(ctx context.Context, network, addr string) (net.Conn, error) {
		c, err := next(ctx, network, addr)
		h.n.Add(1)
		return c, err
	}
}

func (h dialCounter) ProcessHook(next redis.ProcessHook) redis.ProcessHook { return next }

func (h dialCounter) ProcessPipelineHook(next redis.ProcessPipelineHook) redis.ProcessPipelineHook {
	return next
}
