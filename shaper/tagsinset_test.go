package shaper

import (
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/shaper-dev/shaper/internal/gatehook"
	"github.com/shaper-dev/shaper/internal/redistest"
)

// vendorAndAccount returns, on one gate, a vendor's bucket "crm" (a
// group of one) and the bucket of its account store-1 (in the group
// "crm"), both shaped by p, and the gate's Redis client.
func vendorAndAccount(t *testing.T, p Policy) (*redis.Client, *Bucket, *Bucket) {
	t.Helper()
	rdb := redis.NewClient(&redis.Options{Addr: redistest.Addr(t)})
	t.Cleanup(func() { _ = rdb.Close() })
	g := NewGate(rdb, Config{KeyPrefix: redistest.Prefix(t)})
	vendor, err := g.Bucket("crm", p)
	if err != nil {
		t.Fatal(err)
	}
	grp, err := g.Group("crm", nil)
	if err != nil {
		t.Fatal(err)
	}
	account, err := grp.Bucket("store-1", p)
	if err != nil {
		t.Fatal(err)
	}
	return rdb, vendor, account
}

// TestVendorBucketOfAccountsKeepsTheirSet: a per-account vendor's
// vendor-level bucket (the one its worker reads the held calls through)
// keeps its holders' tags in its accounts' sorted set from its first
// grant (gatehook.TagsInSet). Without it, that grant makes the key its
// ticks list, and the accounts' next grant turns it back (retag): no
// grant fails, but the key changes form twice, and before retag every
// account's grant failed (WRONGTYPE): 13% of 200 accounts' allowance.
func TestVendorBucketOfAccountsKeepsTheirSet(t *testing.T) {
	ctx := context.Background()
	rdb, vendor, account := vendorAndAccount(t, Policy{Limits: []Limit{{Rate: 50, Window: time.Second}}})
	gatehook.TagsInSet(vendor)
	if _, err := vendor.Acquire(ctx, Request{Tag: "w|q|vendor-level"}); err != nil {
		t.Fatal(err)
	}
	if kind := rdb.Type(ctx, account.keys.tags).Val(); kind != "zset" {
		t.Errorf("after the vendor-level bucket's grant the tags key is a %s, want the accounts' zset", kind)
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

// TestTagsTakeTheirWritersForm: a vendor's bucket (a group of one, its
// tags in its ticks list) and its accounts' buckets (their tags in the
// group's set, at the same key) granting side by side, as a vendor made
// per_account, or no longer, at a reload does, or replicas of both
// configurations in a rollout: no grant fails (before retag, the second
// writer's failed with WRONGTYPE until the other's record expired), no
// tag is lost (every call's tag is read back through either bucket), and
// the key changes form at most once per tagKeep, not at every grant.
func TestTagsTakeTheirWritersForm(t *testing.T) {
	ctx := context.Background()
	rdb, vendor, account := vendorAndAccount(t, Policy{Limits: []Limit{{Rate: 1000, Window: time.Second}}})
	n := 0
	grant := func(b *Bucket) {
		t.Helper()
		n++
		if _, err := b.Acquire(ctx, Request{Tag: fmt.Sprintf("w|q|%d", n)}); err != nil {
			t.Fatalf("grant %d (%s): %v", n, b.Name(), err)
		}
	}
	read := func(when string) {
		t.Helper()
		for _, b := range []*Bucket{vendor, account} {
			tags, err := b.tagged(ctx, time.Time{})
			if err != nil || len(tags) != n {
				t.Fatalf("%s: %d tags read through %s (%v), want the %d granted", when, len(tags), b.Name(), err, n)
			}
		}
	}
	form := func() string { return rdb.Type(ctx, account.keys.tags).Val() }
	for range 3 {
		grant(vendor)
	}
	if f := form(); f != "list" {
		t.Fatalf("the vendor's bucket alone keeps its tags in a %s, want its list", f)
	}
	grant(account)
	if f := form(); f != "zset" {
		t.Errorf("after an account's grant the tags key is a %s, want the accounts' set", f)
	}
	read("the account's grant after the vendor's")
	grant(vendor) // turns the set into its list: the first time
	if f := form(); f != "list" {
		t.Errorf("after the vendor's grant the tags key is a %s, want its list again", f)
	}
	read("the vendor's grant after the account's")
	changes, last := 0, form()
	for range 20 {
		grant(account)
		grant(vendor)
		if f := form(); f != last {
			changes++
			last = f
		}
	}
	read("20 grants of each, side by side")
	if changes > 1 || last != "zset" {
		t.Errorf("the tags key changed form %d times over 20 grants of each within %s, and is a %s; want once, to the accounts' set", changes, tagKeep, last)
	}
	if l := rdb.LLen(ctx, vendor.keys.oldTicks).Val(); l == 0 {
		t.Error("the vendor's bucket, keeping its tags in the set, logged none of its ticks in its own list")
	}
}
