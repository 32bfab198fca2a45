package shaper

import (
	"context"
	"fmt"
	"strconv"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/shaper-dev/shaper/internal/redisonce"
)

// The line (G3 across replicas). A bucket grants ticks up to its
// horizon to whoever asks first; with a backlog beyond the horizon, the
// callers told to come back would otherwise come back in a race, and a
// replica that took a run of calls from the queue early (calls 0-200 to
// one, 200-400 to the next) would have its late calls granted beside
// another's early ones. So while a bucket has such a backlog, callers
// that know their call's place in the queue (Request.Order) line up in
// Redis, sorted by it, and only the first lineAdmit of the line ask the
// gate; the others wait, each for about as long as the calls ahead of it
// take at the bucket's rate, and ask the line again. A caller leaves the
// line once granted a tick. A caller that does not come back when due
// (its worker died, or it ended) is dropped from the line; one that comes
// back later takes its place again, by its order.
//
// The line costs nothing without a backlog: a process sends its callers
// to it only for lineLinger after one of them was told the bucket's next
// free tick is beyond the horizon, or had its tick dropped (a pause, a
// respace, a late wake-up), when every replica's callers ask again at
// once.

const (
	// lineLinger is how long after a backlog answer a process keeps
	// sending its callers through the line.
	lineLinger = 2 * time.Second
	// lineAdmitFor sizes lineAdmit: the first callers of the line that
	// may ask the gate are its ticks in lineAdmitFor, at least
	// lineAdmitMin. Calls granted in one batch keep their order; callers
	// asking side by side may pass each other, by at most lineAdmit, and
	// one of them stalled (a busy machine) is passed by those admitted
	// while it stalls: the fewer at once, the fewer. With 4 at 100/s
	// (50 ms, at least 4), make bench-order beside two CPU-bound
	// processes moved 1.4-2.0% of calls more than 5 places; with 2
	// (20 ms, at least 2), 0.1-0.3%, at the same rate.
	lineAdmitFor = 20 * time.Millisecond
	lineAdmitMin = 2
	// lineGrace is how late after its due moment a caller in line may ask
	// again and still hold its place (a caller that asks later takes it
	// back by its order).
	lineGrace = 500 * time.Millisecond
	// lineSettle is how long callers admitted from the line wait before
	// they ask the gate when many join it at once: after a drop or a
	// pause, callers of every replica come back together (a respace is
	// heard a Pub/Sub message later), and when a process starts on a
	// bucket, its callers took a run of calls from the queue together;
	// those a moment late must find their place before the head is
	// granted (within respaceSlack, before the first tick at the new
	// spacing).
	lineSettle = 100 * time.Millisecond
	// lineMemory is how long a process that saw a bucket's line looks
	// for it again (every lineRecheck at most) before its callers ask the
	// gate directly: a replica whose callers all left while its queue
	// was paused would otherwise have its next ones take the ticks the
	// line's head is about to ask for.
	lineMemory  = time.Minute
	lineRecheck = 100 * time.Millisecond
	// lineHorizon is the horizon of a caller that knows its place (see
	// Request.Horizon), admitted from the line or asking before one
	// formed: a tick given up late costs one call (its process's newest
	// holder, or itself) a move of at most lineHorizon's worth of calls,
	// and the first callers of a backlog, who ask in the order their
	// workers took them, pass each other by at most as many. It still
	// covers a stall of a quarter second of the callers that ask.
	lineHorizon = 250 * time.Millisecond
	// lineTicks is the least ticks of its bucket that horizon holds: a
	// slow bucket (an account at 5/s, a tick of 200 ms) keeps a few
	// ticks ahead, not one, or its calls cost a round trip of deferral
	// each and leave ticks unused (200 accounts x 25 calls at 5/s, 3
	// workers: 80% of the allowance, 2.05 gate round trips a call, where
	// the policy's horizon gave 98% and 1.00).
	lineTicks = 4
	// lineStagger: the callers admitted together ask an interval over
	// lineStagger apart, in the line's order.
	lineStagger = 8
	// lineMaxSleep bounds a caller's wait between two asks of the line.
	lineMaxSleep = time.Second
	// lineKeep is how long the line's keys outlive its last ask.
	lineKeep = 10 * time.Second
	// lineGoneKeep is how long a call that left the line for not coming
	// back is remembered (a live worker gives a dead one's back sooner).
	lineGoneKeep = time.Minute
)

