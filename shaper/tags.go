package shaper

import (
	"context"
	"fmt"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/shaper-dev/shaper/internal/gatehook"
	"github.com/shaper-dev/shaper/internal/redisonce"
)

// tagKeep is how long a tag stays in a bucket's record after its tick:
// long enough for a job runner to see that a worker died (seconds) and to
// find a call under a lease nobody renews (queue's stall sweep, 15 s
// after the last renewal) while its grant is still in the record; short
// enough that the record is half a minute of grants at most, whatever
// the backlog.
const tagKeep = 30 * time.Second

// The record of tags is the bucket's group's tags key: a sorted set of
// tags scored by their ticks (ZADD; a tag granted again keeps its latest
// tick), or, where a bucket keeps its holders' tags in its ticks list
// (held_item), that list, newest first. The readers read either.

// taggedScript returns the record's tags whose latest tick is after
// ARGV[1] (µs) and less than ARGV[2] (µs, tagKeep) old, as tag, tick
// pairs (any order): a list keeps older ones until it trims them (see
// log_ticks).
//
// KEYS[1] the tags key. ARGV[1] after, ARGV[2] tag_keep (µs), ARGV[3]
// Redis time override (µs; 0: TIME).
var taggedScript = redis.NewScript(nowFromLua + formLua + heldLua + itemLua + `
local k_tags, a_after = KEYS[1], math.max(tonumber(ARGV[1]), now_from(ARGV[3] + 0) - ARGV[2])
local kind = redis.call('TYPE', k_tags)
if type(kind) == 'table' then kind = kind.ok end
if kind == 'zset' then return redis.call('ZRANGEBYSCORE', k_tags, '(' .. string.format('%d', a_after), '+inf', 'WITHSCORES') end
if kind ~= 'list' then return {} end
local out, seen = {}, {}
for _, item in ipairs(redis.call('LRANGE', k_tags, 0, -1)) do
  local t, tag = read_item(item)
  if tag ~= '' and not seen[tag] then
    seen[tag] = true
    if t and t > a_after then
      local n = #out
      out[n + 1], out[n + 2] = tag, string.format('%d', t)
    end
  end
end
return out
`)

// untagScript takes the tags ARGV out of the record: their entries of
// the set, or the list's items that name them (their ticks with them:
// recover gives such calls back, so they did not start).
//
// KEYS[1] the tags key. ARGV the tags. Returns how many went.
var untagScript = redis.NewScript(formLua + heldLua + itemLua + `
local k_tags = KEYS[1]
local kind = redis.call('TYPE', k_tags)
if type(kind) == 'table' then kind = kind.ok end
if kind == 'zset' then return redis.call('ZREM', k_tags, unpack(ARGV)) end
if kind ~= 'list' then return 0 end
local drop, n = {}, 0
for _, tag in ipairs(ARGV) do drop[tag] = true end
for _, item in ipairs(redis.call('LRANGE', k_tags, 0, -1)) do
  local _, tag = read_item(item)
  if drop[tag] then n = n + redis.call('LREM', k_tags, 1, item) end
end
return n
`)

// toSetScript turns a group of one's list at the tags key (its ticks,
// with its holders' tags, layout 4) into the set a group of accounts of
// the same name keeps there: each tag with its latest tick. The ticks no
// tag holds go (they were the group of one's judge's view: a rate-limited
// answer of that bucket is then judged on fewer ticks). The set keeps the
// list's expiry; a set, or no key, is left as it is.
//
// KEYS[1] the tags key. Returns how many tags the set got.
var toSetScript = redis.NewScript(formLua + heldLua + itemLua + `
local k_tags = KEYS[1]
local kind = redis.call('TYPE', k_tags)
if type(kind) == 'table' then kind = kind.ok end
if kind ~= 'list' then return 0 end
local latest, n = {}, 0
for _, item in ipairs(redis.call('LRANGE', k_tags, 0, -1)) do
  local t, tag = read_item(item)
  if t and tag ~= '' and (latest[tag] == nil or t > latest[tag]) then
    if latest[tag] == nil then n = n + 1 end
    latest[tag] = t
  end
end
local ttl = redis.call('PTTL', k_tags)
redis.call('DEL', k_tags)
local part = {}
for tag, t in pairs(latest) do
  part[#part + 1], part[#part + 2] = string.format('%d', t), tag
  if #part >= 1000 then redis.call('ZADD', k_tags, unpack(part)); part = {} end
end
if #part > 0 then redis.call('ZADD', k_tags, unpack(part)) end
if n > 0 and ttl > 0 then redis.call('PEXPIRE', k_tags, ttl) end
return n
`)

