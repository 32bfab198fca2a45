package queue

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"math"
	"strconv"
	"strings"
	"time"

	"github.com/hibiken/asynq"
	"github.com/redis/go-redis/v9"
	"google.golang.org/protobuf/encoding/protowire"

	"github.com/shaper-dev/shaper/shaper"
)

// States of a call in an export's results (ResultLine.State).
const (
	CallQueued    = "queued"    // waiting in its queue: pending, planned, or back to wait
	CallRetrying  = "retrying"  // failed, waiting for a retry
	CallRunning   = "running"   // a worker holds it
	CallDone      = "done"      // answered 2xx
	CallFailed    = "failed"    // ended without success (ResultLine.Error says why)
	CallCancelled = "cancelled" // cancelled before it started
	CallExpired   = "expired"   // past the retention: nothing is left of it
)

// ResultLine is one call of an export as ExportResults writes it, one
// JSON line each: its id, state, the vendor's status of its last
// attempt, its attempts, its last error, and its answer (CallResult, as
// kept).
type ResultLine struct {
	ID       string          `json:"id"`
	State    string          `json:"state"`
	Status   int             `json:"status,omitempty"`
	Attempts int             `json:"attempts"`
	Page     int             `json:"page,omitempty"`
	Error    string          `json:"error,omitempty"`
	Answer   json.RawMessage `json:"answer,omitempty"`

	big bool   // its answer is over readLines' budget: read it alone
	end string // its task's end mark (shaper_end: "ok", "failed"), set before asynq records the end
}

// ended reports whether the line's call has ended for good.
func (l ResultLine) ended() bool {
	switch l.State {
	case CallDone, CallFailed, CallCancelled, CallExpired:
		return true
	}
	return false
}

// ResultsQuery says which lines ExportResults writes, and how.
type ResultsQuery struct {
	// States keeps the lines of calls in these states (CallDone,
	// CallFailed, ...); none keeps every line.
	States []string
	// Follow writes lines as calls end, in the export's order (a line
	// waits for the calls before it), until the export finishes or ctx
	// ends; without it, ExportResults writes every call as it stands.
	Follow bool
	// Poll is how often a follow reads the export again while it waits;
	// default 250ms.
	Poll time.Duration
}

// resultsPage is how many calls ExportResults reads at a time, and
// resultsBudget the most answer bytes it holds at once: memory stays flat
// whatever the export's size.
const (
	resultsPage   = 256
	resultsBudget = 8 << 20
)

// ResultsSummary counts the lines ExportResults wrote.
type ResultsSummary struct {
	Lines int64 `json:"lines"`
	// Finished: the export finished (every call ended) by the last line.
	Finished bool `json:"finished"`
}

