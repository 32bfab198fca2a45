package shaper

import (
	"context"
	"fmt"
	"strconv"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/shaper-dev/shaper/internal/gatehook"
)

// tagKeep is how long a tag stays in a bucket's record after its tick:
// long enough for a job runner to see that a worker died (seconds) and to
// find a call under a lease nobody renews (queue's stall sweep, 15 s
// after the last renewal) while its grant is still in the record; short
// enough that the record is half a minute of grants at most, whatever
// the backlog.
const tagKeep = 30 * time.Second

// tagged returns the tags of the calls granted a tick after after (Redis
// time), oldest tick first, whichever replica granted them. A tag leaves
// the record 30 s after its tick, or at Untag; a tag granted again keeps
// its latest tick (gatehook.Tagged).
func (b *Bucket) tagged(ctx context.Context, after time.Time) ([]gatehook.Tag, error) {
	zs, err := b.gate.rdb.ZRangeByScoreWithScores(ctx, b.keys.tags, &redis.ZRangeBy{
		Min: "(" + strconv.FormatInt(after.UnixMicro(), 10), Max: "+inf"}).Result()
	if err != nil {
		return nil, fmt.Errorf("shaper: tags of %q: %w", b.name, unavailable(ctx, err))
	}
	out := make([]gatehook.Tag, 0, len(zs))
	for _, z := range zs {
		tag, _ := z.Member.(string)
		out = append(out, gatehook.Tag{Tag: tag, Tick: time.UnixMicro(int64(z.Score))})
	}
	return out, nil
}

// untag takes tags out of the bucket's record (gatehook.Untag).
func (b *Bucket) untag(ctx context.Context, tags ...string) error {
	if len(tags) == 0 {
		return nil
	}
	members := make([]any, len(tags))
	for i, t := range tags {
		members[i] = t
	}
	if err := b.gate.rdb.ZRem(ctx, b.keys.tags, members...).Err(); err != nil {
		return fmt.Errorf("shaper: untag calls of %q: %w", b.name, unavailable(ctx, err))
	}
	return nil
}
