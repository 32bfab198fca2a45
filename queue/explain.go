package queue

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"maps"
	"math"
	"slices"
	"strings"
	"time"

	"github.com/hibiken/asynq"
	"github.com/redis/go-redis/v9"

	"github.com/shaper-dev/shaper/shaper"
)

// ErrNoTask is returned by Explain for a task id that no vendor's queue
// holds (never enqueued, or finished longer ago than the retention).
var ErrNoTask = errors.New("queue: no such task")

// ErrAmbiguous is returned by Explain and Cancel for an id that calls of
// more than one vendor carry: an id names one call per vendor, so the
// same id on two vendors is two calls. The error names the vendors; ask
// again naming one (ExplainVendor, CancelVendor).
var ErrAmbiguous = errors.New("queue: the id names calls of more than one vendor")

// Binding names what a call waits for now (Explanation.Binding).
const (
	BindBacklog  = "backlog"   // calls ahead of it, at the effective rate
	BindPause    = "pause"     // the vendor (or account) is paused
	BindQuota    = "quota"     // a quota is spent until it frees
	BindInFlight = "in_flight" // the in-flight cap is full
	BindSchedule = "schedule"  // planned or sent back for later: asynq holds it until then
	BindRetry    = "retry"     // failed; asynq retries it later
	BindRunning  = "running"   // taken by a worker: waiting for its tick or at the vendor
	BindDone     = "done"      // finished (completed or archived)
)

// Explanation says what one call waits for and when it should start, or,
// for a call that ran, how it ended. The shape is stable: fields are only
// ever added.
type Explanation struct {
	TaskID  string `json:"task_id"`
	Vendor  string `json:"vendor"`
	Account string `json:"account,omitempty"`
	Lane    string `json:"lane"`
	// State is asynq's: pending, scheduled, retry, active, completed,
	// archived.
	State   string `json:"state"`
	Binding string `json:"binding"`
	// Reason says it in a sentence, naming the limit that binds.
	Reason string `json:"reason"`
	// Place is the call's place in its lane (1: next), for a pending call.
	Place int64 `json:"place,omitempty"`
	// Ahead counts the calls that start before it: those ahead in its
	// lane, the high lane's for a normal call, and those a worker holds.
	Ahead int64 `json:"ahead"`
	// Rate is the effective rate the estimate uses, calls per second.
	Rate           float64    `json:"rate_per_second,omitempty"`
	PausedUntil    *time.Time `json:"paused_until,omitempty"`
	PauseReason    string     `json:"pause_reason,omitempty"`
	EstimatedStart *time.Time `json:"estimated_start,omitempty"`
	// For a call that ran or failed.
	Retried     int        `json:"retried"`
	LastError   string     `json:"last_error,omitempty"`
	LastFailed  *time.Time `json:"last_failed,omitempty"`
	NextAttempt *time.Time `json:"next_attempt,omitempty"`
	CompletedAt *time.Time `json:"completed_at,omitempty"`
	Status      int        `json:"status,omitempty"` // the vendor's HTTP status (CallResult)
	// For a finished call: the start of the vendor's answer as stored
	// (CallResult: 512 bytes, header secrets redacted), and the vendor
	// calls made (its retries and the last; waits and 429s are not
	// attempts).
	Body     string `json:"body_excerpt,omitempty"`
	Attempts int    `json:"attempts,omitempty"`
	// Answer is the whole answer the call kept (CallResult: status,
	// kept headers, the body up to its vendor's max_answer), for a call
	// that ended.
	Answer json.RawMessage `json:"answer,omitempty"`
}

// Explain finds task id in the vendors' queues and says what it waits for
// (see Explanation). It returns ErrNoTask when no queue holds it, and
// ErrAmbiguous when more than one vendor's does.
func (c *Client) Explain(ctx context.Context, id string) (Explanation, error) {
	return c.ExplainVendor(ctx, "", id)
}

// ExplainVendor is Explain of vendor's call id; with vendor "" it looks
// in every vendor's queues, as Explain does.
func (c *Client) ExplainVendor(ctx context.Context, vendor, id string) (Explanation, error) {
	insp := asynq.NewInspectorFromRedisClient(c.rdb)
	v, lane, info, err := c.findTask(ctx, insp, vendor, id)
	if err != nil {
		return Explanation{}, err
	}
	return c.explain(ctx, v, lane, info, time.Now())
}