// ExportResults writes the calls of export id as NDJSON lines
// (ResultLine) to w, in the export's order: the order its calls were
// given in, each pull's pages after its first call in page order. It
// reads the export resultsPage calls at a time and holds at most
// resultsBudget bytes of answers (and one answer above it), whatever the
// export's size.
func (c *Client) ExportResults(ctx context.Context, id string, q ResultsQuery, w io.Writer) (ResultsSummary, error) {
	e, err := c.ExportStatus(ctx, id)
	if err != nil {
		return ResultsSummary{}, err
	}
	if !e.Ordered {
		return ResultsSummary{}, fmt.Errorf("queue: export %s was made by a shaper that did not keep an export's order (before 0.42): its calls' answers can be read one at a time with explain", id)
	}
	if q.Poll <= 0 {
		q.Poll = 250 * time.Millisecond
	}
	keep := map[string]bool{}
	for _, s := range q.States {
		keep[s] = true
	}
	enc := json.NewEncoder(w)
	enc.SetEscapeHTML(false)
	var sum ResultsSummary
	after := "-inf"
	settle := time.Now().Add(archiveWait)
	for {
		ids, scores, err := c.exportPage(ctx, id, after, resultsPage)
		if err != nil {
			return sum, err
		}
		want := answersAll
		if q.Follow {
			want = answersEnded
		}
		lines, err := c.readLines(ctx, id, e.Vendor, ids, want)
		if err != nil {
			return sum, err
		}
		if !q.Follow && ending(lines) && time.Now().Before(settle) {
			// A call whose end is marked and not yet recorded by asynq
			// (milliseconds): read it once recorded, with its state and
			// error, as the export's progress already counts it.
			select {
			case <-ctx.Done():
				return sum, ctx.Err()
			case <-time.After(20 * time.Millisecond):
			}
			continue
		}
		waiting := false
		for i, l := range lines {
			if q.Follow && !l.ended() {
				waiting = true
				break
			}
			if l.big {
				b, err := c.readAnswer(ctx, e.Vendor, l.ID)
				if err != nil {
					return sum, err
				}
				setAnswer(&l, b)
			}
			if len(keep) == 0 || keep[l.State] {
				if err := enc.Encode(l); err != nil {
					return sum, err
				}
				sum.Lines++
			}
			lines[i].Answer = nil
			after = "(" + strconv.FormatFloat(scores[i], 'f', -1, 64)
		}
		if !waiting && len(ids) == resultsPage {
			continue
		}
		if !q.Follow {
			e, err = c.ExportStatus(ctx, id)
			sum.Finished = err == nil && e.Finished()
			return sum, err
		}
		if !waiting {
			e, err = c.ExportStatus(ctx, id)
			if err != nil {
				return sum, err
			}
			if e.Finished() {
				// Every call ended: a page queued by the last of them is
				// counted in Total and read on the next pass.
				more, _, err := c.exportPage(ctx, id, after, 1)
				if err != nil {
					return sum, err
				}
				if len(more) == 0 {
					sum.Finished = true
					return sum, nil
				}
				continue
			}
		}
		if f, ok := w.(interface{ Flush() }); ok {
			f.Flush()
		}
		select {
		case <-ctx.Done():
			return sum, ctx.Err()
		case <-time.After(q.Poll):
		}
	}
}

// exportPage reads up to n of the export's call ids after the score
// after ("-inf", or "(score").
func (c *Client) exportPage(ctx context.Context, id, after string, n int64) ([]string, []float64, error) {
	zs, err := c.rdb.ZRangeByScoreWithScores(ctx, exportCallsKey(c.cfg.KeyPrefix, id), &redis.ZRangeBy{Min: after, Max: "+inf", Count: n}).Result()
	if err != nil {
		return nil, nil, fmt.Errorf("queue: read export %s: %w", id, err)
	}
	ids, scores := make([]string, len(zs)), make([]float64, len(zs))
	for i, z := range zs {
		ids[i], _ = z.Member.(string)
		scores[i] = z.Score
	}
	return ids, scores, nil
}

// answers says which answers readLines reads with the lines.
type answers int

const (
	answersNone  answers = iota // states only (retry, cancel)
	answersEnded                // the ended calls' (a follow writes no other)
	answersAll                  // every call's that has one
)

