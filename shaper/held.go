package shaper

import (
	"context"
	"fmt"
	"strconv"
	"strings"
	"time"

	"github.com/redis/go-redis/v9"
)

// heldKeep is how long the record of a held call outlives its tick: long
// enough for a replica's death to be seen (Gate.Silent, seconds) and for
// a call under a lease nobody renews to be found (the queue's stall
// sweep, 15 s after the last renewal) while the call's grant is still in
// the record; short enough that the record is half a minute of grants
// at most, whatever the backlog.
const heldKeep = 30 * time.Second

// Holds is a bucket's record of who holds each granted call until its
// tick (Request.Holder, written in the grant's round trip): what a job
// runner reads to give a dead worker's calls back. It is apart from
// Control, which is what the vendor says.
type Holds struct{ b *Bucket }

// Holds returns the bucket's record of held calls.
func (b *Bucket) Holds() *Holds { return &Holds{b: b} }

// HeldBy returns the holders (Request.Holder) of the calls replica was
// granted a tick for after after (Redis time), oldest tick first: when
// replica died before after, none of them started. Entries leave the
// record heldKeep after their tick; Release takes them out sooner.
func (h *Holds) HeldBy(ctx context.Context, replica string, after time.Time) ([]string, error) {
	b := h.b
	members, err := b.gate.rdb.ZRangeByScore(ctx, b.keys.held, &redis.ZRangeBy{
		Min: "(" + strconv.FormatInt(after.UnixMicro(), 10), Max: "+inf"}).Result()
	if err != nil {
		return nil, fmt.Errorf("shaper: calls held in %q: %w", b.name, unavailable(ctx, err))
	}
	var out []string
	for _, m := range members {
		if h, ok := strings.CutPrefix(m, replica+"|"); ok {
			out = append(out, h)
		}
	}
	return out, nil
}

// HeldTicks returns the latest granted tick (Redis time) of every holder
// in the record, whichever replica holds it: a call without one was not
// granted a tick in the last heldKeep, so it never started.
func (h *Holds) HeldTicks(ctx context.Context) (map[string]time.Time, error) {
	b := h.b
	zs, err := b.gate.rdb.ZRangeWithScores(ctx, b.keys.held, 0, -1).Result()
	if err != nil {
		return nil, fmt.Errorf("shaper: calls held in %q: %w", b.name, unavailable(ctx, err))
	}
	out := make(map[string]time.Time, len(zs))
	for _, z := range zs {
		m, _ := z.Member.(string)
		_, holder, ok := strings.Cut(m, "|") // replica ids hold no "|"
		if !ok {
			continue
		}
		if t := time.UnixMicro(int64(z.Score)); t.After(out[holder]) {
			out[holder] = t
		}
	}
	return out, nil
}

// Release takes replica's records of holders out (their calls went back
// to the queue).
func (h *Holds) Release(ctx context.Context, replica string, holders ...string) error {
	if len(holders) == 0 {
		return nil
	}
	b := h.b
	members := make([]any, len(holders))
	for i, h := range holders {
		members[i] = replica + "|" + h
	}
	if err := b.gate.rdb.ZRem(ctx, b.keys.held, members...).Err(); err != nil {
		return fmt.Errorf("shaper: release calls held in %q: %w", b.name, unavailable(ctx, err))
	}
	return nil
}

// aliveForget is how long a silent replica stays in the alive set.
const aliveForget = time.Minute

// aliveScript records that a replica is alive now.
//
// KEYS[1] the alive sorted set (replica -> Redis time last seen, µs).
// ARGV[1] Redis time override (µs; 0: TIME), ARGV[2] replica id,
// ARGV[3] aliveForget (µs).
// Returns Redis now (µs).
var aliveScript = redis.NewScript(nowLua + `
local k_alive = KEYS[1]
local a_replica = ARGV[2]
local a_forget = tonumber(ARGV[3])
local now = now_us()
redis.call('ZADD', k_alive, string.format('%d', now), a_replica)
redis.call('ZREMRANGEBYSCORE', k_alive, '-inf', '(' .. string.format('%d', now - a_forget))
redis.call('PEXPIRE', k_alive, math.ceil(a_forget / 1000))
return now
`)

// aliveKey is the sorted set of live replicas of every bucket.
func (g *Gate) aliveKey() string { return g.prefix + ":alive" }

// Alive records that this replica is alive, in one round trip (a
// worker's health check: Redis answers, and every replica hears of
// this one). It returns Redis time.
func (g *Gate) Alive(ctx context.Context) (time.Time, error) {
	now, err := aliveScript.Run(ctx, g.rdb, []string{g.aliveKey()}, g.redisNow(), g.replica, aliveForget.Microseconds()).Int64()
	if err != nil {
		return time.Time{}, fmt.Errorf("shaper: alive: %w", unavailable(ctx, err))
	}
	return time.UnixMicro(now), nil
}

// Leave takes this replica out of the alive set: it stopped (and is not
// dead to the others).
func (g *Gate) Leave(ctx context.Context) error {
	if err := g.rdb.ZRem(ctx, g.aliveKey(), g.replica).Err(); err != nil {
		return fmt.Errorf("shaper: leave: %w", unavailable(ctx, err))
	}
	return nil
}

// Silence is a replica not heard from (Gate.Alive) since LastSeen (Redis
// time).
type Silence struct {
	Replica  string
	LastSeen time.Time
}

// Silent returns the replicas other than this one silent for at least
// d at Redis time now (at most aliveForget ago: older ones are
// forgotten).
func (g *Gate) Silent(ctx context.Context, now time.Time, d time.Duration) ([]Silence, error) {
	zs, err := g.rdb.ZRangeByScoreWithScores(ctx, g.aliveKey(), &redis.ZRangeBy{
		Min: "-inf", Max: strconv.FormatInt(now.Add(-d).UnixMicro(), 10)}).Result()
	if err != nil {
		return nil, fmt.Errorf("shaper: silent replicas: %w", unavailable(ctx, err))
	}
	var out []Silence
	for _, z := range zs {
		id, _ := z.Member.(string)
		if id != g.replica {
			out = append(out, Silence{Replica: id, LastSeen: time.UnixMicro(int64(z.Score))})
		}
	}
	return out, nil
}