// lineScript puts a caller in its bucket's line (or refreshes its place)
// and says whether it may ask the gate now.
//
// A call that did not come back when due leaves the line for lineGone
// (call -> when, µs), kept for lineGoneKeep: its worker may have died,
// and a live one gives it back to its queue from there (Bucket.lined).
//
// KEYS[1] line (call -> order), KEYS[2] lineDue (call -> due, µs),
// KEYS[3] lineGone.
// ARGV[1] Redis time override (µs; 0: TIME), ARGV[2] the call, ARGV[3]
// its order, ARGV[4] how many at the head may ask the gate (admit),
// ARGV[5] the bucket's interval (µs), ARGV[6] grace (µs), ARGV[7] the
// longest sleep (µs), ARGV[8] the keys' expiry (ms), ARGV[9] how long
// lineGone keeps a call (µs).
// Returns {rank, sleep}: its rank in line (0 first); sleep 0 when rank <
// admit (ask the gate now), else how long to wait before asking the line
// again (µs).
var lineScript = redis.NewScript(nowLua + `
local k_line = KEYS[1]
local k_due = KEYS[2]
local k_gone = KEYS[3]
local a_call = ARGV[2]
local a_order = tonumber(ARGV[3])
local a_admit = tonumber(ARGV[4])
local a_interval = tonumber(ARGV[5])
local a_grace = tonumber(ARGV[6])
local a_max_sleep = tonumber(ARGV[7])
local a_keep = tonumber(ARGV[8])
local a_gone_keep = tonumber(ARGV[9])
local now = now_us()
local gone = redis.call('ZRANGEBYSCORE', k_due, '-inf', '(' .. string.format('%d', now), 'LIMIT', 0, 500)
if #gone > 0 then
  redis.call('ZREM', k_line, unpack(gone))
  redis.call('ZREM', k_due, unpack(gone))
  for _, m in ipairs(gone) do redis.call('ZADD', k_gone, string.format('%d', now), m) end
  redis.call('ZREMRANGEBYSCORE', k_gone, '-inf', '(' .. string.format('%d', now - a_gone_keep))
  redis.call('PEXPIRE', k_gone, math.ceil(a_gone_keep / 1000))
end
redis.call('ZREM', k_gone, a_call)
redis.call('ZADD', k_line, a_order, a_call)
local rank = redis.call('ZRANK', k_line, a_call)
local sleep = 0
if rank >= a_admit then
  sleep = math.min(a_max_sleep, math.floor((rank - a_admit + 1) * a_interval * 0.8))
end
redis.call('ZADD', k_due, string.format('%d', now + sleep + a_grace), a_call)
redis.call('PEXPIRE', k_line, a_keep)
redis.call('PEXPIRE', k_due, a_keep)
return {rank, sleep}
`)

// lineAdmit is how many callers at the head of the line may ask the
// gate: its ticks in lineAdmitFor, at least lineAdmitMin.
func lineAdmit(iv time.Duration, burst int) int {
	if iv <= 0 {
		return lineAdmitMin
	}
	return max(lineAdmitMin, int(int64(lineAdmitFor)*int64(max(burst, 1))/int64(iv)))
}

// lineMember is the caller's name in the line: its tag (the job runner's
// worker and call), else one unique to the process's gate.
func (b *Bucket) lineMember(req Request) string {
	if req.Tag != "" {
		return req.Tag
	}
	return b.gate.replica + "|" + strconv.FormatInt(b.gate.inLineSeq.Add(1), 10)
}

// inLine reports whether the process sends the bucket's callers through
// the line now: a backlog or a drop was seen within lineLinger, or more
// of its callers are asking than the line admits at once (a run of calls
// taken from the queue together, which would otherwise be granted in
// the order they happen to ask); or whether it must look (check): the
// process saw the bucket's line within lineMemory but not lately, and a
// line may have formed meanwhile (its callers left while the queue was
// paused, and the other replicas' callers wait in line).
func (b *Bucket) inLine(l *local, now time.Time) (in, check bool) {
	iv, burst, _, _ := b.spacing()
	g := b.gate
	g.mu.Lock()
	defer g.mu.Unlock()
	if now.Before(l.lineUntil) || l.callers-len(l.holding) > lineAdmit(iv, burst) {
		return true, false
	}
	seen, ok := g.lineSeen[b.name]
	return false, ok && now.Sub(seen) < lineMemory && now.Sub(l.lineChecked) >= lineRecheck
}

// lineUp makes the process send the bucket's callers through the line
// for lineLinger from now.
func (g *Gate) lineUp(l *local, name string, now time.Time) {
	g.mu.Lock()
	defer g.mu.Unlock()
	g.lineUpLocked(l, name, now)
}

// lineUpLocked is lineUp with g.mu held, from the moment from.
func (g *Gate) lineUpLocked(l *local, name string, from time.Time) {
	if until := from.Add(lineLinger); until.After(l.lineUntil) {
		l.lineUntil = until
	}
	g.sawLine(name, from)
}

// lineAfterDrop: the bucket's holders lost their ticks at now to a
// pause or a respace, and ask again from until, together, in the line;
// the admitted wait lineSettle for them to find their places. g.mu is
// held.
func (g *Gate) lineAfterDrop(l *local, name string, now, until time.Time) {
	l.settleUntil = now.Add(lineSettle)
	g.lineUpLocked(l, name, until)
}

// sawLine records that bucket name had a line at now, forgetting the
// buckets whose line was seen longer than lineMemory ago. g.mu is held.
func (g *Gate) sawLine(name string, now time.Time) {
	if g.lineSeen == nil {
		g.lineSeen = map[string]time.Time{}
	}
	if _, ok := g.lineSeen[name]; !ok && len(g.lineSeen) >= 64 {
		for k, t := range g.lineSeen {
			if now.Sub(t) >= lineMemory {
				delete(g.lineSeen, k)
			}
		}
	}
	g.lineSeen[name] = now
}

