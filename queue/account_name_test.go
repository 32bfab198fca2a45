package queue

import (
	"context"
	"errors"
	"strings"
	"testing"

	"github.com/shaper-dev/shaper/vendorclients"
)

// TestCheckAccountRule: the one rule of account names, as a table. Names
// made only of dots are refused: "." and ".." are path segments that
// leave an account's base_url (/stores/{account}/api -> /stores/../api).
func TestCheckAccountRule(t *testing.T) {
	for _, tt := range []struct {
		name string
		want string // "" for a valid name, else a part of the error
	}{
		{"store-42", ""},
		{"Big.Store_1", ""},
		{"a..b", ""},
		{".hidden", ""},
		{"trailing.", ""},
		{"user@example.com", ""},
		{"org:team+x=y", ""},
		{".", "only dots"},
		{"..", "only dots"},
		{"...", "only dots"},
		{strings.Repeat(".", MaxAccountLen+1), "only dots"},
		{"", "not empty"},
		{"a/b", "not allowed"},
		{"../b", "not allowed"},
		{`a\b`, "not allowed"},
		{"%2e%2e", "not allowed"},
		{"a%2Fb", "not allowed"},
		{"tab\t", "not allowed"},
		{"nl\n", "not allowed"},
		{"nul\x00", "not allowed"},
		{"del\x7f", "not allowed"},
		{"a b", "not allowed"},
		{"ü", "not allowed"},
		{strings.Repeat("a", MaxAccountLen+1), "at most"},
	} {
		err := CheckAccount(tt.name)
		switch {
		case tt.want == "" && err != nil:
			t.Errorf("CheckAccount(%q) = %v, want ok", tt.name, err)
		case tt.want != "" && (!errors.Is(err, ErrBadAccount) || !strings.Contains(err.Error(), tt.want)):
			t.Errorf("CheckAccount(%q) = %v, want ErrBadAccount saying %q", tt.name, err, tt.want)
		}
	}
}

// TestDotAccountRefusedAtEnqueue: on a real Redis, a call to a
// per-account vendor whose base_url has {account} in its path is refused
// when its account is only dots, by Enqueue and by EnqueueBatch, with an
// error naming the account, the vendor and the rule, and nothing of the
// call or its batch is queued.
func TestDotAccountRefusedAtEnqueue(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	shop := "shop-" + e.prefix[5:]
	e.vendors = append(e.vendors, Vendor{Endpoint: vendorclients.Endpoint{Name: shop, BaseURL: "https://v.example/stores/{account}/api"},
		Policy: policy(5), PerAccount: true})
	c := e.newClient()
	ctx := context.Background()
	for _, account := range []string{".", "..", "..."} {
		_, err := c.Enqueue(ctx, Call{Vendor: shop, Account: account, ID: "dots", Path: "/orders"})
		if !errors.Is(err, ErrBadCall) || !errors.Is(err, ErrBadAccount) {
			t.Errorf("account %q: err = %v, want ErrBadCall and ErrBadAccount", account, err)
			continue
		}
		for _, want := range []string{shop, `"` + account + `"`, "only dots"} {
			if !strings.Contains(err.Error(), want) {
				t.Errorf("account %q: err = %v, want it to name %s", account, err, want)
			}
		}
	}
	_, err := c.EnqueueBatch(ctx, shop, []Call{
		{Vendor: shop, Account: "store-1", ID: "good", Path: "/orders"},
		{Vendor: shop, Account: "..", ID: "bad", Path: "/orders"},
	})
	if !errors.Is(err, ErrBadAccount) || !strings.Contains(err.Error(), `".."`) {
		t.Errorf("batch: err = %v, want the account \"..\" refused", err)
	}
	if n, err := c.Waiting(ctx, shop); err != nil || n != 0 {
		t.Errorf("Waiting = %d, %v: want nothing queued", n, err)
	}
	if n := e.rdb().Exists(ctx, "asynq:{"+QueueName(shop)+"}:t:good", "asynq:{"+QueueName(shop)+"}:t:dots", "asynq:{"+QueueName(shop)+"}:t:bad").Val(); n != 0 {
		t.Errorf("%d task keys written for refused calls", n)
	}
}
