package queue

import (
	"context"
	"testing"

	"github.com/redis/go-redis/v9"

	"github.com/shaper-dev/shaper/internal/redistest"
	"github.com/shaper-dev/shaper/shaper"
)

// TestClaimLostReplyRunsOnce loses the reply to a claim of an id after
// Redis ran it (the connection closes: EOF), on a client with go-redis's
// default retries. A retry would run the claim again and find the id
// held, by the claim the lost reply made: the enqueue would take its own
// claim for another's. The claim is sent once: the enqueue gets the
// error, and the one claim made lapses with claimKeep.
func TestClaimLostReplyRunsOnce(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	direct := redistest.Client(t)
	proxy := redistest.StartLostReply(t, redistest.Addr(t))
	rdb := redis.NewClient(&redis.Options{Addr: proxy.Addr()}) // MaxRetries: go-redis's default, 3
	defer rdb.Close()
	prefix := redistest.Prefix(t)
	c := NewClient(rdb, ClientConfig{KeyPrefix: prefix})
	defer c.Close()
	if err := idClaimScript.Load(ctx, direct).Err(); err != nil {
		t.Fatal(err)
	}
	proxy.Arm(idClaimScript.Hash(), false)
	_, claims, err := c.claimIDs(ctx, "lost", []string{"x"}, []shaper.Lane{shaper.Normal})
	if proxy.Lost() != 1 {
		t.Fatalf("the proxy lost %d replies, want 1", proxy.Lost())
	}
	t.Logf("a claim whose reply was lost: %+v, %v", claims, err)
	if err == nil {
		t.Errorf("the claim of x answered %+v and no error after its reply was lost: an enqueue's own claim taken for another's", claims)
	}
	if n, err := direct.ZCard(ctx, claimsKey(prefix, "lost")).Result(); err != nil || n != 1 {
		t.Errorf("%d claims, %v; want 1", n, err)
	}
}
