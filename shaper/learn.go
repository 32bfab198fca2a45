package shaper

import (
	"context"
	"fmt"
	"strconv"
	"time"

	"github.com/redis/go-redis/v9"
)

// learnKeep is how long what a bucket learned from rate-limited answers
// outlives the last of them: a worker restart or a short idle keeps it,
// and it is forgotten once the vendor has been quiet that long (and the
// configured rate tried again).
const learnKeep = 10 * time.Minute

// Lesson is what a rate-limited answer taught a bucket (see
// Control.RateLimited).
type Lesson int

const (
	// LessonNone: the answer came within a window of the last lesson (a
	// call already on its way), or carried too little to judge.
	LessonNone Lesson = iota
	// LessonRate: too many calls in a window; the effective rate was
	// lowered to what the vendor accepted.
	LessonRate
	// LessonMargin: refused while the bucket sent no faster than its
	// spacing (network jitter bunched calls up, or the vendor enforces a
	// minimum gap): the guard was widened, and start times tightened.
	LessonMargin
)

func (l Lesson) String() string {
	switch l {
	case LessonRate:
		return "rate"
	case LessonMargin:
		return "margin"
	}
	return "none"
}

// Learned is the outcome of Control.RateLimited.
type Learned struct {
	// Lesson is what this answer taught; InForce the last lesson, which
	// this one repeats when it taught nothing new.
	Lesson, InForce Lesson
	Rate            float64       // the effective rate after it (calls per primary window)
	Guard           time.Duration // the guard in force after it
	Reason          string
}

// marginTolerance is the start tolerance once a margin was learned: a
// vendor that refuses calls closer than its spacing also refuses a late
// call followed by one on time.
const marginTolerance = 3 * time.Millisecond

// recordScript records a rate-limited answer and, unless one was judged
// within the cooldown, claims the judgement of it.
//
// KEYS[1] control hash, KEYS[2] ticks list, KEYS[3] limited list.
// ARGV[1] Redis time override (µs; 0: TIME), ARGV[2] the refused call's
// tick (µs; 0: unknown), ARGV[3] cooldown (µs), ARGV[4] learnKeep (µs).
// Returns {0, last lesson} within the cooldown of a rate lesson; else
// {1 (claimed) or 2 (within a margin lesson's cooldown, not claimed),
// last lesson, rate, guard, lo, ticks, limited, the last lesson's tick}.
var recordScript = redis.NewScript(nowLua + extendLua + `
local now = now_us()
if ARGV[2] ~= '0' then
  redis.call('LREM', KEYS[2], 1, ARGV[2])
  redis.call('LPUSH', KEYS[3], ARGV[2])
  redis.call('LTRIM', KEYS[3], 0, 31)
  extend(KEYS[3], now + tonumber(ARGV[4]), now)
end
redis.call('HSET', KEYS[1], 'last_throttle', string.format('%d', now))
extend(KEYS[1], now + tonumber(ARGV[4]), now)
local c = redis.call('HMGET', KEYS[1], 'last_decrease', 'lesson', 'rate', 'guard', 'lo', 'lesson_tick')
local mode = 1
if now - (tonumber(c[1]) or 0) < tonumber(ARGV[3]) then
  if c[2] ~= 'margin' then return {0, c[2] or ''} end
  mode = 2
else
  redis.call('HSET', KEYS[1], 'last_decrease', string.format('%d', now))
end
return {mode, c[2] or '', c[3] or '', c[4] or '', c[5] or '', redis.call('LRANGE', KEYS[2], 0, -1),
  redis.call('LRANGE', KEYS[3], 0, -1), c[6] or ''}
`)

// teachScript writes a lesson into the control hash (and when it was
// learned, which starts its cooldown).
//
// KEYS[1] control hash. ARGV[1] Redis time override (µs; 0: TIME),
// ARGV[2] learnKeep (µs), ARGV[3...] field, value pairs. Returns 0.
var teachScript = redis.NewScript(nowLua + extendLua + `
local now = now_us()
redis.call('HSET', KEYS[1], 'last_change', string.format('%d', now), 'last_decrease', string.format('%d', now), unpack(ARGV, 3))
extend(KEYS[1], now + tonumber(ARGV[2]), now)
return 0
`)

// Refusal describes a rate-limited answer that announced no limit.
type Refusal struct {
	// Reason says what the vendor answered, for the stats ("HTTP 429").
	Reason string
	// RetryAfter is whether the answer said when to come back.
	RetryAfter bool
	// Jitter is the spread of recent round trips to the vendor (longest
	// less shortest): how far the network may bunch calls up.
	Jitter time.Duration
}

