package queue

// Keys of the queue package. The gate's own keys are in shaper/keys.go;
// asynq's are asynq's.

// QueueName is the asynq queue of a vendor's bucket.
func QueueName(vendor string) string { return "vendor:" + bucketName(vendor) }

// bucketName names the gate bucket of a vendor. Every bucket is named
// here, so that a bucket per (vendor, account) can come without touching
// the gate, which never looks inside a name.
func bucketName(vendor string) string { return vendor }

// queuePausedKey marks the vendor's asynq queue as paused by shaper (not
// by an operator), so that a worker unpauses it when the wait is nearly
// over. It shares the vendor's hash tag with the gate's keys.
func queuePausedKey(prefix, vendor string) string {
	return prefix + ":{" + bucketName(vendor) + "}:queue-paused"
}

// Export keys: a hash with vendor, total and created, and two sets of task
// ids (a re-run after a crash counts once), hash-tagged by export id.
func exportKey(prefix, id string) string       { return prefix + ":export:{" + id + "}" }
func exportDoneKey(prefix, id string) string   { return exportKey(prefix, id) + ":done" }
func exportFailedKey(prefix, id string) string { return exportKey(prefix, id) + ":failed" }
