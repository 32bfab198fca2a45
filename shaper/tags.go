package shaper

import (
	"context"
	"fmt"
	"slices"
	"strconv"
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