// toListScript turns the set of a group of accounts at the tags key into
// the list a group of one of the same name keeps there (convert_tags),
// with the ticks list the group of one kept before layout 4 (KEYS[2]).
//
// KEYS[1] the tags key, KEYS[2] the group of one's old ticks list.
// ARGV[1] keep (µs), ARGV[2] Redis time override (µs; 0: TIME).
var toListScript = redis.NewScript(nowFromLua + formLua + heldLua + itemLua + extendLua + convertLua + `
convert_tags(KEYS[1], KEYS[2], tonumber(ARGV[1]), now_from(ARGV[2] + 0))
return 0
`)

// Where a grant finds the tags key in the other form, it is a group of
// one and a group of accounts of one name (a vendor's bucket and its
// accounts' buckets), each writing its own: a vendor made per_account,
// or no longer, at a reload, or replicas of both configurations side by
// side in a rollout. The grant fails (WRONGTYPE), and retag puts the key
// in the bucket's form, keeping every tag: a group of accounts always
// (its buckets share the set), a group of one at most once per tagKeep;
// in between it keeps its tags in the set, beside the accounts', and its
// ticks in its own list, as a per-account vendor's bucket does
// (gatehook.TagsInSet). Replicas of both configurations then move the
// key at most once per tagKeep, not at every grant.

// tickKeys are the bucket's keys, with its ticks in a list of their own
// while it keeps its tags in the set (see retag).
func (b *Bucket) tickKeys() bucketKeys {
	k := b.keys
	if until := b.inSetUntil.Load(); until != 0 && k.ticks == k.tags && b.gate.clock.Now().UnixNano() < until {
		k.ticks = k.oldTicks // the clock is read only for a bucket retag moved
	}
	return k
}

// isWrongType reports whether err is Redis's answer to a command on a
// key of another type.
func isWrongType(err error) bool {
	return err != nil && strings.Contains(err.Error(), "WRONGTYPE")
}

// retag puts the tags key in the form the bucket writes, after a grant
// found it in the other (see toSetScript): the grant wrote what it wrote
// before its tags (the tick it took counts, unused: the safe side), and
// is run again.
func (b *Bucket) retag(ctx context.Context) error {
	k := b.tickKeys()
	now := b.gate.clock.Now()
	switch {
	case k.ticks != k.tags:
		if err := redisonce.Run(ctx, b.gate.rdb, toSetScript, []string{k.tags}).Err(); err != nil {
			return fmt.Errorf("shaper: turn the tags of %q into a set: %w", b.name, unavailable(ctx, err))
		}
	case now.UnixNano() < b.listAgain.Load():
		b.inSetUntil.Store(now.Add(tagKeep).UnixNano())
	default:
		b.listAgain.Store(now.Add(tagKeep).UnixNano())
		if err := redisonce.Run(ctx, b.gate.rdb, toListScript, []string{k.tags, k.oldTicks}, b.keep.Microseconds(), b.gate.redisNow()).Err(); err != nil {
			return fmt.Errorf("shaper: turn the tags of %q into a list: %w", b.name, unavailable(ctx, err))
		}
	}
	return nil
}

// tagged returns the tags of the calls granted a tick after after (Redis
// time), oldest tick first, whichever replica granted them. A tag leaves
// the record 30 s after its tick, or at Untag; a tag granted again keeps
// its latest tick (gatehook.Tagged).
func (b *Bucket) tagged(ctx context.Context, after time.Time) ([]gatehook.Tag, error) {
	pairs, err := taggedScript.Run(ctx, b.gate.rdb, []string{b.keys.tags}, strconv.FormatInt(after.UnixMicro(), 10),
		tagKeep.Microseconds(), b.gate.redisNow()).StringSlice()
	if err != nil {
		return nil, fmt.Errorf("shaper: tags of %q: %w", b.name, unavailable(ctx, err))
	}
	out := make([]gatehook.Tag, 0, len(pairs)/2)
	for i := 0; i+1 < len(pairs); i += 2 {
		us, err := strconv.ParseFloat(pairs[i+1], 64)
		if err != nil {
			return nil, fmt.Errorf("shaper: tags of %q: tick %q of %q: %w", b.name, pairs[i+1], pairs[i], err)
		}
		out = append(out, gatehook.Tag{Tag: pairs[i], Tick: time.UnixMicro(int64(us))})
	}
	slices.SortStableFunc(out, func(x, y gatehook.Tag) int { return x.Tick.Compare(y.Tick) })
	return out, nil
}

// untag takes tags out of the bucket's record (gatehook.Untag).
func (b *Bucket) untag(ctx context.Context, tags ...string) error {
	for len(tags) > 0 {
		n := min(len(tags), 500)
		args := make([]any, n)
		for i, t := range tags[:n] {
			args[i] = t
		}
		if err := redisonce.Run(ctx, b.gate.rdb, untagScript, []string{b.keys.tags}, args...).Err(); err != nil {
			return fmt.Errorf("shaper: untag calls of %q: %w", b.name, unavailable(ctx, err))
		}
		tags = tags[n:]
	}
	return nil
}
