package shaper

import (
	"crypto/rand"
	"encoding/hex"
	"fmt"
	"os"
	"sync"
	"sync/atomic"
	"time"

	"github.com/redis/go-redis/v9"
)

// Config configures a Gate.
type Config struct {
	// KeyPrefix is the first part of every key; default "shaper". Tests
	// use a random prefix to share one Redis.
	KeyPrefix string
	// Clock is the local time source; default the system clock. Redis TIME
	// is the authority for ticks: the clock only measures waits, so
	// processes with skewed clocks agree.
	Clock Clock
	// Replica names this process among those granted ticks of a bucket,
	// whose configured ticks the gate compares during a rolling config
	// edit; default host:pid:random. It must not contain "|".
	Replica string
}

// Gate grants ticks for any number of buckets, sharing each bucket's
// schedule with every other Gate on the same Redis. It is safe for
// concurrent use.
type Gate struct {
	rdb     redis.UniversalClient
	prefix  string
	clock   Clock
	replica string

	srv         servers // the run_ids of the servers its groups live on (server.go)
	mu          sync.Mutex
	active      map[string]*local    // buckets with callers in this process
	handles     atomic.Uint64        // bucket handles made, to order them
	edits       atomic.Uint64        // respaces (config edits) so far: the generation of the handles made since (see Bucket.gen)
	noFunctions atomic.Bool          // the server has no Redis Functions for us: run scripts (functions.go)
	inLineSeq   atomic.Int64         // callers put in a line without a tag, to name them (line.go)
	lineSeen    map[string]time.Time // buckets whose line this process saw lately, and when (line.go; under mu)

	gateHooks // tests' hooks, all nil in production (testhooks.go)
}

// NewGate returns a gate on rdb. The gate never closes rdb; the first
// gate made on it adds a hook that counts the connections it dials, which
// every later gate on it shares (how the gate tells a failover or a
// restart without asking the server on every grant: see server.go).
func NewGate(rdb redis.UniversalClient, cfg Config) *Gate {
	g := &Gate{rdb: rdb, prefix: cfg.KeyPrefix, clock: cfg.Clock, replica: cfg.Replica, active: map[string]*local{}}
	g.srv.watchDials(rdb)
	if g.replica == "" {
		g.replica = replicaID()
	}
	if g.prefix == "" {
		g.prefix = DefaultKeyPrefix
	}
	if g.clock == nil {
		g.clock = systemClock{}
	}
	return g
}

// Bucket is the handle of one bucket shaped by one policy. Handles are
// cheap: make a new one when the policy changes; the state lives in Redis.
type Bucket struct {
	gate     *Gate
	name     string // unique among the gate's buckets: "group" or "group/bucket"
	group    string // the group's name
	member   string // the bucket's name in its group's sets ("" for a group of one)
	policy   Policy
	interval time.Duration
	burst    int
	keep     time.Duration // how long the state outlives its last tick: longest window + guard, at least minKeep
	total    *totalTick    // the group's total limit, if any
	limits   string        // limitSpec of the policy
	keys     bucketKeys
	made     uint64 // order among the gate's handles: a later handle holds a newer policy
	meter    *meter // what the margin must cover, measured; the guard follows it with Policy.MeasureGuard
	// core is true when the policy has the common shape the core script
	// serves (one limit, no total, no in-flight cap, no warm-up); counted
	// when it has quotas or a group's total, and neither an in-flight cap
	// nor warm-up (the counted script). fullUntil is the local time (ns)
	// until which the full script serves it anyway: the core or counted
	// script handed it a state it cannot decide alone; adaptUntil the
	// time until which the adapt grant serves a core bucket (the core
	// grant found adaptation in force).
	core                  bool
	counted               bool
	fullUntil, adaptUntil atomic.Int64
	// inSetUntil is the local time (ns) until which a group of one keeps
	// its tags in the set at the tags key, and its ticks in a list of
	// their own (tickKeys), listAgain the time from which it may turn the
	// set into its list again (see retag).
	inSetUntil, listAgain atomic.Int64
	// gen is the generation of the bucket's policy in this process: the
	// gate's edits when the handle was made, or when it was respaced
	// (the handle of a new policy). widest tells a caller still under an
	// older policy of this replica by it (see mine).
	gen atomic.Uint64
}

// Bucket returns the handle of a bucket of its own (a group of one, with
// no total) shaped by p, or an error naming what is wrong with either.
func (g *Gate) Bucket(name string, p Policy) (*Bucket, error) {
	grp, err := g.Group(name, nil)
	if err != nil {
		return nil, err
	}
	return grp.bucket("", p)
}

// Name returns the bucket's name: the group's, or "group/bucket".
func (b *Bucket) Name() string { return b.name }

// Policy returns the bucket's policy with defaults applied.
func (b *Bucket) Policy() Policy { return b.policy }

// replicaID names this process: host, pid and a random part (two gates in
// one process are two replicas).
func replicaID() string {
	host, _ := os.Hostname()
	var b [4]byte
	_, _ = rand.Read(b[:])
	return fmt.Sprintf("%s:%d:%s", host, os.Getpid(), hex.EncodeToString(b[:]))
}
