package shaper

import (
	"fmt"
	"strings"
)

// DefaultKeyPrefix is the prefix of every key the gate writes.
const DefaultKeyPrefix = "shaper"

// Every key of one bucket carries the bucket name as a Redis Cluster hash
// tag, so that one script can touch all of them: shaper:{acme}:gate. The
// keys a script uses are listed in its comment, in this order.
type bucketKeys struct {
	// gate is a hash with the last reserved tick ("last", Redis-time
	// µs), the grants made on it ("n") and the moment the last caller
	// deferred beyond the horizon was told to come back ("defer_at"). It
	// has no TTL: its absence means the state was lost (or never existed),
	// and the gate then waits out the reservation horizon before its first
	// grant.
	gate string
	// control is a hash of what adaptation sets: "paused_until" (µs) and
	// "pause_reason"; the effective "rate" (calls per primary window, below
	// the configured one), "rate_reason", "rate_source"; and the learning
	// state "hi" (rate that last failed), "lo" (rate that last stayed
	// quiet), "last_throttle", "last_decrease" and "last_change" (µs).
	control string
	// stats is a hash of counters: "granted", "deferred", "late",
	// "dropped" (ticks given up because a pause began), "pauses", "resets",
	// "rate_limited", and per-clock-minute slots (see minuteCounterLua).
	stats string
	// inFlight is a sorted set of in-flight leases scored by their expiry
	// (µs).
	inFlight string
	// replicas is a hash of live processes' configured ticks: replica id
	// -> "interval_µs|burst|seen_µs".
	replicas string
}

func keysOf(prefix, bucket string) bucketKeys {
	k := func(name string) string { return prefix + ":{" + bucket + "}:" + name }
	return bucketKeys{gate: k("gate"), control: k("ctl"), stats: k("stats"), inFlight: k("inflight"), replicas: k("replicas")}
}

// all lists every key, in the order the reserve and stats scripts take.
func (k bucketKeys) all() []string {
	return []string{k.gate, k.control, k.stats, k.inFlight, k.replicas}
}

// pauseChannel is the Pub/Sub channel pauses are announced on.
func pauseChannel(prefix string) string { return prefix + ":pauses" }

// checkBucket rejects names that would break the key scheme.
func checkBucket(bucket string) error {
	if bucket == "" {
		return fmt.Errorf("shaper: empty bucket name")
	}
	if strings.ContainsAny(bucket, "{}") {
		return fmt.Errorf("shaper: bucket name %q must not contain '{' or '}' (they delimit the Redis Cluster hash tag)", bucket)
	}
	return nil
}