// readLines reads the lines of the calls ids of vendor, answers
// included within resultsBudget (an answer over the budget is left out,
// nil, for the caller to read alone); with all, ended or not.
func (c *Client) readLines(ctx context.Context, export, vendor string, ids []string, want answers) ([]ResultLine, error) {
	lanes := []shaper.Lane{shaper.Normal, shaper.High}
	pipe := c.rdb.Pipeline()
	type read struct {
		fields *redis.SliceCmd
		size   *redis.IntCmd
	}
	reads := make([][2]read, len(ids))
	for i, id := range ids {
		for l, lane := range lanes {
			key := asynqTaskKey(laneQueue(vendor, lane), id)
			reads[i][l] = read{pipe.HMGet(ctx, key, "state", "msg", "shaper_end"), pipe.HStrLen(ctx, key, "result")}
		}
	}
	failed := make([]*redis.BoolCmd, len(ids))
	cancelled := make([]*redis.BoolCmd, len(ids))
	for i, id := range ids {
		failed[i] = pipe.SIsMember(ctx, exportFailedKey(c.cfg.KeyPrefix, export), id)
		cancelled[i] = pipe.SIsMember(ctx, exportCancelledKey(c.cfg.KeyPrefix, export), id)
	}
	if _, err := pipe.Exec(ctx); err != nil && !errors.Is(err, redis.Nil) {
		return nil, fmt.Errorf("queue: read export %s's calls: %w", export, err)
	}
	lines := make([]ResultLine, len(ids))
	var withAnswer []int // the lines whose answers fit in the budget
	var laneOf []shaper.Lane
	budget := int64(resultsBudget)
	for i, id := range ids {
		lines[i] = ResultLine{ID: id, State: CallExpired}
		for l, r := range reads[i] {
			v := r.fields.Val()
			state, _ := v[0].(string)
			if state == "" {
				continue
			}
			msg, _ := v[1].(string)
			lines[i].end, _ = v[2].(string)
			retried, lastErr := taskMsgRetries([]byte(msg))
			lines[i].Attempts, lines[i].Error = retried+1, lastErr
			switch state {
			case "completed":
				lines[i].State, lines[i].Error = CallDone, ""
			case "archived":
				lines[i].State = CallFailed
			case "active":
				lines[i].State = CallRunning
			case "retry":
				lines[i].State = CallRetrying
				if retried == 0 { // a wait sent back to the queue, not a failure
					lines[i].State, lines[i].Error = CallQueued, ""
				}
			default:
				lines[i].State, lines[i].Error = CallQueued, ""
			}
			if lines[i].State == CallQueued || lines[i].State == CallRetrying {
				lines[i].Attempts = retried // the attempts made so far
			}
			switch size := r.size.Val(); {
			case size == 0 || want == answersNone || want == answersEnded && !lines[i].ended():
			case size <= budget:
				budget -= size
				withAnswer = append(withAnswer, i)
				laneOf = append(laneOf, lanes[l])
			default:
				lines[i].big = true
			}
			break
		}
		switch {
		case lines[i].State != CallExpired:
		case cancelled[i].Val():
			lines[i].State = CallCancelled
		case failed[i].Val():
			// Failed, and its archived task gone before the export's
			// retention: asynq keeps at most 10,000 per queue, 90 days.
			lines[i].State = CallFailed
			lines[i].Error = "failed; its archived task is gone (asynq keeps at most 10,000 failed tasks per queue, for 90 days), with its answer and error"
		}
	}
	if len(withAnswer) > 0 {
		pipe = c.rdb.Pipeline()
		res := make([]*redis.StringCmd, len(withAnswer))
		for k, i := range withAnswer {
			res[k] = pipe.HGet(ctx, asynqTaskKey(laneQueue(vendor, laneOf[k]), ids[i]), "result")
		}
		if _, err := pipe.Exec(ctx); err != nil && !errors.Is(err, redis.Nil) {
			return nil, fmt.Errorf("queue: read export %s's answers: %w", export, err)
		}
		for k, i := range withAnswer {
			setAnswer(&lines[i], []byte(res[k].Val()))
		}
	}
	return lines, nil
}

// readAnswer reads one call's answer alone (one over readLines' budget).
func (c *Client) readAnswer(ctx context.Context, vendor, id string) (json.RawMessage, error) {
	for _, lane := range []shaper.Lane{shaper.Normal, shaper.High} {
		b, err := c.rdb.HGet(ctx, asynqTaskKey(laneQueue(vendor, lane), id), "result").Bytes()
		if errors.Is(err, redis.Nil) {
			continue
		}
		if err != nil {
			return nil, fmt.Errorf("queue: read call %s's answer: %w", id, err)
		}
		return b, nil
	}
	return nil, nil
}

// setAnswer puts a stored answer on its line, with its status and page.
func setAnswer(l *ResultLine, b []byte) {
	if len(b) == 0 || !json.Valid(b) {
		return
	}
	var head struct {
		Status int `json:"status"`
		Page   int `json:"page"`
	}
	_ = json.Unmarshal(b, &head)
	l.Status, l.Page, l.Answer = head.Status, head.Page, b
}

// taskMsgRetries reads the retries a task used and its last error from
// its asynq message (asynq v0.26's TaskMessage protobuf: retried is
// field 6, error_msg field 7), without the whole message.
func taskMsgRetries(msg []byte) (retried int, lastErr string) {
	for len(msg) > 0 {
		num, typ, n := protowire.ConsumeTag(msg)
		if n < 0 {
			return retried, lastErr
		}
		msg = msg[n:]
		switch {
		case num == 6 && typ == protowire.VarintType:
			v, n := protowire.ConsumeVarint(msg)
			if n < 0 {
				return retried, lastErr
			}
			retried, msg = int(min(v, math.MaxInt32)), msg[n:]
			continue
		case num == 7 && typ == protowire.BytesType:
			v, n := protowire.ConsumeBytes(msg)
			if n < 0 {
				return retried, lastErr
			}
			lastErr, msg = string(v), msg[n:]
			continue
		}
		n = protowire.ConsumeFieldValue(num, typ, msg)
		if n < 0 {
			return retried, lastErr
		}
		msg = msg[n:]
	}
	return retried, lastErr
}

