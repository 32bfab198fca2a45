package queue

// What keeps enqueues that run side by side honest: an id's claim, so that
// an id names one call per vendor whatever its lane, and a reservation of
// room, so that concurrent enqueues never leave more than queue_limit
// waiting. Both live in the vendor's own hash slot (its gate keys' tag),
// next to the script that writes each; asynq's keys of the two lanes are
// in two other slots, which is why neither can be one script with
// asynq's enqueue.

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"strconv"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/shaper-dev/shaper/internal/redisonce"
	"github.com/shaper-dev/shaper/shaper"
)

// ErrInProgress: another request is queueing a call with the same id
// right now, and did not finish within claimWait; posting the call again
// a moment later answers with that call (or queues it, if that request
// failed).
var ErrInProgress = errors.New("queue: another request is queueing a call with this id")

const (
	// claimKeep is how long an id's claim lives at most, if its holder
	// dies before it releases it: far longer than a chunk takes to queue
	// (claimSafe).
	claimKeep = time.Minute
	// claimSafe bounds the time from claiming a chunk's ids, or from
	// renewing their claims, to queueing the next of them: past it, the
	// rest of the chunk is not queued (its claims could be about to lapse).
	claimSafe = claimKeep / 2
	// renewEvery is how often an enqueue under way renews what it holds:
	// the claims of the ids it has still to queue, and the room reserved
	// in the queue_limit of the vendors it has still to queue. A busy
	// Redis slows a chunk down; it does not fail it.
	renewEvery = claimSafe / 3
	// claimStale is the age past which a claim whose call is in no lane
	// is stale: its holder stopped queueing (claimSafe) and any write it
	// had sent has landed; other enqueues drop it.
	claimStale = claimSafe + 10*time.Second
	// claimWait is how long an enqueue waits for another request that
	// holds the claim of one of its ids to queue that call; claimPoll is
	// how often it looks.
	claimWait = 2 * time.Second
	claimPoll = 20 * time.Millisecond
	// chunkSize is the most calls claimed, planned and queued at once (a
	// script's arguments stay well under Lua's unpack limit).
	chunkSize = 1000
	// roomKeep is how long a reservation of room holds unless renewed
	// (a long request renews those of the vendors it has still to queue,
	// every renewEvery) or released.
	roomKeep = time.Minute
)

// idClaimScript claims ids of a vendor's calls: each id not claimed is
// claimed now for its lane; a claimed one is left as it is. A claim is a
// member of a sorted set scored by its Redis time (ms) * 2 + its lane's
// bit; it lives while its enqueue runs (released once its call is queued,
// when the call itself holds the id), and claims older than keep (their
// holder died) are dropped first.
//
// KEYS[1] the vendor's claims (sorted set).
// ARGV[1] keep (ms), then pairs ARGV[2k] lane (0|1), ARGV[2k+1] id.
// Returns {now (ms), then per id: -1 (claimed now) or the score of the
// claim that holds it}.
var idClaimScript = redis.NewScript(`
local k_claims = KEYS[1]
local keep = tonumber(ARGV[1])
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
redis.call('ZREMRANGEBYSCORE', k_claims, '-inf', '(' .. string.format('%d', (now - keep) * 2))
local ids, lanes = {}, {}
for i = 2, #ARGV, 2 do
  lanes[#lanes + 1] = tonumber(ARGV[i])
  ids[#ids + 1] = ARGV[i + 1]
end
local held = redis.call('ZMSCORE', k_claims, unpack(ids))
local out, add = {now}, {}
for i, id in ipairs(ids) do
  if held[i] then
    out[i + 1] = tonumber(held[i])
  else
    out[i + 1] = -1
    add[#add + 1] = string.format('%d', now * 2 + lanes[i])
    add[#add + 1] = id
  end
end
if #add > 0 then
  redis.call('ZADD', k_claims, unpack(add))
  redis.call('PEXPIRE', k_claims, keep)
end
return out
`)