// findTask finds task id in vendor's lanes, or in every vendor's when
// vendor is "": one round trip to see which lanes hold it, then a read of
// the task. The answer does not depend on the order of a map: an id
// that more than one vendor holds is ErrAmbiguous, naming them; a vendor
// holding it in both lanes (queued twice before ids were claimed per
// vendor) answers with its normal lane's.
func (c *Client) findTask(ctx context.Context, insp *asynq.Inspector, vendor, id string) (Vendor, shaper.Lane, *asynq.TaskInfo, error) {
	names := []string{vendor}
	if vendor == "" {
		names = slices.Sorted(maps.Keys(c.vendors))
	} else if _, err := c.vendor(vendor); err != nil {
		return Vendor{}, 0, nil, err
	}
	lanes := []shaper.Lane{shaper.Normal, shaper.High}
	pipe := c.rdb.Pipeline()
	held := make([]*redis.IntCmd, 0, 2*len(names))
	for _, name := range names {
		for _, lane := range lanes {
			held = append(held, pipe.Exists(ctx, asynqTaskKey(laneQueue(name, lane), id)))
		}
	}
	if _, err := pipe.Exec(ctx); err != nil {
		return Vendor{}, 0, nil, fmt.Errorf("queue: find task %s: %w", id, err)
	}
	var holders []string
	at := -1
	for k, cmd := range held {
		name := names[k/len(lanes)]
		if cmd.Val() == 0 || len(holders) > 0 && holders[len(holders)-1] == name {
			continue
		}
		holders = append(holders, name)
		if at < 0 {
			at = k
		}
	}
	switch {
	case len(holders) > 1:
		return Vendor{}, 0, nil, fmt.Errorf("%w: %q is the id of a call of each of %s; name the vendor (--vendor, or ?vendor= in the API)",
			ErrAmbiguous, id, strings.Join(holders, ", "))
	case at < 0:
		where := "any vendor's queue"
		if vendor != "" {
			where = "vendor " + vendor + "'s queue"
		}
		return Vendor{}, 0, nil, fmt.Errorf("%w %q in %s (finished calls are kept for %s)", ErrNoTask, id, where, c.cfg.Retention)
	}
	v, lane := c.vendors[names[at/len(lanes)]], lanes[at%len(lanes)]
	info, err := insp.GetTaskInfo(laneQueue(v.Name, lane), id)
	if errors.Is(err, asynq.ErrTaskNotFound) || errors.Is(err, asynq.ErrQueueNotFound) {
		return Vendor{}, 0, nil, fmt.Errorf("%w %q in vendor %s's queue: it was deleted meanwhile", ErrNoTask, id, v.Name)
	}
	if err != nil {
		return Vendor{}, 0, nil, fmt.Errorf("queue: read task %s: %w", id, err)
	}
	return v, lane, info, nil
}

