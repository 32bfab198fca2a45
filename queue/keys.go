package queue

// Keys of the queue package. The gate's own keys are in shaper/keys.go;
// the few of asynq's that the queue reads are in asynqkeys.go.

import "github.com/shaper-dev/shaper/shaper"

// QueueName is the asynq queue of a vendor's bucket (its normal lane).
func QueueName(vendor string) string { return "vendor:" + bucketName(vendor) }

// HighQueueName is the asynq queue of a vendor's high lane, served by an
// asynq server of its own in each worker (see Worker.start), so that its
// tasks do not wait behind QueueName's.
func HighQueueName(vendor string) string { return QueueName(vendor) + ":high" }

// laneQueue is the asynq queue of a lane of vendor.
func laneQueue(vendor string, lane shaper.Lane) string {
	if lane == shaper.High {
		return HighQueueName(vendor)
	}
	return QueueName(vendor)
}

// bucketName names the gate bucket of a vendor. Every bucket is named
// here, so that a bucket per (vendor, account) can come without touching
// the gate, which never looks inside a name.
func bucketName(vendor string) string { return vendor }

// queuePausedKey marks the vendor's asynq queue as paused by shaper for a
// long wait: which lanes ("normal" or "both"), for at least the wait. Who
// paused a queue is in asynq's own paused key (pausedByShaper), so a
// worker unpauses a queue shaper paused even once this mark is gone
// (supervisor.go). It shares the vendor's hash tag with the gate's keys.
func queuePausedKey(prefix, vendor string) string {
	return prefix + ":{" + bucketName(vendor) + "}:queue-paused"
}

// Export keys: a hash with vendor, created and queued, two sets of task
// ids (a re-run after a crash counts once), and its calls in order,
// hash-tagged by export id.
func exportKey(prefix, id string) string       { return prefix + ":export:{" + id + "}" }
func exportDoneKey(prefix, id string) string   { return exportKey(prefix, id) + ":done" }
func exportFailedKey(prefix, id string) string { return exportKey(prefix, id) + ":failed" }

// exportCancelledKey is the set of an export's calls that were cancelled
// (also in its failed set): a call whose task is gone reads back as
// cancelled, not as a failure asynq's archive dropped.
func exportCancelledKey(prefix, id string) string { return exportKey(prefix, id) + ":cancelled" }

// exportCallsKey is the sorted set of an export's call ids, scored by
// their place in it (see exportSeq).
func exportCallsKey(prefix, id string) string { return exportKey(prefix, id) + ":calls" }

// aliveKey is the sorted set of live workers (see alive.go), of every
// vendor.
func aliveKey(prefix string) string { return prefix + ":alive" }

// keptKey is a string without expiry holding the run_id of the Redis
// server it was written on: a server that restarts without its data has
// none (see redisKept).
func keptKey(prefix string) string { return prefix + ":kept" }

// claimsKey is the sorted set of a vendor's call ids claimed lately, and
// roomKey the room reserved in its queue_limit by enqueues under way
// (claim.go); both carry the vendor's hash tag.
func claimsKey(prefix, vendor string) string { return prefix + ":{" + bucketName(vendor) + "}:ids" }
func roomKey(prefix, vendor string) string   { return prefix + ":{" + bucketName(vendor) + "}:room" }

// pullCursorsKey is the hash of the cursors (or next URLs) a pull's
// pages were asked with (cursor -> page), to stop a pull that loops; it
// carries the vendor's hash tag and expires with the export's progress.
func pullCursorsKey(prefix, vendor, root string) string {
	return prefix + ":{" + bucketName(vendor) + "}:pull:" + root
}