// settling is how long callers admitted from the bucket's line wait
// before they ask: the rest of lineSettle after a drop.
func (g *Gate) settling(l *local, now time.Time) time.Duration {
	g.mu.Lock()
	defer g.mu.Unlock()
	return l.settleUntil.Sub(now)
}

// lookForLine asks Redis whether the bucket has callers in line, and
// sends the process's callers to it if so.
func (b *Bucket) lookForLine(ctx context.Context, l *local) (bool, error) {
	n, err := b.gate.rdb.ZCard(ctx, b.keys.line).Result()
	if err != nil {
		return false, fmt.Errorf("shaper: line of %q: %w", b.name, unavailable(ctx, err))
	}
	now := b.gate.clock.Now()
	b.gate.mu.Lock()
	l.lineChecked = now
	b.gate.mu.Unlock()
	if n > 0 {
		b.gate.lineUp(l, b.name, now)
	}
	return n > 0, nil
}

// waitInLine puts the caller in the bucket's line and returns once it is
// among the first lineAdmit, telling req.Backlogged once when its place
// is further than maxWait.
// It returns the caller's rank among those admitted.
func (b *Bucket) waitInLine(ctx context.Context, l *local, req Request, member string, told *bool) (int, error) {
	for {
		// Spaced by the newest handle: a respace may come while it waits.
		iv, burst, _, _ := b.gate.currentOf(l, b).spacing()
		admit := lineAdmit(iv, burst)
		// While callers wait in line, the process's new callers join it.
		b.gate.lineUp(l, b.name, b.gate.clock.Now())
		res, err := redisonce.Run(ctx, b.gate.rdb, lineScript, []string{b.keys.line, b.keys.lineDue, b.keys.lineGone}, b.gate.redisNow(), member, req.Order,
			admit, iv.Microseconds(), lineGrace.Microseconds(), lineMaxSleep.Microseconds(), lineKeep.Milliseconds(), lineGoneKeep.Microseconds()).Int64Slice()
		if err != nil {
			return 0, fmt.Errorf("shaper: line of %q: %w", b.name, unavailable(ctx, err))
		}
		rank, sleep := res[0], time.Duration(res[1])*time.Microsecond
		if rank < int64(admit) {
			return int(rank), nil
		}
		ahead := time.Duration(rank-int64(admit)+1) * iv / time.Duration(max(burst, 1))
		if req.MaxWait > 0 && ahead > req.MaxWait && req.Backlogged != nil && !*told {
			*told = true
			req.Backlogged(ahead)
		}
		if req.Waited != nil {
			req.Waited(Wait{For: sleep, Binding: BoundBacklog})
		}
		if err := b.gate.clock.Sleep(ctx, sleep); err != nil {
			return 0, err
		}
	}
}

// leaveLine takes the caller out of the bucket's line.
func (b *Bucket) leaveLine(ctx context.Context, member string) error {
	_, err := b.gate.rdb.Pipelined(ctx, func(p redis.Pipeliner) error {
		p.ZRem(ctx, b.keys.line, member)
		p.ZRem(ctx, b.keys.lineDue, member)
		return nil
	})
	if err != nil {
		return fmt.Errorf("shaper: leave the line of %q: %w", b.name, unavailable(ctx, err))
	}
	return nil
}

// lined returns the members (Request.Tag, where set) of the calls
// waiting in the bucket's line: calls not granted a tick, which a job
// runner may give back when the worker that holds them died.
//
// It counts those that left the line lately for not coming back when due
// (their callers may have died).
func (b *Bucket) lined(ctx context.Context) ([]string, error) {
	var in, gone *redis.StringSliceCmd
	_, err := b.gate.rdb.Pipelined(ctx, func(p redis.Pipeliner) error {
		in = p.ZRange(ctx, b.keys.line, 0, -1)
		gone = p.ZRange(ctx, b.keys.lineGone, 0, -1)
		return nil
	})
	if err != nil {
		return nil, fmt.Errorf("shaper: line of %q: %w", b.name, unavailable(ctx, err))
	}
	return append(in.Val(), gone.Val()...), nil
}

// unline takes members out of the bucket's line (gatehook.Unline).
func (b *Bucket) unline(ctx context.Context, members ...string) error {
	if len(members) == 0 {
		return nil
	}
	_, err := b.gate.rdb.Pipelined(ctx, func(p redis.Pipeliner) error {
		for _, m := range members {
			p.ZRem(ctx, b.keys.line, m)
			p.ZRem(ctx, b.keys.lineDue, m)
			p.ZRem(ctx, b.keys.lineGone, m)
		}
		return nil
	})
	if err != nil {
		return fmt.Errorf("shaper: take calls out of the line of %q: %w", b.name, unavailable(ctx, err))
	}
	return nil
}
