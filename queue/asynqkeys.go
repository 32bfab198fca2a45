package queue

import (
	"fmt"
	"runtime/debug"
)

// The queue reads and writes a few of asynq's own keys, where asynq has no
// API for what shaper needs (a task's place in its lane, the tasks under
// a dead worker's lease, putting a held task back). They are asynq
// v0.26's internal/base scheme, spelled here and nowhere else, and
// checkAsynq refuses to start a worker built with another asynq.

// asynqPinned is the asynq version these keys and the scripts that use
// them were written against (asynq's internal/base and internal/rdb).
const asynqPinned = "v0.26.0"

// asynqKey is asynq's key name of queue q: "asynq:{q}:name" (pending,
// active, lease, scheduled, retry, ...).
func asynqKey(q, name string) string { return "asynq:{" + q + "}:" + name }

// asynqTaskKey is the hash of task id in queue q.
func asynqTaskKey(q, id string) string { return asynqKey(q, "t:"+id) }

// queueKey is one of asynq's keys of a vendor's queue.
func queueKey(vendor, name string) string { return asynqKey(QueueName(vendor), name) }

// highQueueKey is queueKey of the vendor's high lane.
func highQueueKey(vendor, name string) string { return asynqKey(HighQueueName(vendor), name) }

// asynqKeys are the keys of a task in queue q that requeueHeld touches:
// active, lease, pending, the task's hash.
func asynqKeys(q, id string) []string {
	return []string{asynqKey(q, "active"), asynqKey(q, "lease"), asynqKey(q, "pending"), asynqTaskKey(q, id)}
}

// checkAsynq returns an error when the binary was built with another
// asynq than asynqPinned (the keys above would not be asynq's). A binary
// without module information (built outside module mode) is not checked.
func checkAsynq() error {
	info, ok := debug.ReadBuildInfo()
	if !ok {
		return nil
	}
	return checkAsynqIn(info)
}

func checkAsynqIn(info *debug.BuildInfo) error {
	for _, m := range info.Deps {
		if m.Path != "github.com/hibiken/asynq" {
			continue
		}
		v := m.Version
		if m.Replace != nil {
			v = m.Replace.Version
		}
		if v != asynqPinned && v != "" && v != "(devel)" {
			return fmt.Errorf("queue: built with github.com/hibiken/asynq %s, but shaper reads asynq's keys as %s lays them out (queue/asynqkeys.go): build with asynq %s, or check those keys against %s and update asynqPinned", v, asynqPinned, asynqPinned, v)
		}
	}
	return nil
}
