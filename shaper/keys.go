package shaper

import (
	"fmt"
	"strings"
)

// DefaultKeyPrefix is the prefix of every key the gate writes.
const DefaultKeyPrefix = "shaper"

// Every key of one bucket carries the bucket name as a Redis Cluster hash
// tag, so that one script can touch all of them: shaper:{acme}:gate.

// gateKey is a hash with the last reserved tick ("last", Redis-time
// microseconds), the grants made on it ("n") and the moment the last
// caller deferred beyond the horizon was told to come back ("defer_at"). It has no TTL: its absence
// means the state was lost (or never existed), and the gate then waits out
// the reservation horizon before its first grant.
func gateKey(prefix, bucket string) string { return bucketKey(prefix, bucket, "gate") }

// controlKey is a hash of what adaptation sets: "paused_until" (Redis-time
// microseconds) and "pause_reason"; the effective "rate" (calls per
// primary window, below the configured one), "rate_reason", "rate_source";
// and the learning state "hi" (rate that last failed), "lo" (rate that
// last stayed quiet), "last_throttle", "last_decrease" and "last_change"
// (Redis-time µs).
func controlKey(prefix, bucket string) string { return bucketKey(prefix, bucket, "ctl") }

// statsKey is a hash of counters: "granted", "deferred", "late",
// "dropped" (ticks dropped because a pause began), "pauses", "resets".
func statsKey(prefix, bucket string) string { return bucketKey(prefix, bucket, "stats") }

// inFlightKey is a sorted set of in-flight leases scored by their expiry
// (Redis-time microseconds).
func inFlightKey(prefix, bucket string) string { return bucketKey(prefix, bucket, "inflight") }

// replicasKey is a hash of live replicas' configured ticks: replica id ->
// "interval_µs|burst|seen_µs" (Redis time).
func replicasKey(prefix, bucket string) string { return bucketKey(prefix, bucket, "replicas") }

func bucketKey(prefix, bucket, name string) string {
	return prefix + ":{" + bucket + "}:" + name
}

// VendorBucket names the bucket of a vendor. Every caller names buckets
// through this function, so that a bucket per (vendor, account) can come
// later without touching the gate, which never looks inside a name.
func VendorBucket(vendor string) string { return vendor }

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

// pauseChannel is the Pub/Sub channel pauses are announced on.
func pauseChannel(prefix string) string { return prefix + ":pauses" }
