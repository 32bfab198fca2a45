package queue

import (
	"context"
	"crypto/rand"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"strconv"
	"strings"
	"time"

	"github.com/redis/go-redis/v9"
)

// exportGrace is how much longer than the calls' retention an export's
// progress is kept.
const exportGrace = 7 * 24 * time.Hour

// exportChunk is how many calls StartExportFrom records and queues at a
// time: memory stays flat whatever the export's size.
const exportChunk = 500

// maxFollowers bounds how many exports besides its own one call can count
// as theirs (an export re-run under a new id adopts the calls of the
// first that are still queued or done: see adoptScript).
const maxFollowers = 16

// ErrUnknownExport is returned for an export id that does not exist (or
// expired with its retention); ErrExportExists by StartExportFrom for an
// id that names an export of another vendor, or of other calls.
var (
	ErrUnknownExport = errors.New("queue: unknown export")
	ErrExportExists  = errors.New("queue: the export id is taken")
)

// Export is a named group of calls on one vendor, tracked to completion.
// Its calls have an order (the order they were given in; a pull's pages
// after its first call): ExportResults reads them back in it.
type Export struct {
	ID     string `json:"id"`
	Vendor string `json:"vendor"`
	// Total counts the export's calls, pages of its pulls included (it
	// grows as a pull finds pages).
	Total  int64 `json:"total"`
	Done   int64 `json:"done"`
	Failed int64 `json:"failed"`
	// Queued: every call given to the export is queued (or counted as
	// its own, already queued). An export whose enqueue stopped half way
	// is not; run it again with its id to queue the rest.
	Queued  bool      `json:"queued"`
	Created time.Time `json:"created"`
	// Ordered is false for an export made by a shaper before exports kept
	// their calls' order: its results cannot be read back.
	Ordered bool `json:"ordered"`
}

// Finished reports whether every call ended, well or not.
func (e Export) Finished() bool { return e.Queued && e.Done+e.Failed >= e.Total }

// State is "queueing", "running" or "finished".
func (e Export) State() string {
	switch {
	case !e.Queued:
		return "queueing"
	case e.Finished():
		return "finished"
	}
	return "running"
}

// newExportID returns a fresh export id.
func newExportID() string {
	var b [6]byte
	_, _ = rand.Read(b[:])
	return "exp-" + time.Now().UTC().Format("20060102-150405") + "-" + hex.EncodeToString(b[:])
}

// maxExportID bounds an export id: a call without an id of its own gets
// "<export id>:<n>", within a call id's 200 characters.
const maxExportID = 180

// CallSource hands calls to fn in order; StartExportFrom calls it twice
// (once to check every call, once to queue them), so it must give the
// same calls each time. Its errors (a *LineError per bad line, joined)
// are returned as they are.
type CallSource func(fn func(Call) error) error

// CallsOf is the CallSource of calls held in memory.
func CallsOf(calls []Call) CallSource {
	return func(fn func(Call) error) error {
		for _, c := range calls {
			if err := fn(c); err != nil {
				return err
			}
		}
		return nil
	}
}

// ExportStart says what StartExportFrom did.
type ExportStart struct {
	Export
	Enqueued      int // calls queued now
	AlreadyQueued int // calls whose id was queued before: counted as the export's own
}

// StartExport records an export of calls on vendor and enqueues them:
// StartExportFrom with the calls in memory.
func (c *Client) StartExport(ctx context.Context, id, vendor string, calls []Call) (Export, BatchResult, error) {
	st, err := c.StartExportFrom(ctx, id, vendor, CallsOf(calls))
	return st.Export, BatchResult{Enqueued: st.Enqueued, AlreadyQueued: st.AlreadyQueued}, err
}

