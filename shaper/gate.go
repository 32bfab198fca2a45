package shaper

import (
	"fmt"
	"sync"
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
}

// Gate grants ticks for any number of buckets, sharing each bucket's
// schedule with every other Gate on the same Redis. It is safe for
// concurrent use.
type Gate struct {
	rdb    redis.UniversalClient
	prefix string
	clock  Clock

	mu     sync.Mutex
	active map[string]*local // buckets with callers in this process

	testNow       func() int64 // tests: Redis time (µs) for the scripts; nil: Redis TIME
	testWatchedUp func()       // tests: called when Watch's subscription is confirmed
}

// NewGate returns a gate on rdb. The gate never closes rdb.
func NewGate(rdb redis.UniversalClient, cfg Config) *Gate {
	g := &Gate{rdb: rdb, prefix: cfg.KeyPrefix, clock: cfg.Clock, active: map[string]*local{}}
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
	name     string
	policy   Policy
	interval time.Duration
	burst    int
	keys     bucketKeys
}

// Bucket returns the handle of bucket name shaped by p, or an error naming
// what is wrong with either.
func (g *Gate) Bucket(name string, p Policy) (*Bucket, error) {
	if err := checkBucket(name); err != nil {
		return nil, err
	}
	if err := p.Validate(); err != nil {
		return nil, fmt.Errorf("shaper: bucket %q: %w", name, err)
	}
	p = p.withDefaults()
	iv, burst := p.Tick()
	return &Bucket{gate: g, name: name, policy: p, interval: iv, burst: burst, keys: keysOf(g.prefix, name)}, nil
}

// Name returns the bucket's name.
func (b *Bucket) Name() string { return b.name }

// Policy returns the bucket's policy with defaults applied.
func (b *Bucket) Policy() Policy { return b.policy }
