package queue

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"strconv"
	"time"

	"github.com/redis/go-redis/v9"
)

// exportGrace is how much longer than the calls' retention an export's
// progress is kept.
const exportGrace = 7 * 24 * time.Hour

// ErrUnknownExport is returned for an export id that does not exist (or
// expired with its retention).
var ErrUnknownExport = errors.New("queue: unknown export")

// Export is a named group of calls on one vendor, tracked to completion.
type Export struct {
	ID      string    `json:"id"`
	Vendor  string    `json:"vendor"`
	Total   int64     `json:"total"`
	Done    int64     `json:"done"`
	Failed  int64     `json:"failed"`
	Created time.Time `json:"created"`
}

// Finished reports whether every call ended, well or not.
func (e Export) Finished() bool { return e.Done+e.Failed >= e.Total }

// newExportID returns a fresh export id.
func newExportID() string {
	var b [6]byte
	_, _ = rand.Read(b[:])
	return "exp-" + time.Now().UTC().Format("20060102-150405") + "-" + hex.EncodeToString(b[:])
}

// StartExport records an export of calls on vendor and enqueues them, all
// validated and checked against queue_limit first. An empty id gets a
// fresh one; re-running an export with the same id and call ids queues
// nothing twice.
func (c *Client) StartExport(ctx context.Context, id, vendor string, calls []Call) (Export, BatchResult, error) {
	if _, err := c.vendor(vendor); err != nil {
		return Export{}, BatchResult{}, err
	}
	if id == "" {
		id = newExportID()
	} else if !idRe.MatchString(id) {
		return Export{}, BatchResult{}, fmt.Errorf("%w: export id %q: use 1-200 letters, digits and ._:@/+=-", ErrBadCall, id)
	}
	for i := range calls {
		calls[i].Export = id
	}
	if err := c.checkCalls(vendor, calls); err != nil {
		return Export{}, BatchResult{}, err // nothing recorded, nothing queued
	}
	e := Export{ID: id, Vendor: vendor, Total: int64(len(calls)), Created: time.Now().UTC()}
	key := exportKey(c.cfg.KeyPrefix, id)
	ttl := c.cfg.Retention + exportGrace
	err := c.rdb.HSet(ctx, key, "vendor", vendor, "total", e.Total, "created", e.Created.Format(time.RFC3339)).Err()
	if err == nil {
		err = c.rdb.Expire(ctx, key, ttl).Err()
	}
	if err != nil {
		return Export{}, BatchResult{}, fmt.Errorf("queue: record export %s: %w", id, err)
	}
	res, err := c.EnqueueBatch(ctx, vendor, calls)
	return e, res, err
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
	if _, err := pipe.Exec(ctx); err != nil {
		return Export{}, fmt.Errorf("queue: export %s: %w", id, err)
	}
	m := h.Val()
	if len(m) == 0 {
		return Export{}, fmt.Errorf("%w %q (exports are kept for the retention period plus 7 days)", ErrUnknownExport, id)
	}
	total, _ := strconv.ParseInt(m["total"], 10, 64)
	created, _ := time.Parse(time.RFC3339, m["created"])
	return Export{ID: id, Vendor: m["vendor"], Total: total, Done: done.Val(), Failed: failed.Val(), Created: created}, nil
}

// markExport records that a call of an export ended.
func markExport(ctx context.Context, rdb redis.UniversalClient, prefix, id, taskID string, ok bool, ttl time.Duration) error {
	key := exportFailedKey(prefix, id)
	if ok {
		key = exportDoneKey(prefix, id)
	}
	pipe := rdb.Pipeline()
	pipe.SAdd(ctx, key, taskID)
	pipe.Expire(ctx, key, ttl)
	_, err := pipe.Exec(ctx)
	return err
}

// markEnd records the end of an export's call: done, or failed for good
// (not retried, or out of retries).
func (w *Worker) markEnd(ctx context.Context, export, id string, err error) {
	if export == "" || !callEnded(ctx, err) {
		return
	}
	if e := markExport(context.WithoutCancel(ctx), w.rdb, w.cfg.KeyPrefix, export, id, err == nil, w.cfg.Retention+exportGrace); e != nil {
		w.log.Warn("could not record export progress", "export", export, "task", id, "err", e)
	}
}