// StartExportFrom records an export of the calls src gives on vendor and
// queues them, in order, a chunk at a time. Every call is checked first:
// one bad call and nothing is recorded or queued. An empty id gets a
// fresh one. A call without an id gets "<export id>:<n>" (its place in
// the export, from 1), so that running an export again under its id
// queues nothing twice and finishes what a first run left. A call whose
// id its vendor already holds (queued, running, or ended within the
// retention), by this export or another, counts as this export's own:
// its end counts here, and its answer reads back with the others.
func (c *Client) StartExportFrom(ctx context.Context, id, vendor string, src CallSource) (ExportStart, error) {
	v, err := c.vendor(vendor)
	if err != nil {
		return ExportStart{}, err
	}
	if id == "" {
		id = newExportID()
	} else if !idRe.MatchString(id) || len(id) > maxExportID {
		return ExportStart{}, fmt.Errorf("%w: export id %q: use 1-%d letters, digits and ._:@/+=-", ErrBadCall, id, maxExportID)
	}
	// Check every call first, keeping nothing but the errors and a digest
	// of the calls (a re-run under the same id must give the same calls).
	var errs []error
	n := 0
	digest := sha256.New()
	err = src(func(call Call) error {
		n++
		call.Vendor, call.Export = vendor, id
		if b, err := json.Marshal(call); err == nil {
			digest.Write(b)
			digest.Write([]byte{'\n'})
		}
		if err := c.checkCall(&call); err != nil {
			if errors.Is(err, ErrUnknownVendor) {
				return err
			}
			if call.line > 0 {
				errs = append(errs, &LineError{Line: call.line, Err: err})
			} else {
				errs = append(errs, fmt.Errorf("call %d: %w", n, err))
			}
		}
		return nil
	})
	if j, ok := err.(interface{ Unwrap() []error }); ok { // the source's bad lines
		errs, err = append(j.Unwrap(), errs...), nil
	}
	if err != nil {
		return ExportStart{}, err
	}
	if err = errors.Join(errs...); err != nil {
		return ExportStart{}, err
	}
	if n == 0 {
		return ExportStart{}, fmt.Errorf("%w: export %s has no calls", ErrBadCall, id)
	}
	if v.QueueLimit > 0 {
		waiting, err := c.Waiting(ctx, vendor)
		if err != nil {
			return ExportStart{}, err
		}
		if waiting+int64(n) > int64(v.QueueLimit) {
			return ExportStart{}, fmt.Errorf("%w: vendor %s holds %d calls and its queue_limit is %d: the export's %d calls do not fit; nothing was queued", ErrQueueFull, vendor, waiting, v.QueueLimit, n)
		}
	}
	key := exportKey(c.cfg.KeyPrefix, id)
	ttl := c.cfg.Retention + exportGrace
	sum := hex.EncodeToString(digest.Sum(nil))
	pipe := c.rdb.TxPipeline()
	pipe.HSetNX(ctx, key, "created", time.Now().UTC().Format(time.RFC3339))
	pipe.HSetNX(ctx, key, "vendor", vendor)
	pipe.HSetNX(ctx, key, "total", n) // read by shapers before ordered exports
	pipe.HSetNX(ctx, key, "digest", sum)
	pipe.Expire(ctx, key, ttl)
	was := pipe.HMGet(ctx, key, "vendor", "digest")
	if _, err := pipe.Exec(ctx); err != nil {
		return ExportStart{}, fmt.Errorf("queue: record export %s: %w", id, err)
	}
	switch v := was.Val(); {
	case v[0] != vendor:
		return ExportStart{}, fmt.Errorf("%w: export %s is on vendor %v, not %s: give this export another id", ErrExportExists, id, v[0], vendor)
	case v[1] != sum:
		return ExportStart{}, fmt.Errorf("%w: export %s was started with other calls (run again, an export must be given the same calls, in the same order): give these calls another export id", ErrExportExists, id)
	}
	out := ExportStart{Export: Export{ID: id, Vendor: vendor}}
	chunk := make([]Call, 0, exportChunk)
	flush := func() error {
		if len(chunk) == 0 {
			return nil
		}
		err := c.exportChunk(ctx, id, vendor, chunk, ttl, &out)
		chunk = chunk[:0]
		return err
	}
	pos := int64(0)
	err = src(func(call Call) error {
		pos++
		call.Vendor, call.Export, call.Seq = vendor, id, pos*pageRoom
		if call.ID == "" {
			call.ID = id + ":" + strconv.FormatInt(pos, 10)
		}
		if chunk = append(chunk, call); len(chunk) == exportChunk {
			return flush()
		}
		return nil
	})
	if err == nil {
		err = flush()
	}
	if err != nil {
		return out, fmt.Errorf("export %s: %d calls queued, %d already queued, then: %w (run it again with --id %s to queue the rest: nothing is queued twice)", id, out.Enqueued, out.AlreadyQueued, err, id)
	}
	if err := c.rdb.HSet(ctx, key, "queued", 1).Err(); err != nil {
		return out, fmt.Errorf("queue: export %s: every call is queued, but recording it failed: %w (run it again with --id %s)", id, err, id)
	}
	e, err := c.ExportStatus(ctx, id)
	out.Export = e
	return out, err
}

// exportChunk records the calls of a chunk in the export's order, then
// queues them; the calls already queued count as the export's own.
func (c *Client) exportChunk(ctx context.Context, id, vendor string, calls []Call, ttl time.Duration, out *ExportStart) error {
	order := exportCallsKey(c.cfg.KeyPrefix, id)
	pipe := c.rdb.Pipeline()
	for _, call := range calls {
		pipe.ZAddNX(ctx, order, redis.Z{Score: float64(call.Seq), Member: call.ID})
	}
	pipe.Expire(ctx, order, ttl)
	if _, err := pipe.Exec(ctx); err != nil {
		return fmt.Errorf("queue: record export %s's order: %w", id, err)
	}
	idx := make([]int, len(calls))
	for i := range idx {
		idx[i] = i
	}
	res, err := c.enqueueGroups(ctx, calls, []vendorGroup{{vendor, idx}})
	out.Enqueued += res.Enqueued
	if err != nil {
		return err
	}
	var adopt []BatchCall
	for _, bc := range res.Calls {
		if bc.State == StateAlreadyQueued {
			adopt = append(adopt, bc)
		}
	}
	out.AlreadyQueued += len(adopt)
	return c.adopt(ctx, id, vendor, adopt, ttl)
}