// dropStaleScript drops claims that are as they were seen: claims whose
// holder gave up (claimStale) without queueing their call.
//
// KEYS[1] the vendor's claims. ARGV pairs: ARGV[2k-1] the score seen,
// ARGV[2k] id.
// Returns the number dropped.
var dropStaleScript = redis.NewScript(`
local k_claims = KEYS[1]
local n = 0
for i = 1, #ARGV, 2 do
  local seen, id = ARGV[i], ARGV[i + 1]
  if tonumber(redis.call('ZSCORE', k_claims, id)) == tonumber(seen) then
    n = n + redis.call('ZREM', k_claims, id)
  end
end
return n
`)

// renewClaimsScript moves the claims an enqueue still holds to Redis's
// time now, so that no other enqueue takes them for stale while a long
// chunk (a busy Redis) queues their calls. A claim is renewed only as it
// was made (its score unchanged): one that another enqueue dropped as
// stale is not taken back.
//
// KEYS[1] the vendor's claims. ARGV[1] keep (ms), then pairs ARGV[2k]
// the score held, ARGV[2k+1] id.
// Returns {now (ms), the number of claims renewed}.
var renewClaimsScript = redis.NewScript(`
local k_claims = KEYS[1]
local keep = tonumber(ARGV[1])
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local n = 0
for i = 2, #ARGV, 2 do
  local held, id = tonumber(ARGV[i]), ARGV[i + 1]
  if tonumber(redis.call('ZSCORE', k_claims, id)) == held then
    redis.call('ZADD', k_claims, string.format('%d', now * 2 + held % 2), id)
    n = n + 1
  end
end
if n > 0 then
  redis.call('PEXPIRE', k_claims, keep)
end
return {now, n}
`)

// laneBit is a lane's bit in a claim's score.
func laneBit(l shaper.Lane) int64 {
	if l == shaper.High {
		return 1
	}
	return 0
}

// idClaim is what idClaimScript said of one id.
type idClaim struct {
	mine  bool        // claimed now, by this enqueue
	lane  shaper.Lane // the lane its holder queues it in
	at    int64       // when it was claimed (Redis time, ms)
	score int64
}

// claimIDs claims ids (unique) of vendor's calls, each for its lane. It
// returns Redis's time (ms) and each id's claim.
func (c *Client) claimIDs(ctx context.Context, vendor string, ids []string, lanes []shaper.Lane) (int64, []idClaim, error) {
	args := make([]any, 0, 1+2*len(ids))
	args = append(args, claimKeep.Milliseconds())
	for i, id := range ids {
		args = append(args, laneBit(lanes[i]), id)
	}
	res, err := redisonce.Run(ctx, c.rdb, idClaimScript, []string{claimsKey(c.cfg.KeyPrefix, vendor)}, args...).Int64Slice()
	if err != nil {
		return 0, nil, fmt.Errorf("queue: claim ids on %s: %w", vendor, err)
	}
	if len(res) != len(ids)+1 {
		return 0, nil, fmt.Errorf("queue: claim ids on %s: unexpected reply of %d values", vendor, len(res))
	}
	out := make([]idClaim, len(ids))
	for i, s := range res[1:] {
		if s < 0 {
			out[i] = idClaim{mine: true, lane: lanes[i], at: res[0], score: res[0]*2 + laneBit(lanes[i])}
			continue
		}
		l := shaper.Normal
		if s%2 == 1 {
			l = shaper.High
		}
		out[i] = idClaim{lane: l, at: s / 2, score: s}
	}
	return res[0], out, nil
}