func (c *Client) explain(ctx context.Context, v Vendor, lane shaper.Lane, info *asynq.TaskInfo, now time.Time) (Explanation, error) {
	e := Explanation{TaskID: info.ID, Vendor: v.Name, Lane: lane.String(), State: info.State.String(), Retried: info.Retried, LastError: info.LastErr}
	var call Call
	if info.Type == TypeCall {
		_ = json.Unmarshal(info.Payload, &call)
		e.Account = call.Account
	} else {
		e.Account = info.Headers[accountHeader]
	}
	if !info.LastFailedAt.IsZero() {
		e.LastFailed = timePtr(info.LastFailedAt)
	}
	switch info.State {
	case asynq.TaskStateCompleted, asynq.TaskStateArchived:
		e.Binding = BindDone
		var res CallResult
		if json.Unmarshal(info.Result, &res) == nil && res.Status > 0 {
			e.Status, e.Body, e.Answer = res.Status, res.BodyExcerpt(excerptBytes), info.Result
		}
		e.Attempts = info.Retried + 1
		if !info.CompletedAt.IsZero() {
			e.CompletedAt = timePtr(info.CompletedAt)
		}
		if info.State == asynq.TaskStateArchived {
			e.Reason = fmt.Sprintf("failed for good after %d retries: %s", info.Retried, info.LastErr)
		} else {
			e.Reason = fmt.Sprintf("completed at %s with HTTP %d after %d retries", info.CompletedAt.Format(time.RFC3339), e.Status, info.Retried)
		}
		return e, nil
	case asynq.TaskStateActive:
		e.Binding = BindRunning
		e.Reason = "taken by a worker: waiting for its tick (at most the horizon ahead) or in flight at the vendor"
		return e, nil
	case asynq.TaskStateScheduled, asynq.TaskStateRetry:
		e.Binding = BindSchedule
		if info.State == asynq.TaskStateRetry && !isDeferral(info.LastErr) {
			e.Binding = BindRetry
		}
		e.NextAttempt = timePtr(info.NextProcessAt)
		e.EstimatedStart = timePtr(info.NextProcessAt)
		switch {
		case e.Binding == BindRetry:
			// Retried counts the retries scheduled (this one included);
			// the budget, not asynq's MaxRetry (one above it: retry.go).
			e.Reason = fmt.Sprintf("failed (%s); retry %d of %d at %s", info.LastErr, info.Retried, retryBudget(info.Headers, info.MaxRetry), info.NextProcessAt.Format(time.RFC3339))
		case info.State == asynq.TaskStateRetry:
			e.Reason = fmt.Sprintf("sent back to the queue to wait (%s); it comes back at %s and takes the next tick", info.LastErr, info.NextProcessAt.Format(time.RFC3339))
		default:
			e.Reason = fmt.Sprintf("planned at its account's pace: it comes back at %s, about %s before its tick", info.NextProcessAt.Format(time.RFC3339), planLead)
		}
		return e, nil
	}
	return c.explainPending(ctx, v, lane, e, now)
}

// explainPending explains a call waiting in its lane's list.
func (c *Client) explainPending(ctx context.Context, v Vendor, lane shaper.Lane, e Explanation, now time.Time) (Explanation, error) {
	place, err := placeInLane(ctx, c.rdb, laneQueue(v.Name, lane), e.TaskID)
	if err != nil {
		return e, err
	}
	qs, err := readQueueStats(ctx, c.rdb, v.Name, queueCounts)
	if err != nil {
		return e, err
	}
	e.Place = place
	e.Ahead = place - 1 + qs.Active
	if lane == shaper.Normal {
		e.Ahead += qs.HighPending
	}
	b, err := c.bucketOf(v, e.Account)
	if err != nil {
		return e, err
	}
	st, err := b.Stats(ctx)
	if err != nil {
		return e, fmt.Errorf("queue: explain task %s: %w", e.TaskID, err)
	}
	est := estimateStart(st, e.Ahead, v.Policy.MaxInFlight, now)
	e.Binding, e.Reason, e.Rate = est.binding, est.reason, est.rate
	e.EstimatedStart = timePtr(est.start)
	if st.PausedFor > 0 {
		e.PausedUntil, e.PauseReason = timePtr(now.Add(st.PausedFor)), st.PauseReason
	}
	if paused, _ := c.rdb.Exists(ctx, queuePausedKey(c.cfg.KeyPrefix, v.Name)).Result(); paused > 0 && e.Binding == BindBacklog {
		e.Reason += "; the queue is paused by shaper until the wait is nearly over"
	}
	return e, nil
}

// bucketOf is the gate bucket that shapes a call of v (and account).
func (c *Client) bucketOf(v Vendor, account string) (*shaper.Bucket, error) {
	if !v.PerAccount {
		return c.gate.Bucket(bucketName(v.Name), v.Policy)
	}
	g, err := c.gate.Group(bucketName(v.Name), v.Total)
	if err != nil {
		return nil, fmt.Errorf("queue: vendor %s: %w", v.Name, err)
	}
	return g.Bucket(account, accountPolicy(v.Policy, v.Overrides, account))
}

// startEstimate is when a pending call should start, and what binds.
type startEstimate struct {
	start   time.Time
	binding string
	reason  string
	rate    float64 // calls per second
}