// adoptScript makes a call already queued count in one more export: when
// it has ended, it says how (the export records it at once); else it
// adds the export to those its end is recorded in.
//
// KEYS[1] the call's task hash (asynq's; fields shaper_end, shaper_exports
// and asynq's state); ARGV[1] the export, ARGV[2] maxFollowers. Returns
// "ok" or "failed" for a call that ended, "gone" when there is no such
// task, "full" when it counts in maxFollowers exports already, "" when
// its end will be recorded in the export.
var adoptScript = redis.NewScript(`
local k_task = KEYS[1]
local a_export = ARGV[1]
local a_max = tonumber(ARGV[2])
if redis.call('EXISTS', k_task) == 0 then return 'gone' end
local ended = redis.call('HGET', k_task, 'shaper_end')
if ended then return ended end
local state = redis.call('HGET', k_task, 'state')
if state == 'completed' then return 'ok' end
if state == 'archived' then return 'failed' end
local list = redis.call('HGET', k_task, 'shaper_exports') or ''
local n = 0
for e in string.gmatch(list, '[^,]+') do
  if e == a_export then return '' end
  n = n + 1
end
if n >= a_max then return 'full' end
if list ~= '' then list = list .. ',' end
redis.call('HSET', k_task, 'shaper_exports', list .. a_export)
return ''
`)

// adopt makes the calls already queued count in export id.
func (c *Client) adopt(ctx context.Context, id, vendor string, calls []BatchCall, ttl time.Duration) error {
	if len(calls) == 0 {
		return nil
	}
	pipe := c.rdb.Pipeline()
	cmds := make([]*redis.Cmd, len(calls))
	for i, bc := range calls {
		lane, _ := ParseLane(bc.Lane)
		cmds[i] = adoptScript.Eval(ctx, pipe, []string{asynqTaskKey(laneQueue(vendor, lane), bc.ID)}, id, maxFollowers)
	}
	if _, err := pipe.Exec(ctx); err != nil {
		return fmt.Errorf("queue: count the calls already queued in export %s: %w", id, err)
	}
	var ended [2][]string // ok, failed
	var errs []error
	for i, cmd := range cmds {
		switch cmd.Val() {
		case "ok":
			ended[0] = append(ended[0], calls[i].ID)
		case "failed", "gone": // gone: deleted since it was found (a cancel)
			ended[1] = append(ended[1], calls[i].ID)
		case "full":
			errs = append(errs, fmt.Errorf("call %s of vendor %s counts in %d exports already; it is not counted in export %s", calls[i].ID, vendor, maxFollowers, id))
			ended[1] = append(ended[1], calls[i].ID)
		}
	}
	pipe = c.rdb.Pipeline()
	for k, ids := range ended {
		if len(ids) > 0 {
			markPipe(ctx, pipe, c.cfg.KeyPrefix, id, ids, k == 0, ttl)
		}
	}
	if _, err := pipe.Exec(ctx); err != nil {
		errs = append(errs, fmt.Errorf("queue: record the ended calls already queued in export %s: %w", id, err))
	}
	return errors.Join(errs...)
}

// ExportStatus reads an export's progress in one round trip.
func (c *Client) ExportStatus(ctx context.Context, id string) (Export, error) {
	return exportStatus(ctx, c.rdb, c.cfg.KeyPrefix, id)
}

func exportStatus(ctx context.Context, rdb redis.UniversalClient, prefix, id string) (Export, error) {
	pipe := rdb.Pipeline()
	h := pipe.HGetAll(ctx, exportKey(prefix, id))
	done := pipe.SCard(ctx, exportDoneKey(prefix, id))
	failed := pipe.SCard(ctx, exportFailedKey(prefix, id))
	calls := pipe.ZCard(ctx, exportCallsKey(prefix, id))
	if _, err := pipe.Exec(ctx); err != nil {
		return Export{}, fmt.Errorf("queue: export %s: %w", id, err)
	}
	m := h.Val()
	if len(m) == 0 {
		return Export{}, fmt.Errorf("%w %q (exports are kept for the retention period plus 7 days)", ErrUnknownExport, id)
	}
	created, _ := time.Parse(time.RFC3339, m["created"])
	e := Export{ID: id, Vendor: m["vendor"], Total: calls.Val(), Done: done.Val(), Failed: failed.Val(), Created: created,
		Queued: m["queued"] != "", Ordered: calls.Val() > 0}
	if !e.Ordered { // made before exports kept their order: its calls were all queued at once
		e.Total, _ = strconv.ParseInt(m["total"], 10, 64)
		e.Queued = true
	}
	return e, nil
}

