package queue

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"strings"

	"github.com/hibiken/asynq"

	"github.com/shaper-dev/shaper/shaper"
)

// Errors returned by Cancel, matched with errors.Is (ErrNoTask for an id
// that no vendor's queue holds).
var (
	// ErrStarted: a worker holds the call (waiting for its tick, or at
	// the vendor); a started call cannot be cancelled.
	ErrStarted = errors.New("queue: the call has started")
	// ErrFinished: the call ended (completed, or archived after its
	// retries); there is nothing left to cancel.
	ErrFinished = errors.New("queue: the call has already finished")
)

// cancelTries bounds how often Cancel reads a task again after asynq
// refused to delete it (a worker took it in between).
const cancelTries = 3

// Cancellation is what Cancel removed.
type Cancellation struct {
	TaskID string `json:"task_id"`
	Vendor string `json:"vendor"`
	Lane   string `json:"lane"`
	// State is the call's state when it was cancelled: pending,
	// scheduled or retry.
	State string `json:"state"`
	// Retried counts the attempts that failed before: a call cancelled
	// in retry with Retried > 0 did reach the vendor (a deferral, a wait
	// sent back to the queue, did not).
	Retried int `json:"retried"`
	// Export is the export the call belonged to, if any: it counts there
	// as failed, so that the export still finishes.
	Export string `json:"export,omitempty"`
}

// Cancel removes the call (or task) id that has not started from its
// vendor's queue, so that no worker ever runs it: a pending call, one
// scheduled (planned at its account's pace), or one waiting for a retry
// or sent back to wait. It returns ErrStarted for a call a worker holds,
// ErrFinished for one that completed or was archived (an archived call
// is kept, with its error, for the retention), ErrNoTask when no queue
// holds id, and ErrAmbiguous when more than one vendor's does (see
// CancelVendor). A cancelled call's id is free again at once.
//
// Cancel and a worker taking the call cannot both win: asynq deletes a
// task and moves it to active each in one script, and refuses to delete
// an active one; Cancel then reads the call again and says ErrStarted
// (or ErrFinished).
//
// A cancelled call of an export is recorded as failed in the export's
// progress (ExportStatus), since it will never run. A per-account
// vendor's plan is not given back: calls planned after a cancelled one
// still come back from the schedule when they were planned to.
func (c *Client) Cancel(ctx context.Context, id string) (Cancellation, error) {
	return c.CancelVendor(ctx, "", id)
}

// CancelVendor is Cancel of vendor's call id; with vendor "" it looks in
// every vendor's queues, as Cancel does, and an id that more than one
// vendor holds is ErrAmbiguous, naming them: nothing is cancelled.
func (c *Client) CancelVendor(ctx context.Context, vendor, id string) (Cancellation, error) {
	insp := asynq.NewInspectorFromRedisClient(c.rdb)
	v, lane, info, err := c.findTask(ctx, insp, vendor, id)
	if err != nil {
		return Cancellation{}, err
	}
	// The exports that adopted the call count it too: read them before
	// the cancel deletes its task hash. (An export that adopts it between
	// the two is not told.)
	followers, err := c.followers(ctx, v.Name, id)
	if err != nil {
		return Cancellation{}, err
	}
	return c.cancel(ctx, insp, v.Name, lane, info, followers)
}

// cancel deletes the task of info from its queue unless it has started
// or ended, reading it again when asynq refuses (a worker just took it).
func (c *Client) cancel(ctx context.Context, insp *asynq.Inspector, vendor string, lane shaper.Lane, info *asynq.TaskInfo, followers []string) (Cancellation, error) {
	id, q := info.ID, info.Queue
	var err error
	for range cancelTries {
		switch info.State {
		case asynq.TaskStateActive:
			return Cancellation{}, fmt.Errorf("%w: a worker holds call %s (waiting for its tick, or at the vendor), and a started call cannot be cancelled; GET it to follow it", ErrStarted, id)
		case asynq.TaskStateCompleted, asynq.TaskStateArchived:
			return Cancellation{}, fmt.Errorf("%w: call %s is %s, there is nothing to cancel", ErrFinished, id, info.State)
		}
		err = insp.DeleteTask(q, id)
		if err == nil {
			// The id is free again: its claim went when the call was
			// queued (only a claim's maker lets it go; a claim dropped
			// here could be another request's, made since).
			return c.cancelled(ctx, vendor, lane, info, followers)
		}
		if errors.Is(err, asynq.ErrTaskNotFound) || errors.Is(err, asynq.ErrQueueNotFound) {
			return Cancellation{}, fmt.Errorf("%w %q: it was deleted meanwhile (another cancel?)", ErrNoTask, id)
		}
		// asynq refuses to delete an active task, with an error of its
		// internal package: read the state again and say why.
		next, rerr := insp.GetTaskInfo(q, id)
		if errors.Is(rerr, asynq.ErrTaskNotFound) {
			return Cancellation{}, fmt.Errorf("%w %q: it was deleted meanwhile (another cancel?)", ErrNoTask, id)
		}
		if rerr != nil {
			return Cancellation{}, fmt.Errorf("queue: cancel task %s: %w (and reading it again: %w)", id, err, rerr)
		}
		info = next
	}
	return Cancellation{}, fmt.Errorf("queue: cancel task %s: %w", id, err)
}

// cancelled records a deleted call as failed and cancelled in its export
// and in those that adopted it (followers), and says what was cancelled.
func (c *Client) cancelled(ctx context.Context, vendor string, lane shaper.Lane, info *asynq.TaskInfo, followers []string) (Cancellation, error) {
	out := Cancellation{TaskID: info.ID, Vendor: vendor, Lane: lane.String(), State: info.State.String(), Retried: info.Retried}
	var call Call
	if info.Type == TypeCall && json.Unmarshal(info.Payload, &call) == nil {
		out.Export = call.Export
	}
	exports := followers
	if out.Export != "" {
		exports = append(exports, out.Export)
	}
	if len(exports) == 0 {
		return out, nil
	}
	ttl := c.cfg.Retention + exportGrace
	pipe := c.rdb.Pipeline()
	for _, e := range exports {
		markPipe(ctx, pipe, c.cfg.KeyPrefix, e, []string{info.ID}, false, ttl)
		pipe.SAdd(ctx, exportCancelledKey(c.cfg.KeyPrefix, e), info.ID)
		pipe.Expire(ctx, exportCancelledKey(c.cfg.KeyPrefix, e), ttl)
	}
	if _, err := pipe.Exec(ctx); err != nil {
		return out, fmt.Errorf("queue: call %s is cancelled, but recording it as failed in export(s) %s failed (they will not finish): %w", info.ID, strings.Join(exports, ", "), err)
	}
	return out, nil
}
