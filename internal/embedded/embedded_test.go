package embedded

import (
	"context"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"
)

// TestKeysExpireInRealTime: a key set to live 50 ms is gone within a
// little more than that, without anyone moving the server's clock.
func TestKeysExpireInRealTime(t *testing.T) {
	s, err := Start("127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer s.Close()
	rdb := redis.NewClient(&redis.Options{Addr: s.Addr()})
	defer rdb.Close()
	ctx := context.Background()
	if err := rdb.Set(ctx, "k", "v", 50*time.Millisecond).Err(); err != nil {
		t.Fatal(err)
	}
	if n := rdb.Exists(ctx, "k").Val(); n != 1 {
		t.Fatal("the key is gone at once")
	}
	deadline := time.Now().Add(5 * time.Second)
	for rdb.Exists(ctx, "k").Val() == 1 {
		if time.Now().After(deadline) {
			t.Fatalf("a key set to live 50ms still exists after 5s (TTL %v)", rdb.PTTL(ctx, "k").Val())
		}
		time.Sleep(5 * time.Millisecond)
	}
	s.Close()
	s.Close() // a second Close is harmless
}