// endScript records a run's end in its call's task hash: its answer as
// the task's result (field result, as asynq's ResultWriter writes it)
// and, when the call ended, how (field shaper_end: an export that adopts
// it later reads it there, see adoptScript); it returns the exports that
// count the call.
//
// KEYS[1] the call's task hash. ARGV[1] "ok" or "failed" when the call
// ended, "" when it will run again; ARGV[2] the answer, "" for none.
// Returns the ids of the exports that adopted the call, comma-separated
// ("" for none); false when the task is gone (nothing is written).
var endScript = redis.NewScript(`
local k_task = KEYS[1]
local a_end, a_answer = ARGV[1], ARGV[2]
if redis.call('EXISTS', k_task) == 0 then return false end
if a_answer ~= '' then redis.call('HSET', k_task, 'result', a_answer) end
if a_end == '' then return '' end
redis.call('HSET', k_task, 'shaper_end', a_end)
return redis.call('HGET', k_task, 'shaper_exports') or ''
`)

// markPipe records in pipe that the calls ids of export ended, well (ok)
// or not: in one of its two sets, and out of the other (a call run again
// by RetryExport may end otherwise).
func markPipe(ctx context.Context, pipe redis.Pipeliner, prefix, export string, ids []string, ok bool, ttl time.Duration) {
	to, from := exportFailedKey(prefix, export), exportDoneKey(prefix, export)
	if ok {
		to, from = from, to
	}
	members := make([]any, len(ids))
	for i, id := range ids {
		members[i] = id
	}
	pipe.SAdd(ctx, to, members...)
	pipe.SRem(ctx, from, members...)
	pipe.Expire(ctx, to, ttl)
	pipe.Expire(ctx, from, ttl)
}

// endRun records the end of a run in one round trip: the answer as
// the task's result (the last attempt's; nil for none) and, when the
// call ended (done, or failed for good: not retried, or out of
// retries), how, in its task hash and in its export's sets. One round
// trip more when another export adopted the call. When Redis goes away
// as it does, it waits for it and tries again (see throughOutage).
func (w *Worker) endRun(ctx context.Context, taskKey, vendor, export, id string, res CallResult, err error) {
	answer := w.answerBytes(vendor, id, res)
	how := ""
	if callEnded(ctx, err) {
		how = "failed"
		if err == nil {
			how = "ok"
		}
	}
	if answer == nil && how == "" {
		return
	}
	// The record outlives the worker's shutdown; the wait for Redis does
	// not. An export that missed the end would never finish.
	mark := context.WithoutCancel(ctx)
	if e := w.throughOutage(ctx, func() error { return w.endRunOnce(mark, taskKey, export, id, how, answer) }); e != nil {
		w.log.Warn("could not record the call's answer and how it ended", "vendor", vendor, "export", export, "task", id, "err", e)
	}
}

// endRunOnce is one try of endRun. Every write in it can be sent twice
// (go-redis's retries, EVAL after NOSCRIPT) without harm.
func (w *Worker) endRunOnce(ctx context.Context, taskKey, export, id, how string, answer []byte) error {
	ttl := w.cfg.Retention + exportGrace
	send := func(eval bool) (*redis.Cmd, error) {
		pipe := w.rdb.Pipeline()
		var followers *redis.Cmd
		if eval {
			followers = endScript.Eval(ctx, pipe, []string{taskKey}, how, answer)
		} else {
			followers = endScript.EvalSha(ctx, pipe, []string{taskKey}, how, answer)
		}
		if export != "" && how != "" {
			markPipe(ctx, pipe, w.cfg.KeyPrefix, export, []string{id}, how == "ok", ttl)
		}
		_, e := pipe.Exec(ctx)
		return followers, e
	}
	followers, e := send(false)
	if redis.HasErrorPrefix(followers.Err(), "NOSCRIPT") {
		followers, e = send(true) // Redis has no copy of the script yet
	}
	if e != nil && !errors.Is(e, redis.Nil) {
		return e
	}
	list, _ := followers.Text()
	if list == "" {
		return nil
	}
	pipe := w.rdb.Pipeline()
	for f := range strings.SplitSeq(list, ",") {
		if f != export {
			markPipe(ctx, pipe, w.cfg.KeyPrefix, f, []string{id}, how == "ok", ttl)
		}
	}
	_, e = pipe.Exec(ctx)
	return e
}
