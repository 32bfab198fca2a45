package shaper

import (
	"fmt"
	"strings"
)

// DefaultKeyPrefix is the prefix of every key the gate writes.
const DefaultKeyPrefix = "shaper"

// Every key of a group carries the group's name as a Redis Cluster hash
// tag, so that one script can touch a bucket's keys and its group's:
// shaper:{acme}:gate for the bucket of a group of one, and
// shaper:{shop}:acct:store-42:gate for a bucket in a group. The keys a
// script uses are listed in its comment, in this order.
type bucketKeys struct {
	// gate is a hash with the last reserved tick ("last", Redis-time
	// µs), the grants made on it ("n"), the moment the last caller
	// deferred beyond the horizon was told to come back ("defer_at"), the
	// server that wrote it ("run"), the widest tick asked under lately
	// ("wide" and "wide_at", see widest) and the clock minute its last grant was
	// counted in ("gm"). It
	// expires once no tick it granted can still fall in a vendor window
	// (see keep); its absence with the group's epoch present and no live
	// entry in the group's expiry set means it expired after idle.
	gate string
	// control is a hash of what adaptation sets: "paused_until" (µs) and
	// "pause_reason"; the effective "rate" (calls per primary window, below
	// the configured one), "rate_reason", "rate_source"; and the learning
	// state "hi" (rate that last failed), "lo" (rate that last stayed
	// quiet), "last_throttle", "last_decrease" and "last_change" (µs).
	control string
	// stats is the group's hash of counters: "granted", "deferred", "late",
	// "dropped" (ticks given up because a pause began), "pauses", "resets",
	// "rate_limited", and per-clock-minute slots (see minuteCounterLua).
	// One per group: counters do not grow with buckets.
	stats string
	// inFlight is a sorted set of in-flight leases scored by their expiry
	// (µs).
	inFlight string
	// ticks is a list of the ticks granted lately (µs, newest first), at
	// least a few windows' worth at the configured rate: what a
	// rate-limited answer is judged against (see judge). Ticks given up
	// and refused calls are taken out of the judge's view. A group of one
	// keeps its holders' tags in it (held_item): there it is the tags key
	// itself, and keeps 30 s of grants (see log_ticks).
	ticks string
	// oldTicks is where the ticks list of a group of one was before
	// layout 4 kept its tags in it: the full grant merges what it holds
	// into the list at its first touch (convert_tags).
	oldTicks string
	// limited is a list of the ticks of the last rate-limited calls (µs,
	// newest first, at most 32).
	limited string

	// Group-level keys.

	// epoch is a string set once per group and never expired: a bucket
	// state missing while the epoch exists expired after idle; with the
	// epoch missing too, Redis lost data.
	epoch string
	// expiry is a sorted set of the group's buckets scored by the moment
	// their state may expire (µs); an entry still in the future while the
	// state is missing means the state was lost.
	expiry string
	// total is a hash with the group's total-limit state ("last", "n") and
	// the fair share of it ("share", calls per total window, and
	// "share_at", when it was computed).
	total string
	// plans is a sorted set of the group's buckets with calls planned
	// ahead (Plan), scored by the moment the last of them is due (µs).
	plans string
	// slots is a ring bitmap of the total's ticks over the horizon: bit
	// j mod ring is set when the tick at j total intervals is granted.
	slots string
	// asking is a sorted set of the group's buckets with waiting callers,
	// scored by the moment they stop counting as such (µs).
	asking string
	// rates is a hash of the asking buckets' own rates, in calls per total
	// window, for the fair share.
	rates string
	// counts is a hash of the counters of the bucket's limits (see
	// countersLua), and totalCounts the group's, of its total's limits.
	counts      string
	totalCounts string
	// tags is the record of the tags of the calls granted a tick
	// (Request.Tag, see Bucket.tagged): for a group of one its ticks
	// list; for a group of accounts a sorted set scored by the tick (µs),
	// whose entries leave it tagKeep after their tick.
	tags string
	// check is a short-lived string a server check writes (see
	// checkScript): a replica refuses the write.
	check string
	// line is a sorted set of the calls waiting beyond the horizon,
	// scored by their order (Request.Order), and lineDue one of the same
	// calls scored by the moment each must ask again to keep its place
	// (µs); both expire soon after the last caller in line asked (see
	// line.go).
	line, lineDue string
	// lineGone is a sorted set of the calls that left the line for not
	// asking again when due, scored by when (µs); entries leave it after
	// lineGoneKeep.
	lineGone string
	// start is a string, the moment the bucket's last call started (µs),
	// for a bucket spaced by actual starts (see startLua); it expires a
	// window after that start.
	start string
}

func keysOf(prefix, group, bucket string) bucketKeys {
	g := func(name string) string { return prefix + ":{" + group + "}:" + name }
	b := g
	if bucket != "" {
		b = func(name string) string { return prefix + ":{" + group + "}:acct:" + bucket + ":" + name }
	}
	ticks := b("ticks")
	if bucket == "" {
		ticks = g("tags") // a group of one: its holders' tags ride in its ticks (layout 4)
	}
	return bucketKeys{
		gate: b("gate"), control: b("ctl"), stats: g("stats"), inFlight: b("inflight"),
		ticks: ticks, oldTicks: b("ticks"), limited: b("limited"),
		epoch: g("epoch"), expiry: g("expiry"), total: g("total"), asking: g("asking"), rates: g("rates"), slots: g("slots"), plans: g("plans"),
		counts: b("counts"), totalCounts: g("total_counts"), tags: g("tags"), check: g("check"), start: b("start"),
		line: b("line"), lineDue: b("line_due"), lineGone: b("line_gone"),
	}
}

// logTag is tag where the bucket keeps its holders' tags in its ticks
// list (a vendor's bucket, layout 4), else "": a give-up or a refusal
// then looks for the tick alone (see unsend), without a scan for an
// item that cannot be there.
func (k bucketKeys) logTag(tag string) string {
	if k.ticks != k.tags {
		return ""
	}
	return tag
}

// reserve lists the reserve script's keys, in the order of
// reserveKeyNames.
func (k bucketKeys) reserve() []string {
	return []string{k.gate, k.control, k.stats, k.inFlight, k.epoch, k.expiry, k.total, k.asking, k.rates,
		k.slots, k.ticks, k.counts, k.totalCounts, k.tags, k.oldTicks}
}

// pauseChannel is the Pub/Sub channel pauses are announced on.
func pauseChannel(prefix string) string { return prefix + ":pauses" }

// respaceChannel is the Pub/Sub channel respaced buckets are announced on.
func respaceChannel(prefix string) string { return prefix + ":respaces" }

// checkName rejects group and bucket names that would break the key
// scheme.
func checkName(what, name string) error {
	if name == "" {
		return fmt.Errorf("shaper: empty %s name", what)
	}
	if strings.ContainsAny(name, "{}") {
		return fmt.Errorf("shaper: %s name %q must not contain '{' or '}' (they delimit the Redis Cluster hash tag)", what, name)
	}
	if strings.ContainsAny(name, "|\x00\r\n ") {
		return fmt.Errorf("shaper: %s name %q must not contain '|', spaces or control characters", what, name)
	}
	return nil
}