// ExportRetry says what RetryExport did.
type ExportRetry struct {
	Queued int      `json:"queued"` // failed calls queued again
	Gone   []string `json:"gone,omitempty"`
}

// RetryExport queues the export's failed calls again, in the export's
// order, under their own ids (a vendor that deduplicates by
// Idempotency-Key sees each as the same call). A call that failed for
// good runs again with the retries it had left (one attempt, when they
// were spent). A cancelled call, or one whose archived task asynq
// dropped (past 10,000 per queue, or 90 days), cannot run again: its id
// is in Gone (enqueue it again).
func (c *Client) RetryExport(ctx context.Context, id string) (ExportRetry, error) {
	e, err := c.ExportStatus(ctx, id)
	if err != nil {
		return ExportRetry{}, err
	}
	if !e.Ordered {
		return ExportRetry{}, fmt.Errorf("queue: export %s was made by a shaper that did not keep an export's calls (before 0.42): retry its archived tasks one by one", id)
	}
	insp := asynq.NewInspectorFromRedisClient(c.rdb)
	var out ExportRetry
	err = c.eachCall(ctx, e, func(l ResultLine) error {
		switch l.State {
		case CallCancelled:
			out.Gone = append(out.Gone, l.ID)
			return nil
		case CallFailed:
		case CallRunning:
			if l.end != "failed" {
				return nil
			}
			// It ended failed and asynq is archiving it: the export
			// counts it failed already (runAgain waits for it).
		default:
			return nil
		}
		queued, err := c.runAgain(ctx, insp, id, e.Vendor, l.ID)
		switch {
		case err != nil:
			return err
		case queued:
			out.Queued++
		case l.State == CallFailed && l.Attempts == 0: // its archived task is gone
			out.Gone = append(out.Gone, l.ID)
		}
		return nil
	})
	if err != nil {
		return out, err
	}
	if out.Queued > 0 {
		c.signal(ctx, e.Vendor)
	}
	return out, nil
}

// archiveWait bounds how long RetryExport waits for asynq to archive a
// call that ended failed: an export counts a call's end a moment before
// asynq records it (see endRun).
const archiveWait = 5 * time.Second

// Replies of rerunScript.
const (
	rerunNo    = 0 // not archived (or not there): nothing was changed
	rerunReady = 1 // ready to run again
	rerunWait  = 2 // ended failed, and asynq is archiving it: ask again
)

// rerunScript readies an archived call to run again for an export: its
// end mark goes, and the export joins those its end is recorded in. An
// export that adopted the call after it ended recorded that end at once
// and is not among them; without it, the call's new end would not count
// there and the export would never finish. Not bounded by maxFollowers:
// the export counts the call already.
//
// KEYS[1] the call's task hash (asynq's; fields state, shaper_end,
// shaper_exports); ARGV[1] the export. Returns rerunReady, rerunNo or
// rerunWait.
var rerunScript = redis.NewScript(`
local k_task = KEYS[1]
local a_export = ARGV[1]
local state, ended, list = unpack(redis.call('HMGET', k_task, 'state', 'shaper_end', 'shaper_exports'))
if state == 'active' and ended == 'failed' then return 2 end
if state ~= 'archived' then return 0 end
redis.call('HDEL', k_task, 'shaper_end')
list = list or ''
for e in string.gmatch(list, '[^,]+') do
  if e == a_export then return 1 end
end
if list ~= '' then list = list .. ',' end
redis.call('HSET', k_task, 'shaper_exports', list .. a_export)
return 1
`)

