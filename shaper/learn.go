package shaper

import (
	"context"
	"fmt"
	"strconv"
	"strings"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/shaper-dev/shaper/internal/redisonce"
)

// Lesson is what a refusal taught a bucket (see Adapt and
// Control.Refused). The zero Lesson ("none") is that the belief stands.
type Lesson int

const (
	// lessonNone: the belief stands (a refusal within a window of a rate
	// lesson, a call already on its way, or one tolerated after a margin
	// lesson).
	lessonNone Lesson = iota
	// LessonRate: too many calls in a window; the effective rate was
	// lowered to what the vendor accepted.
	LessonRate
	// LessonMargin: refused at the full spacing (network jitter bunched
	// calls up, or the vendor enforces a minimum gap): the guard was
	// widened, and start times tightened.
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

// Answer is a rate-limited answer that announced no limit.
type Answer struct {
	// Reason says what the vendor answered, for the logs and stats
	// ("HTTP 429 with no announced limit").
	Reason string
	// Pause is how long the answer asks the vendor to be left alone: its
	// Retry-After, or the caller's default pause when it gave none.
	// PauseReason says why, for the stats.
	Pause       time.Duration
	PauseReason string
	// RetryAfter is whether the vendor asked for the pause itself: a
	// refusal for spacing keeps only a pause the vendor asked for.
	RetryAfter bool
	// Jitter is how far the network may bunch calls up, when the caller
	// knows more than the bucket measured: the bucket judges with the
	// larger of it and the spread of the round trips it was told of
	// (vendorclients tells it of each).
	Jitter time.Duration
}

// Decision is what Control.Refused did.
type Decision struct {
	// Lesson is what this answer taught; InForce the last lesson, which
	// this one repeats when it taught nothing new.
	Lesson, InForce Lesson
	Rate            float64       // the effective rate after it (calls per primary window); 0 when unchanged
	Guard           time.Duration // the learned guard after it; 0 when unchanged
	Pause           time.Duration // the pause in force after it; 0: none
	Respaced        bool          // the line restarted at the new spacing
	Reason          string
}

// refusedArgs is the refused script's ARGV, in order (see refusedLua).
type refusedArgs struct {
	Now         int64  `lua:"now"`          // Redis time override (µs; 0: TIME)
	Tick        string `lua:"tick_s"`       // the refused call's tick (µs; "0": unknown)
	Cooldown    int64  `lua:"cooldown"`     // a rate lesson's cooldown (µs): a window and the guard
	Keep        int64  `lua:"keep"`         // the belief outlives now by this (µs)
	Pause       int64  `lua:"pause"`        // the pause the answer asked (µs)
	PauseReason string `lua:"pause_reason"` // why, for the stats
	Channel     string `lua:"channel"`      // pause channel
	Bucket      string `lua:"bucket"`       // bucket name
	Tag         string `lua:"tag"`          // the tag the refused call's tick was recorded with ("": none)
	Log         int    `lua:"log"`          // the ticks judged: the newest Log of the ticks list (Bucket.tickLog)
}

func (a refusedArgs) argv() []any {
	return []any{a.Now, a.Tick, a.Cooldown, a.Keep, a.Pause, a.PauseReason, a.Channel, a.Bucket, a.Tag, a.Log}
}

// refusedKeyNames are the refused script's KEYS, in order.
var refusedKeyNames = []string{"control", "ticks", "limited", "stats", "gate"}

// refusedLua counts a rate-limited answer, records the refused tick,
// and either returns the evidence to judge it on or, within the cooldown
// of a rate lesson (the call was on its way before it), applies the pause
// the answer asked for and is done: most refusals cost this one round
// trip.
//
// KEYS: the bucket's control hash, ticks list, refused ticks list and
// stats hash (refusedKeyNames); ARGV: refusedArgs. Returns {0, lesson,
// pause left (µs)} within a rate lesson's cooldown; else {1 or 2 (within
// a margin lesson's cooldown), lesson, rate, guard, lo, ticks, refused
// ticks, lesson_tick, probe_at, paused_until}. The cooldown runs from
// last_decrease, when the last lesson was written (applyLua).
const refusedLua = `
local k_control = KEYS[1]
local k_ticks = KEYS[2]
local k_limited = KEYS[3]
local k_stats = KEYS[4]
local k_gate = KEYS[5]
local a_now = tonumber(ARGV[1])
local a_tick_s = ARGV[2]
local a_cooldown = tonumber(ARGV[3])
local a_keep = tonumber(ARGV[4])
local a_pause = tonumber(ARGV[5])
local a_pause_reason = ARGV[6]
local a_channel = ARGV[7]
local a_bucket = ARGV[8]
local a_tag = ARGV[9]
local a_log = tonumber(ARGV[10])
local now = now_from(a_now)
count(k_stats, 'rate_limited', now)
if a_tick_s ~= '0' then
  unsend(k_ticks, a_tick_s + 0, a_tag)
  redis.call('LPUSH', k_limited, a_tick_s)
  redis.call('LTRIM', k_limited, 0, 31)
  extend(k_limited, now + a_keep, now)
end
redis.call('HSET', k_control, 'last_throttle', string.format('%d', now))
extend(k_control, now + a_keep, now)
local last_decrease, lesson, rate, guard, lo, lesson_tick, probe_at, paused_until = unpack(redis.call('HMGET', k_control,
  'last_decrease', 'lesson', 'rate', 'guard', 'lo', 'lesson_tick', 'probe_at', 'paused_until'))
local mode = 1
if now - (tonumber(last_decrease) or 0) < a_cooldown then
  if lesson == 'rate' then
    local left = 0
    if a_pause > 0 then left = pause(k_control, k_gate, k_stats, now, a_pause, a_pause_reason, a_channel, a_bucket, a_keep) end
    return {0, lesson, left}
  end
  if lesson == 'margin' then mode = 2 end
end
local ticks = {}
for _, item in ipairs(redis.call('LRANGE', k_ticks, 0, a_log - 1)) do
  local t = tick_of(item)
  if t then ticks[#ticks + 1] = string.format('%d', t) end
end
return {mode, lesson or '', rate or '', guard or '', lo or '', ticks,
  redis.call('LRANGE', k_limited, 0, -1), lesson_tick or '', probe_at or '', paused_until or ''}
`

var refusedScript = redis.NewScript(nowLua + extendLua + minuteCounterLua + pauseLua + formLua + heldLua + itemLua + refusedLua)

// applyArgs is the apply script's ARGV, in order (see applyScript).
type applyArgs struct {
	Now       int64  `lua:"now"`        // Redis time override (µs; 0: TIME)
	Seen      string `lua:"seen"`       // the lesson_tick the judgement read ("" none): a lesson is written only if it stands
	Fields    string `lua:"fields"`     // the lesson's control fields, "name=value" joined by "\n" ("": no lesson)
	Pause     int64  `lua:"pause"`      // pause (µs; 0: none)
	Reason    string `lua:"reason"`     // why, for the stats
	Channel   string `lua:"channel"`    // pause channel
	Bucket    string `lua:"bucket"`     // bucket name
	Keep      int64  `lua:"keep"`       // the belief outlives now by this (µs)
	Respace   int64  `lua:"respace"`    // 1: restart the line at the new spacing
	Slack     int64  `lua:"slack"`      // respaceSlack (µs)
	RespaceCh string `lua:"respace_ch"` // respace channel
}

func (a applyArgs) argv() []any {
	return []any{a.Now, a.Seen, a.Fields, a.Pause, a.Reason, a.Channel, a.Bucket, a.Keep, a.Respace, a.Slack, a.RespaceCh}
}

// applyKeyNames are the apply script's KEYS, in order.
var applyKeyNames = []string{"control", "stats", "gate"}

// applyLua applies a judged refusal at once for every replica: the
// lesson (unless another replica's lesson came first), the pause, and the
// respace that makes a wider margin what the vendor sees.
//
// KEYS: the bucket's control, stats and gate hashes (applyKeyNames);
// ARGV: applyArgs. Returns {1 if the lesson was written, the pause
// remaining (µs), 1 if the line was respaced}.
const applyLua = `
local k_control = KEYS[1]
local k_stats = KEYS[2]
local k_gate = KEYS[3]
local a_now = tonumber(ARGV[1])
local a_seen = ARGV[2]
local a_fields = ARGV[3]
local a_pause = tonumber(ARGV[4])
local a_reason = ARGV[5]
local a_channel = ARGV[6]
local a_bucket = ARGV[7]
local a_keep = tonumber(ARGV[8])
local a_respace = ARGV[9] == '1'
local a_slack = tonumber(ARGV[10])
local a_respace_ch = ARGV[11]
local now = now_from(a_now)
local taught = 0
if a_fields ~= '' and (redis.call('HGET', k_control, 'lesson_tick') or '') == a_seen then
  local set = {'last_change', string.format('%d', now), 'last_decrease', string.format('%d', now)}
  for name, value in string.gmatch(a_fields, '([^=\n]+)=([^\n]*)') do
    set[#set + 1] = name
    set[#set + 1] = value
  end
  redis.call('HSET', k_control, unpack(set))
  extend(k_control, now + a_keep, now)
  adapted(k_gate)
  taught = 1
end
local left = 0
if a_pause > 0 then left = pause(k_control, k_gate, k_stats, now, a_pause, a_reason, a_channel, a_bucket, a_keep) end
local respaced = 0
if taught == 1 and a_respace then respaced = respace(k_gate, now, a_slack, a_respace_ch, a_bucket) end
return {taught, left, respaced}
`

var applyScript = redis.NewScript(nowLua + extendLua + pauseLua + lineFieldLua + respaceLua + applyLua)

// Refused judges a rate-limited answer that announced no limit, to the
// call of permit p (nil: unknown), and applies the judgement for every
// replica (see Adapt): it counts the answer, and pauses the bucket, lowers
// its rate or widens its margin as the model says. A lowered rate pauses
// at least Horizon (the ticks granted at the old rate are dropped, so no
// window mixes old and new spacing); a wider margin respaces instead, and
// keeps only a pause the vendor asked for. A refusal within a rate
// lesson's cooldown costs one round trip; one judged costs a second when
// it teaches (at most one lesson per window for every replica) or pauses.
func (c *Control) Refused(ctx context.Context, p *Permit, ans Answer) (Decision, error) {
	b := c.b
	a := b.policy.Adapt.withDefaults()
	primary := b.policy.Limits[0]
	cooldown := primary.Window + b.policy.Guard
	var tick int64
	var tag string
	if p != nil {
		tick, tag = p.at, p.tag
	}
	fail := func(err error) (Decision, error) {
		return Decision{}, fmt.Errorf("shaper: judge a rate-limited answer of %q: %w", b.name, err)
	}
	pauseCh := pauseChannel(b.gate.prefix)
	k := b.tickKeys()
	ra := refusedArgs{Now: b.gate.redisNow(), Tick: strconv.FormatInt(tick, 10), Cooldown: cooldown.Microseconds(), Keep: a.Keep.Microseconds(),
		Pause: ans.Pause.Microseconds(), PauseReason: ans.PauseReason, Channel: pauseCh, Bucket: b.name, Tag: k.logTag(tag), Log: b.tickLog()}
	res, err := redisonce.Run(ctx, b.gate.rdb, refusedScript, []string{k.control, k.ticks, k.limited, k.stats, k.gate}, ra.argv()...).Slice()
	if err != nil {
		return fail(err)
	}
	if len(res) < 3 {
		return fail(fmt.Errorf("unexpected reply %v", res))
	}
	out := Decision{InForce: parseLesson(res[1])}
	mode, _ := res[0].(int64)
	if mode == 0 {
		left, _ := res[2].(int64)
		out.Pause = time.Duration(left) * time.Microsecond
		if out.Pause > 0 {
			b.gate.notePause(b.name, b.gate.clock.Now().Add(out.Pause))
		}
		return out, nil
	}
	if len(res) < 10 {
		return fail(fmt.Errorf("unexpected reply %v", res))
	}
	cfg := c.configured()
	_, _, inForce, tol := b.spacing()
	jitter := max(ans.Jitter, b.meter.spread())
	window := primary.Window
	widened := false
	if w := b.meter.widenedAt(); b.policy.MeasureGuard && p != nil && !w.IsZero() {
		widened = p.granted.Sub(w) < window+inForce
	}
	e := evidence{
		tick: tick, ok: parseInts(res[5]), limited: parseInts(res[6]), window: primary.Window.Microseconds(),
		configured: cfg, rate: parseFloat(res[2], cfg), quiet: parseFloat(res[4], 0),
		guard: max(time.Duration(parseFloat(res[3], 0))*time.Microsecond, inForce), baseGuard: inForce,
		jitter: jitter, inForce: out.InForce, lessonTick: int64(parseFloat(res[7], 0)), sinceMargin: mode == 2, strict: b.policy.StrictSpacing,
		covered: inForce >= guardFor(a, tol, jitter, window), widened: widened, probeAt: int64(parseFloat(res[8], 0)),
		pausedUntil: int64(parseFloat(res[9], 0)),
	}
	seen, _ := res[7].(string)
	if e.tick == 0 && len(e.limited) > 0 {
		e.tick = e.limited[0]
	}
	e.complete = len(e.ok) < b.tickLog()
	iv, burst := tickFor(b.policy.Limits, b.policy.Burst, e.guard, e.rate)
	e.full = EffectiveRate(iv, burst, primary.Window)
	l := a.judge(e)

	args := applyArgs{Now: b.gate.redisNow(), Seen: seen, Channel: pauseCh, Bucket: b.name, Keep: a.Keep.Microseconds(),
		Slack: respaceSlack.Microseconds(), RespaceCh: respaceChannel(b.gate.prefix), Pause: ans.Pause.Microseconds(), Reason: ans.PauseReason}
	at := strconv.FormatInt(e.tick, 10)
	switch l.kind {
	case LessonRate:
		out.Rate, out.Guard = l.rate, l.guard
		out.Reason = ans.Reason + ": " + l.because
		rate := strconv.FormatFloat(l.rate, 'f', -1, 64)
		est := "" // the largest limit consistent with what the vendor did, when above the rate: probed (raise_rate)
		if l.est > 0 {
			est = strconv.Itoa(l.est)
		}
		args.Fields = fields("rate", rate, "hi", rate, "rate_reason", out.Reason, "rate_source", "learned", "lesson", "rate",
			"guard", strconv.FormatInt(l.guard.Microseconds(), 10), "tol", "0", "guard_reason", "", "lesson_tick", at, "est_hi", est)
		// Ticks granted at the old rate reach at most a horizon ahead:
		// pausing that long drops them all.
		args.Pause = max(args.Pause, b.policy.Horizon.Microseconds())
		if args.Reason == "" || ans.Pause < b.policy.Horizon {
			args.Reason = out.Reason
		}
	case LessonMargin:
		out.Guard = l.guard
		out.Reason = ans.Reason + " " + l.because
		args.Fields = fields("guard", strconv.FormatInt(l.guard.Microseconds(), 10), "tol", strconv.FormatInt(a.Tolerance.Microseconds(), 10),
			"guard_reason", out.Reason, "lesson", "margin", "lesson_tick", at)
		args.Respace = 1
	}
	if (l.spacing || l.kind == lessonNone && out.InForce == LessonMargin) && !ans.RetryAfter {
		args.Pause = 0 // refused for spacing, not for the rate: a pause would only cost calls
	}
	if args.Fields == "" && args.Pause == 0 {
		return out, nil
	}
	r, err := redisonce.Run(ctx, b.gate.rdb, applyScript, []string{b.keys.control, b.keys.stats, b.keys.gate}, args.argv()...).Slice()
	if err != nil {
		return fail(err)
	}
	if len(r) < 3 {
		return fail(fmt.Errorf("unexpected reply %v", r))
	}
	taught, _ := r[0].(int64)
	left, _ := r[1].(int64)
	respaced, _ := r[2].(int64)
	if taught == 1 {
		out.Lesson, out.InForce = l.kind, l.kind
	} else {
		out.Rate, out.Guard, out.Reason = 0, 0, ""
	}
	if out.Pause = time.Duration(left) * time.Microsecond; out.Pause > 0 {
		b.gate.notePause(b.name, b.gate.clock.Now().Add(out.Pause))
	}
	if out.Respaced = respaced == 1; out.Respaced {
		b.gate.noteRespace(b.name, b.gate.clock.Now())
	}
	return out, nil
}

// fields joins name, value pairs for the apply script.
func fields(kv ...string) string {
	var sb strings.Builder
	for i := 0; i+1 < len(kv); i += 2 {
		if i > 0 {
			sb.WriteByte('\n')
		}
		sb.WriteString(kv[i] + "=" + strings.ReplaceAll(kv[i+1], "\n", " "))
	}
	return sb.String()
}

func parseLesson(v any) Lesson {
	switch v {
	case "rate":
		return LessonRate
	case "margin":
		return LessonMargin
	}
	return lessonNone
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
