package shaper

import (
	"context"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/shaper-dev/shaper/internal/redistest"
)

// TestLostReplyChangesStateOnce loses the reply to a grant and to a
// give-up after Redis ran them (the client's connection closes: EOF),
// on a client with go-redis's default retries, as production's is. A
// retry would run the script again: two ticks granted for one call, or
// a quota's unit taken back twice, freeing one another call used (G1).
// The gate sends each once: the caller gets the error, and the quota
// counts what Redis did once.
func TestLostReplyChangesStateOnce(t *testing.T) {
	ctx := context.Background()
	rdb := redistest.Client(t)
	prefix := redistest.Prefix(t)
	p := Policy{Limits: []Limit{{Rate: 10, Window: time.Second}, {Rate: 100, Window: time.Hour}}}
	direct := NewGate(rdb, Config{KeyPrefix: prefix})
	clk := fakeRedisTime(direct, testEpoch)
	b, err := direct.Bucket("crm", p)
	if err != nil {
		t.Fatal(err)
	}
	proxy := redistest.StartLostReply(t, redistest.Addr(t))
	c := redis.NewClient(&redis.Options{Addr: proxy.Addr()}) // MaxRetries: go-redis's default, 3
	defer c.Close()
	cut := NewGate(c, Config{KeyPrefix: prefix})
	cut.testNow = clk.now // both gates read one simulated Redis time
	cb, err := cut.Bucket("crm", p)
	if err != nil {
		t.Fatal(err)
	}
	used := func() int {
		t.Helper()
		use, err := b.limitUse(ctx)
		if err != nil {
			t.Fatal(err)
		}
		return int(use[1].Used)
	}
	// lose arms the proxy with marker, runs fn through it and returns
	// how the quota's count moved and fn's error.
	lose := func(marker string, fn func() error) (int, error) {
		t.Helper()
		before := used()
		lost := proxy.Lost()
		proxy.Arm(marker, false)
		err := fn()
		if proxy.Lost() != lost+1 {
			t.Fatalf("the proxy lost %d replies, want 1", proxy.Lost()-lost)
		}
		return used() - before, err
	}

	// grant reserves a tick of bk, moving the clock on while it defers.
	grant := func(bk *Bucket) reservation {
		t.Helper()
		for range 10 {
			r, err := bk.reserve(ctx, Request{})
			if err != nil {
				t.Fatal(err)
			}
			if r.ok {
				return r
			}
			clk.advance(r.wait)
		}
		t.Fatal("no grant after 10 reservations")
		return reservation{}
	}

	// A grant: the first through the proxy loads the gate's functions;
	// a second later the next call's tick is due at once.
	grant(cb)
	clk.advance(time.Second)
	moved, err := lose("\r\nfcall\r\n", func() error { _, err := cb.reserve(ctx, Request{}); return err })
	t.Logf("a grant whose reply was lost: the quota counts %+d; the caller got %v", moved, err)
	if moved != 1 {
		t.Errorf("one call's grant counted %d units of the quota, want 1", moved)
	}
	if err == nil {
		t.Error("the caller got no error for a lost grant")
	}

	// A give-up, of a tick granted on the direct client.
	clk.advance(time.Second)
	r := grant(b)
	if err := giveUpScript.Load(ctx, rdb).Err(); err != nil {
		t.Fatal(err)
	}
	moved, err = lose(giveUpScript.Hash(), func() error { return cb.giveUp(ctx, r.lease, gaveUpLate, r.tick, 1, r.tag) })
	t.Logf("a give-up whose reply was lost: the quota counts %+d; the caller got %v", moved, err)
	if moved != -1 {
		t.Errorf("giving one tick up moved the quota by %d units, want -1", moved)
	}
	if err == nil {
		t.Error("the caller got no error for a lost give-up")
	}
}