// estimateStart estimates when a call with ahead calls before it starts:
// after the longest of a pause, a spent quota and the next free tick,
// then one tick per call ahead at the effective rate.
func estimateStart(st shaper.Stats, ahead int64, maxInFlight int, now time.Time) startEstimate {
	rate := st.EffectiveRate / st.Window.Seconds()
	var quota time.Duration
	var spent string
	for _, u := range st.Limits {
		if u.Quota && u.NextIn > quota {
			quota, spent = u.NextIn, u.Limit.String()
		}
	}
	wait := max(st.PausedFor, quota)
	out := startEstimate{rate: rate, binding: BindBacklog}
	backlog := time.Duration(0)
	if rate > 0 {
		backlog = time.Duration(math.Round(float64(ahead) / rate * float64(time.Second)))
	}
	out.start = now.Add(wait + max(backlog, st.NextTick))
	switch {
	case st.PausedFor > 0 && st.PausedFor >= quota:
		out.binding = BindPause
		out.reason = fmt.Sprintf("the vendor is paused for %s (%s), then %d calls ahead at %.4g/s", st.PausedFor.Round(time.Millisecond), st.PauseReason, ahead, rate)
	case quota > 0:
		out.binding = BindQuota
		out.reason = fmt.Sprintf("the quota %s is spent for %s, then %d calls ahead at %.4g/s", spent, quota.Round(time.Second), ahead, rate)
	case maxInFlight > 0 && st.InFlight >= int64(maxInFlight):
		out.binding = BindInFlight
		out.reason = fmt.Sprintf("the in-flight cap (%d) is full; %d calls ahead at %.4g/s", maxInFlight, ahead, rate)
	default:
		out.reason = fmt.Sprintf("a backlog of %d calls ahead at the effective rate, %.4g/s (%s)", ahead, rate, st.Source)
	}
	return out
}

// placeInLane is id's place (1: next) in queue's pending list. asynq
// pushes new tasks on the left of its pending list and takes the next one
// from the right (internal/rdb's enqueue and dequeue scripts);
// TestPlaceInLane fails if that changes.
func placeInLane(ctx context.Context, rdb redis.UniversalClient, queue, id string) (int64, error) {
	key := asynqKey(queue, "pending")
	pipe := rdb.Pipeline()
	pos := pipe.LPos(ctx, key, id, redis.LPosArgs{})
	n := pipe.LLen(ctx, key)
	if _, err := pipe.Exec(ctx); err != nil && !errors.Is(err, redis.Nil) {
		return 0, fmt.Errorf("queue: find task %s in %s: %w", id, queue, err)
	}
	if pos.Err() != nil {
		return 0, fmt.Errorf("queue: task %s is no longer pending in %s (it was just taken)", id, queue)
	}
	return n.Val() - pos.Val(), nil
}

// isDeferral says whether a retry's error is a wait sent back to the
// queue (deferError's messages), not a failure.
func isDeferral(msg string) bool {
	return strings.HasPrefix(msg, deferWaitPrefix) || strings.HasPrefix(msg, deferRetryPrefix)
}

func timePtr(t time.Time) *time.Time { return &t }

// State is the asynq state of call id in e's queue (e from Explain:
// e.Vendor and e.Lane say where it is): one read, for following a call
// until it ends without the price of a whole Explain. ErrNoTask once the
// queue no longer holds it (cancelled, or past its retention).
func (c *Client) State(ctx context.Context, e Explanation) (string, error) {
	lane, err := ParseLane(e.Lane)
	if err != nil {
		return "", fmt.Errorf("queue: state of task %s: %w", e.TaskID, err)
	}
	info, err := asynq.NewInspectorFromRedisClient(c.rdb).GetTaskInfo(laneQueue(e.Vendor, lane), e.TaskID)
	if errors.Is(err, asynq.ErrTaskNotFound) || errors.Is(err, asynq.ErrQueueNotFound) {
		return "", fmt.Errorf("%w %q in vendor %s's queue", ErrNoTask, e.TaskID, e.Vendor)
	}
	if err != nil {
		return "", fmt.Errorf("queue: state of task %s: %w", e.TaskID, err)
	}
	return info.State.String(), nil
}