// marginEscalation is how many refusals within a window of a margin
// lesson, with fewer than twice as many calls accepted among them, show
// that the margin was not the answer (a cold start's new connections can
// bunch three or four calls up).
const marginEscalation = 5

// RateLimited records that the vendor refused the call of permit p
// without announcing its limit, and learns from it, for every replica:
// the ticks granted lately (kept in Redis as they are granted, refused
// and given-up ones taken out) tell how many calls the vendor accepted
// before it refused one (see judge).
//
//   - Too many calls in a window: the effective rate becomes the limit
//     the vendor showed (at most a halving), and is not raised again
//     before the adaptation's Probe period; the guard grows by a quarter
//     (shaping now runs at the vendor's very edge).
//   - Calls too close together (refused at the full spacing): the rate is
//     not what was wrong (calls the network bunched up by up to
//     r.Jitter, or a vendor that refuses calls closer than its spacing).
//     The guard widens (x1.5, or to Jitter + 2 ms when more, at most a
//     tenth of the window) and calls start within 3 ms of their tick. Three more refusals within a window, with fewer than twice as
//     many calls accepted among them, show it was the rate after all, and
//     so do refusals of more than one call in twenty once the margin is at
//     its cap (fewer are left alone: each costs one call, no pause).
//
// Other refusals within a window + guard of the last lesson teach nothing
// new (calls already on their way). p may be nil (the refused call is
// then unknown, and the rate is cut by Decrease). Callers pause the bucket
// as the answer asks (Retry-After); a lowered rate wants the old ticks
// dropped (a pause of Horizon), a margin wants a Respace.
func (c *Control) RateLimited(ctx context.Context, p *Permit, r Refusal) (Learned, error) {
	b := c.b
	a := b.policy.Adapt.withDefaults()
	primary := b.policy.Limits[0]
	w := primary.Window.Microseconds()
	cooldown := primary.Window + b.policy.Guard
	var tick int64
	if p != nil {
		tick = p.at
	}
	res, err := recordScript.Run(ctx, b.gate.rdb, []string{b.keys.control, b.keys.ticks, b.keys.limited}, b.gate.redisNow(),
		strconv.FormatInt(tick, 10), cooldown.Microseconds(), learnKeep.Microseconds()).Slice()
	if err != nil {
		return Learned{}, fmt.Errorf("shaper: learn from a rate-limited answer of %q: %w", b.name, err)
	}
	if len(res) < 2 {
		return Learned{}, fmt.Errorf("shaper: learn from a rate-limited answer of %q: unexpected reply %v", b.name, res)
	}
	out := Learned{InForce: parseLesson(res[1])}
	mode, _ := res[0].(int64)
	if mode == 0 || len(res) < 8 {
		return out, nil
	}
	cfg := c.configured()
	cur := parseFloat(res[2], cfg)
	guard := max(time.Duration(parseFloat(res[3], 0))*time.Microsecond, b.policy.Guard)
	quiet := parseFloat(res[4], 0)
	ticks, limited := parseInts(res[5]), parseInts(res[6])
	lessonTick := int64(parseFloat(res[7], 0))
	if tick == 0 && len(limited) > 0 {
		tick = limited[0]
	}
	complete := len(ticks) < b.tickLog()
	// What the current spacing puts in a window.
	iv, burst := tickFor(b.policy.Limits, b.policy.Burst, guard, cur)
	full := EffectiveRate(iv, burst, primary.Window)
	v, rate, shown := tooFast, cur*a.Decrease, -1
	switch {
	case mode == 2:
		// Within a window of a margin lesson: refusals that go on say the
		// rate is what is wrong.
		// The last refusals since the lesson, and the calls accepted
		// among them: a vendor over its window limit refuses every call
		// until the window ends (a token bucket every other one); calls
		// the network bunched up are refused here and there among
		// accepted ones.
		var recent []int64
		for _, x := range limited {
			if x > lessonTick && x <= tick {
				recent = append(recent, x)
			}
		}
		recent = sortedWithin(recent, tick-w, tick+1)
		if tick == 0 || len(recent) < marginEscalation {
			return out, nil
		}
		from, accepted := recent[len(recent)-marginEscalation], 0
		for _, x := range ticks {
			if x > from && x < tick {
				accepted++
			}
		}
		if accepted >= 2*marginEscalation {
			return out, nil
		}
		rate, shown, _ = lowerTo(ticks, limited, tick, w, complete, cur)
		guard = b.policy.Guard // the margin was not the answer: undone below
	case tick > 0:
		again := out.InForce == LessonMargin && tick-lessonTick < 3*w
		v, rate, shown = judge(ticks, limited, tick, w, complete, cur, full, r.RetryAfter, again)
	}
	limit := primary.Window / 10
	if v == tooClose && out.InForce == LessonMargin && mode == 1 &&
		len(sortedWithin(limited, tick-w, tick+1)) <= max(1, slidingCount(ticks, tick, w)/50) {
		// A margin was learned and refusals stay rare (one call in fifty
		// or fewer in the last window): each costs that call and no
		// pause, less than a wider margin would.
		return out, nil
	}
	if v == tooClose && guard >= limit {
		// The margin is spent. Refusals now and then among accepted
		// calls (a vendor that stalls, a network that bunches calls up
		// by more than any margin) are left alone: each costs one call
		// and no pause. Frequent ones say it is the rate.
		// So are bursts of them from a vendor without Retry-After (nginx
		// limit_req, whose own scheduling delays stamp calls late) that
		// accepted a full window at the current spacing lately: a rate
		// cut would not stop them, and each costs one call.
		refused, accepted := len(sortedWithin(limited, tick-w, tick+1)), slidingCount(ticks, tick, w)
		bursty := !r.RetryAfter && float64(refused) <= 0.2*float64(refused+accepted) && float64(mostInWindow(ticks, w)) >= 0.95*full-1
		if bursty || float64(refused) <= max(1, 0.05*float64(refused+accepted)) {
			// A spacing refusal (no pause beyond Retry-After), and the
			// ones within its cooldown too.
			out.InForce = LessonMargin
			if err := teachScript.Run(ctx, b.gate.rdb, []string{b.keys.control}, b.gate.redisNow(), learnKeep.Microseconds(),
				"lesson", "margin", "lesson_tick", strconv.FormatInt(tick, 10)).Err(); err != nil {
				return out, fmt.Errorf("shaper: learn from a rate-limited answer of %q: %w", b.name, err)
			}
			return out, nil
		}
		v, rate = tooFast, cur*a.Decrease
	}
	at := strconv.FormatInt(tick, 10)
	switch v {
	case tooFast:
		rate = max(rate, cfg*a.Floor)
		if quiet > rate && quiet < cur {
			rate = quiet // a rate that stayed quiet since the limit last moved
		}
		// Shaping now runs at the vendor's very edge: a quarter more
		// margin for calls that start late or travel slowly.
		g := max(guard, b.policy.Guard*5/4)
		out.Lesson, out.Rate, out.Guard = LessonRate, rate, g
		out.Reason = fmt.Sprintf("%s: rate lowered to %.4g per %s", r.Reason, rate, primary.Window)
		if shown >= 0 {
			out.Reason += fmt.Sprintf(" (the vendor accepted %d calls in a window before refusing one)", shown)
		}
		err = teachScript.Run(ctx, b.gate.rdb, []string{b.keys.control}, b.gate.redisNow(), learnKeep.Microseconds(),
			"rate", strconv.FormatFloat(rate, 'f', -1, 64), "hi", strconv.FormatFloat(rate, 'f', -1, 64),
			"rate_reason", out.Reason, "rate_source", "learned", "lesson", "rate", "guard", g.Microseconds(),
			"tol", 0, "guard_reason", "", "lesson_tick", at).Err()
	case tooClose:
		g := min(max(guard*3/2, r.Jitter+2*time.Millisecond), limit)
		out.Lesson, out.Rate, out.Guard = LessonMargin, cur, g
		out.Reason = fmt.Sprintf("%s at the full spacing: guard widened to %s (network jitter %s, or a vendor that enforces spacing)",
			r.Reason, g.Round(100*time.Microsecond), r.Jitter.Round(time.Millisecond))
		err = teachScript.Run(ctx, b.gate.rdb, []string{b.keys.control}, b.gate.redisNow(), learnKeep.Microseconds(),
			"guard", g.Microseconds(), "tol", marginTolerance.Microseconds(), "guard_reason", out.Reason, "lesson", "margin",
			"lesson_tick", at).Err()
	}
	if err != nil {
		return Learned{}, fmt.Errorf("shaper: learn from a rate-limited answer of %q: %w", b.name, err)
	}
	out.InForce = out.Lesson
	return out, nil
}

func parseLesson(v any) Lesson {
	switch v {
	case "rate":
		return LessonRate
	case "margin":
		return LessonMargin
	}
	return LessonNone
}

func parseFloat(v any, def float64) float64 {
	s, _ := v.(string)
	f, err := strconv.ParseFloat(s, 64)
	if err != nil {
		return def
	}
	return f
}

func parseInts(v any) []int64 {
	xs, _ := v.([]any)
	out := make([]int64, 0, len(xs))
	for _, x := range xs {
		s, _ := x.(string)
		if n, err := strconv.ParseInt(s, 10, 64); err == nil {
			out = append(out, n)
		}
	}
	return out
}
