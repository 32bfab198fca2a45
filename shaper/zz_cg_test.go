package shaper

import (
	"context"
	"os"
	"strconv"
	"testing"
	"time"

	"github.com/go-redis/redis_rate/v10"
	"github.com/redis/go-redis/v9"
)

// go test -run TestZZCallgrind with CG_ADDR set: warm, then CG_N grants of the case CG_CASE.
func TestZZCallgrind(t *testing.T) {
	addr := os.Getenv("CG_ADDR")
	if addr == "" {
		t.Skip()
	}
	ctx := context.Background()
	rdb := redis.NewClient(&redis.Options{Addr: addr})
	n, _ := strconv.Atoi(os.Getenv("CG_N"))
	switch os.Getenv("CG_CASE") {
	case "accounts":
		g := NewGate(rdb, Config{KeyPrefix: "cg" + strconv.FormatInt(time.Now().UnixNano(), 36)})
		fast := Policy{Limits: []Limit{{Rate: 1_000_000, Window: time.Second}}, NoGuard: true, Horizon: time.Second}
		grp, _ := g.Group("cpu-accounts", &Policy{Limits: []Limit{{Rate: 1_000_000, Window: time.Second}}, NoGuard: true})
		p := fast
		p.Limits = append(p.Limits, Limit{Rate: 1_000_000_000, Window: time.Hour})
		var accounts []*Bucket
		for a := range 100 {
			b, _ := grp.Bucket("store-"+strconv.Itoa(a), p)
			accounts = append(accounts, b)
		}
		for i := range 300 {
			accounts[i%100].reserve(ctx, Request{})
		}
		time.Sleep(1100 * time.Millisecond)
		for i := range 300 {
			accounts[i%100].reserve(ctx, Request{})
		}
		rdb.Do(ctx, "SET", "cg-start", "1")
		for i := range n {
			if _, err := accounts[i%100].reserve(ctx, Request{}); err != nil {
				t.Fatal(err)
			}
		}
	case "accsim":
		simNow := time.Now().UnixMicro()
		g := NewGate(rdb, Config{KeyPrefix: "cg" + strconv.FormatInt(time.Now().UnixNano(), 36)})
		g.testNow = func() int64 { return simNow }
		fast := Policy{Limits: []Limit{{Rate: 1_000_000, Window: time.Second}}, NoGuard: true, Horizon: time.Second}
		grp, _ := g.Group("cpu-accounts", &Policy{Limits: []Limit{{Rate: 1_000_000, Window: time.Second}}, NoGuard: true})
		p := fast
		p.Limits = append(p.Limits, Limit{Rate: 1_000_000_000, Window: time.Hour})
		var accounts []*Bucket
		for a := range 100 {
			b, _ := grp.Bucket("store-"+strconv.Itoa(a), p)
			accounts = append(accounts, b)
		}
		for i := range 300 {
			simNow += 60
			accounts[i%100].reserve(ctx, Request{})
		}
		simNow += 1_100_000
		for i := range 300 {
			simNow += 60
			accounts[i%100].reserve(ctx, Request{})
		}
		for i := range n {
			simNow += 60
			if _, err := accounts[i%100].reserve(ctx, Request{}); err != nil {
				t.Fatal(err)
			}
		}
	case "common":
		g := NewGate(rdb, Config{KeyPrefix: "cg" + strconv.FormatInt(time.Now().UnixNano(), 36)})
		b, _ := g.Bucket("cpu-common", Policy{Limits: []Limit{{Rate: 1_000_000, Window: time.Second}}, NoGuard: true, Horizon: time.Second})
		for i := range 300 {
			b.reserve(ctx, Request{Tag: "w|q|warm-" + strconv.Itoa(i)})
		}
		for i := range n {
			if _, err := b.reserve(ctx, Request{Tag: "w|q|task-" + strconv.Itoa(i)}); err != nil {
				t.Fatal(err)
			}
		}
	case "gcra":
		lim := redis_rate.NewLimiter(rdb)
		for range 200 {
			lim.Allow(ctx, "cg-gcra", redis_rate.PerSecond(1_000_000))
		}
		for range n {
			lim.Allow(ctx, "cg-gcra", redis_rate.PerSecond(1_000_000))
		}
	}
}