// renewClaims renews the claims of ids this enqueue holds, each with the
// score it was made with (scores, updated to the new ones). A claim lost
// (dropped by another enqueue as stale) is an error: the calls not
// queued yet are not.
func (c *Client) renewClaims(ctx context.Context, vendor string, ids []string, scores []int64) error {
	if len(ids) == 0 {
		return nil
	}
	args := make([]any, 0, 1+2*len(ids))
	args = append(args, claimKeep.Milliseconds())
	for i, id := range ids {
		args = append(args, strconv.FormatInt(scores[i], 10), id)
	}
	res, err := redisonce.Run(ctx, c.rdb, renewClaimsScript, []string{claimsKey(c.cfg.KeyPrefix, vendor)}, args...).Int64Slice()
	if err != nil {
		return fmt.Errorf("queue: renew the claims of %d ids on %s: %w", len(ids), vendor, err)
	}
	if len(res) != 2 {
		return fmt.Errorf("queue: renew claims on %s: unexpected reply of %d values", vendor, len(res))
	}
	if res[1] != int64(len(ids)) {
		return fmt.Errorf("queue: %d of the claims on %d ids of %s lapsed while they were queued (Redis took over %s to answer); the calls not queued yet were not, post them again",
			int64(len(ids))-res[1], len(ids), vendor, c.claimSafe)
	}
	for i := range scores {
		scores[i] = res[0]*2 + scores[i]%2
	}
	return nil
}

// dropStale drops the claims of ids as they were seen (scores).
func (c *Client) dropStale(ctx context.Context, vendor string, ids []string, scores []int64) error {
	args := make([]any, 0, 2*len(ids))
	for i, id := range ids {
		args = append(args, strconv.FormatInt(scores[i], 10), id)
	}
	if err := redisonce.Run(ctx, c.rdb, dropStaleScript, []string{claimsKey(c.cfg.KeyPrefix, vendor)}, args...).Err(); err != nil {
		return fmt.Errorf("queue: drop stale claims on %s: %w", vendor, err)
	}
	return nil
}

// releaseClaims drops the claims of ids this enqueue made: once their
// calls are queued (each call then holds its id in its lane), or when it
// did not queue them, so that posting them again need not wait. It runs
// even when ctx is done.
func (c *Client) releaseClaims(ctx context.Context, vendor string, ids []string) {
	if len(ids) == 0 {
		return
	}
	members := make([]any, len(ids))
	for i, id := range ids {
		members[i] = id
	}
	ctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 5*time.Second)
	defer cancel()
	_ = c.rdb.ZRem(ctx, claimsKey(c.cfg.KeyPrefix, vendor), members...).Err()
}

// queuedIn reports, for each group of task keys (each group one lane's,
// so one hash slot), which of them exist: one multi-key EXISTS per group,
// and a read per key only for a group where some do.
func (c *Client) queuedIn(ctx context.Context, groups [][]string) ([][]bool, error) {
	out := make([][]bool, len(groups))
	counts := make([]*redis.IntCmd, len(groups))
	pipe := c.rdb.Pipeline()
	for g, keys := range groups {
		out[g] = make([]bool, len(keys))
		if len(keys) > 0 {
			counts[g] = pipe.Exists(ctx, keys...)
		}
	}
	if _, err := pipe.Exec(ctx); err != nil {
		return nil, fmt.Errorf("queue: look for queued ids: %w", err)
	}
	each := map[int][]*redis.IntCmd{}
	pipe = c.rdb.Pipeline()
	for g, keys := range groups {
		switch n := countOf(counts[g]); {
		case n == 0:
		case n == int64(len(keys)):
			for i := range keys {
				out[g][i] = true
			}
		default:
			for _, k := range keys {
				each[g] = append(each[g], pipe.Exists(ctx, k))
			}
		}
	}
	if len(each) == 0 {
		return out, nil
	}
	if _, err := pipe.Exec(ctx); err != nil {
		return nil, fmt.Errorf("queue: look for queued ids: %w", err)
	}
	for g, cmds := range each {
		for i, cmd := range cmds {
			out[g][i] = cmd.Val() > 0
		}
	}
	return out, nil
}

func countOf(cmd *redis.IntCmd) int64 {
	if cmd == nil {
		return 0
	}
	return cmd.Val()
}