// runAgain moves an archived call of export back to its queue, and
// reports whether it did (a call run again meanwhile is not): its end
// mark and its place among the export's failures go first, so that its
// new end counts, in export as in the others that count it.
func (c *Client) runAgain(ctx context.Context, insp *asynq.Inspector, export, vendor, id string) (bool, error) {
	deadline := time.Now().Add(archiveWait)
	for _, lane := range []shaper.Lane{shaper.Normal, shaper.High} {
		q := laneQueue(vendor, lane)
		key := asynqTaskKey(q, id)
		for {
			r, err := rerunScript.Run(ctx, c.rdb, []string{key}, export).Int()
			if err != nil {
				return false, fmt.Errorf("queue: retry call %s: %w", id, err)
			}
			if r == rerunWait && time.Now().Before(deadline) {
				select {
				case <-ctx.Done():
					return false, ctx.Err()
				case <-time.After(50 * time.Millisecond):
				}
				continue
			}
			if r != rerunReady {
				break
			}
			if err := c.rdb.SRem(ctx, exportFailedKey(c.cfg.KeyPrefix, export), id).Err(); err != nil {
				return false, fmt.Errorf("queue: retry call %s: %w (run `shaper export retry %s` again)", id, err, export)
			}
			if err := insp.RunTask(q, id); err != nil {
				return false, fmt.Errorf("queue: retry call %s of export %s: %w (run `shaper export retry %s` again)", id, export, err, export)
			}
			return true, nil
		}
	}
	return false, nil
}

// ExportCancel says what CancelExport did.
type ExportCancel struct {
	Cancelled int `json:"cancelled"`
	// Running counts the calls a worker held: they were not cancelled
	// and end as they will.
	Running int `json:"running"`
}

// CancelExport cancels every call of the export that has not started
// (see Cancel): each counts as failed (cancelled), so that the export
// finishes once its running calls end. Pulls whose pages are running
// may still queue their next page.
func (c *Client) CancelExport(ctx context.Context, id string) (ExportCancel, error) {
	e, err := c.ExportStatus(ctx, id)
	if err != nil {
		return ExportCancel{}, err
	}
	if !e.Ordered {
		return ExportCancel{}, fmt.Errorf("queue: export %s was made by a shaper that did not keep an export's calls (before 0.42): cancel its calls one by one", id)
	}
	var out ExportCancel
	err = c.eachCall(ctx, e, func(l ResultLine) error {
		switch l.State {
		case CallRunning:
			out.Running++
			return nil
		case CallQueued, CallRetrying:
		default:
			return nil
		}
		// Cancel counts it in the export that queued it and in those
		// that adopted it (this one among them, when it did).
		_, err := c.CancelVendor(ctx, e.Vendor, l.ID)
		switch {
		case errors.Is(err, ErrStarted):
			out.Running++
		case errors.Is(err, ErrFinished), errors.Is(err, ErrNoTask):
		case err != nil:
			return err
		default:
			out.Cancelled++
		}
		return nil
	})
	return out, err
}

// eachCall hands fn every call of export e, in its order, as it stands
// (its state, without its answer), resultsPage calls at a time.
func (c *Client) eachCall(ctx context.Context, e Export, fn func(ResultLine) error) error {
	after := "-inf"
	for {
		ids, scores, err := c.exportPage(ctx, e.ID, after, resultsPage)
		if err != nil {
			return err
		}
		lines, err := c.readLines(ctx, e.ID, e.Vendor, ids, answersNone)
		if err != nil {
			return err
		}
		for _, l := range lines {
			if err := fn(l); err != nil {
				return err
			}
		}
		if len(ids) < resultsPage {
			return nil
		}
		after = "(" + strconv.FormatFloat(scores[len(scores)-1], 'f', -1, 64)
	}
}

// followers returns the exports that adopted call id of vendor while it
// was queued (its task hash's shaper_exports, see adoptScript).
func (c *Client) followers(ctx context.Context, vendor, id string) ([]string, error) {
	pipe := c.rdb.Pipeline()
	var lists []*redis.StringCmd
	for _, lane := range []shaper.Lane{shaper.Normal, shaper.High} {
		lists = append(lists, pipe.HGet(ctx, asynqTaskKey(laneQueue(vendor, lane), id), "shaper_exports"))
	}
	if _, err := pipe.Exec(ctx); err != nil && !errors.Is(err, redis.Nil) {
		return nil, fmt.Errorf("queue: read the exports of call %s: %w", id, err)
	}
	var out []string
	for _, l := range lists {
		if s := l.Val(); s != "" {
			out = append(out, strings.Split(s, ",")...)
		}
	}
	return out, nil
}

// ending reports whether a line's call has its end marked (shaper_end)
// and asynq has not recorded it yet.
func ending(lines []ResultLine) bool {
	for _, l := range lines {
		if l.State == CallRunning && l.end != "" {
			return true
		}
	}
	return false
}
