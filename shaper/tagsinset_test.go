package shaper

import (
	"context"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/shaper-dev/shaper/internal/gatehook"
	"github.com/shaper-dev/shaper/internal/redistest"
)

// TestVendorBucketOfAccountsKeepsTheirSet: a per-account vendor's
// vendor-level bucket (the one its worker reads the held calls through)
// granting a call must leave its accounts' sorted set of tags a sorted
// set. Without gatehook.TagsInSet its grant made the key its ticks list
// and every account's grant failed (WRONGTYPE): 13% of 200 accounts'
// allowance delivered.
func TestVendorBucketOfAccountsKeepsTheirSet(t *testing.T) {
	ctx := context.Background()
	rdb := redis.NewClient(&redis.Options{Addr: redistest.Addr(t)})
	t.Cleanup(func() { _ = rdb.Close() })
	g := NewGate(rdb, Config{KeyPrefix: redistest.Prefix(t)})
	p := Policy{Limits: []Limit{{Rate: 50, Window: time.Second}}}
	vendor, err := g.Bucket("crm", p)
	if err != nil {
		t.Fatal(err)
	}
	gatehook.TagsInSet(vendor)
	grp, err := g.Group("crm", nil)
	if err != nil {
		t.Fatal(err)
	}
	account, err := grp.Bucket("store-1", p)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := vendor.Acquire(ctx, Request{Tag: "w|q|vendor-level"}); err != nil {
		t.Fatal(err)
	}
	if _, err := account.Acquire(ctx, Request{Tag: "w|q|account"}); err != nil {
		t.Fatalf("an account's grant after the vendor-level bucket's: %v", err)
	}
	if kind := rdb.Type(ctx, account.keys.tags).Val(); kind != "zset" {
		t.Errorf("the accounts' tags key is a %s, want a zset", kind)
	}
	tags, err := vendor.tagged(ctx, time.Time{})
	if err != nil || len(tags) != 2 {
		t.Errorf("read through the vendor-level bucket: %v, %v; want both calls' tags", tags, err)
	}
}