// reserveScript reserves room for n calls in a vendor's queue_limit, for
// keep, and counts the room every live reservation holds, this one
// included. A reservation is a member "token:n" of a sorted set scored
// by its expiry (Redis time, ms).
//
// KEYS[1] the vendor's reservations (sorted set).
// ARGV[1] member (token:n), ARGV[2] n, ARGV[3] keep (ms).
// Returns the calls reserved.
var reserveScript = redis.NewScript(`
local k_room = KEYS[1]
local member = ARGV[1]
local n = tonumber(ARGV[2])
local keep = tonumber(ARGV[3])
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
redis.call('ZREMRANGEBYSCORE', k_room, '-inf', now)
local held = n
for _, m in ipairs(redis.call('ZRANGE', k_room, 0, -1)) do
  held = held + tonumber(string.match(m, ':(%d+)$'))
end
redis.call('ZADD', k_room, now + keep, member)
redis.call('PEXPIRE', k_room, keep)
return held
`)

// renewScript renews a reservation for keep, if it still holds.
//
// KEYS[1] the vendor's reservations. ARGV[1] member, ARGV[2] keep (ms).
// Returns 1 when renewed, 0 when it had lapsed.
var renewScript = redis.NewScript(`
local k_room = KEYS[1]
local member = ARGV[1]
local keep = tonumber(ARGV[2])
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
if not redis.call('ZSCORE', k_room, member) then
  return 0
end
redis.call('ZADD', k_room, now + keep, member)
redis.call('PEXPIRE', k_room, keep)
return 1
`)

// reservation is room held in a vendor's queue_limit by an enqueue
// under way.
type reservation struct {
	vendor, member string
}

// reserve holds room for n calls in vendor's queue_limit, or says
// ErrQueueFull. The room is reserved first and the queue counted after,
// so that of two enqueues side by side the later to reserve sees the
// other's calls, reserved or already queued (an enqueue's own calls can
// count twice while it runs: a refusal errs on the side of the limit). A
// vendor without a queue_limit reserves nothing (nil).
func (c *Client) reserve(ctx context.Context, v Vendor, n int) (*reservation, error) {
	if v.QueueLimit <= 0 || n == 0 {
		return nil, nil
	}
	var token [8]byte
	_, _ = rand.Read(token[:])
	r := &reservation{vendor: v.Name, member: hex.EncodeToString(token[:]) + ":" + strconv.Itoa(n)}
	held, err := redisonce.Run(ctx, c.rdb, reserveScript, []string{roomKey(c.cfg.KeyPrefix, v.Name)}, r.member, n, roomKeep.Milliseconds()).Int64()
	if err != nil {
		return nil, fmt.Errorf("queue: reserve room on %s: %w", v.Name, err)
	}
	waiting, err := c.Waiting(ctx, v.Name)
	if err != nil {
		c.release(ctx, r)
		return nil, err
	}
	if waiting+held > int64(v.QueueLimit) {
		c.release(ctx, r)
		others := held - int64(n)
		return nil, fmt.Errorf("%w: %s has %d of %d (queue_limit) waiting and %d being queued by other requests, and %d more do not fit; wait for the queue to drain or raise queue_limit",
			ErrQueueFull, v.Name, waiting, v.QueueLimit, others, n)
	}
	return r, nil
}

// renew keeps r for another roomKeep (a long batch, between chunks).
func (c *Client) renew(ctx context.Context, r *reservation) error {
	if r == nil {
		return nil
	}
	ok, err := redisonce.Run(ctx, c.rdb, renewScript, []string{roomKey(c.cfg.KeyPrefix, r.vendor)}, r.member, roomKeep.Milliseconds()).Int64()
	if err != nil {
		return fmt.Errorf("queue: renew room on %s: %w", r.vendor, err)
	}
	if ok == 0 {
		return fmt.Errorf("queue: the room reserved on %s lapsed (queueing took over %s); the calls not queued yet were not", r.vendor, roomKeep)
	}
	return nil
}

// release gives r back. It runs even when ctx is done.
func (c *Client) release(ctx context.Context, r *reservation) {
	if r == nil {
		return
	}
	ctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 5*time.Second)
	defer cancel()
	_ = c.rdb.ZRem(ctx, roomKey(c.cfg.KeyPrefix, r.vendor), r.member).Err()
}
