package api

import (
	"bufio"
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"io"
	"net/http"
	"net/url"
	"os"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/shaper-dev/shaper/queue"
)

// DefaultMaxExportBody bounds a POST /v1/exports body when
// Options.MaxExportBody is not set: 256 MiB, spooled to a temporary file,
// never held in memory.
const DefaultMaxExportBody = 256 << 20

// Bounds of an export's requests.
const (
	// exportTimeout bounds the queueing of one export's calls, once its
	// body is read.
	exportTimeout = 10 * time.Minute
	// streamGrace is how long one write of an answer may take: a request
	// that reads a big body or writes a long stream has its deadline
	// pushed this far ahead as it goes (instead of the server's
	// ReadTimeout and WriteTimeout, which bound the whole request), so
	// that only a client that stops sending or reading is cut.
	streamGrace = time.Minute
)

// ExportProgress is an export's progress: GET /v1/exports/{id}, and the
// same as shaper export status --json.
type ExportProgress struct {
	queue.Export
	// State is "queueing" (not every call is queued yet: post the export
	// again with its id), "running" or "finished".
	State string `json:"state"`
}

func progressOf(e queue.Export) ExportProgress { return ExportProgress{e, e.State()} }

// ExportStarted is POST /v1/exports's answer: the export's progress, and
// what the POST queued.
type ExportStarted struct {
	ExportProgress
	// Enqueued counts the calls queued by this POST; AlreadyQueued those
	// whose id was queued before (by an earlier POST of the export, or
	// by another export or POST /v1/calls): each counts as the export's
	// own, and is not queued twice.
	Enqueued      int `json:"enqueued"`
	AlreadyQueued int `json:"already_queued"`
}

// postExport starts an export (queue.Client.StartExportFrom) of the
// body's NDJSON call lines on ?vendor=, under ?id= (or a fresh id),
// each line without an account taking ?account=. The body is spooled to
// a temporary file, read twice (every call checked, then queued a chunk
// at a time) and removed: memory stays flat whatever its size, up to
// Options.MaxExportBody.
func (s *server) postExport(w http.ResponseWriter, r *http.Request) {
	if ct, ok := mediaType(r); !ok || ct != "application/x-ndjson" {
		msg := ct
		if ok {
			msg = fmt.Sprintf("Content-Type %q: an export's body is NDJSON, one call per line: send application/x-ndjson", r.Header.Get("Content-Type"))
		}
		writeError(w, http.StatusUnsupportedMediaType, msg, nil)
		return
	}
	q := r.URL.Query()
	vendor, id, account := q.Get("vendor"), q.Get("id"), q.Get("account")
	if vendor == "" {
		writeError(w, http.StatusBadRequest, "no vendor: name the [vendors.NAME] table of the config the export's calls go to, once: POST /v1/exports?vendor=NAME", nil)
		return
	}
	existed := false
	if id == "" {
		id = newExportID()
	} else if e, err := s.o.Client.ExportStatus(r.Context(), id); err == nil {
		if e.Vendor != vendor {
			writeError(w, http.StatusConflict, fmt.Sprintf("export %s is on vendor %s, not %s: post its calls with ?vendor=%s, or give this export another id", id, e.Vendor, vendor, e.Vendor), nil)
			return
		}
		existed = true
	} else if !errors.Is(err, queue.ErrUnknownExport) {
		unavailable(w, err.Error())
		return
	}
	body, cleanup, err := s.spool(w, r)
	defer cleanup()
	var tooLarge *http.MaxBytesError
	switch {
	case errors.As(err, &tooLarge):
		writeError(w, http.StatusRequestEntityTooLarge, fmt.Sprintf("the body is larger than %d bytes: split the calls in several exports, each under an id of its own", s.o.MaxExportBody), nil)
		return
	case errors.Is(err, errSpool):
		unavailable(w, err.Error())
		return
	case err != nil:
		writeError(w, http.StatusBadRequest, "reading the body: "+err.Error(), nil)
		return
	}
	src := func(fn func(queue.Call) error) error {
		if _, err := body.Seek(0, io.SeekStart); err != nil {
			return fmt.Errorf("%w: %w", errSpool, err)
		}
		return queue.ScanCalls(bufio.NewReaderSize(body, 64<<10), false, func(c queue.Call) error {
			if c.Account == "" {
				c.Account = account
			}
			return fn(c)
		})
	}
	// As for POST /v1/calls, a client that goes away does not stop the
	// queueing half way.
	ctx, cancel := context.WithTimeout(context.WithoutCancel(r.Context()), exportTimeout)
	defer cancel()
	st, err := s.o.Client.StartExportFrom(ctx, id, vendor, src)
	_ = http.NewResponseController(w).SetWriteDeadline(time.Now().Add(streamGrace))
	var le *queue.LineError
	switch {
	case err == nil:
	case errors.As(err, &le):
		writeError(w, http.StatusBadRequest, badCalls, exportLines(err))
		return
	case errors.Is(err, queue.ErrUnknownVendor):
		writeError(w, http.StatusBadRequest, err.Error(), nil)
		return
	case errors.Is(err, queue.ErrExportExists):
		writeError(w, http.StatusConflict, err.Error(), nil)
		return
	case errors.Is(err, queue.ErrQueueFull):
		w.Header().Set("Retry-After", "1")
		writeError(w, http.StatusTooManyRequests, err.Error()+"; try again when it has drained", nil)
		return
	case errors.Is(err, queue.ErrBadCall):
		writeError(w, http.StatusBadRequest, err.Error(), nil)
		return
	default:
		unavailable(w, fmt.Sprintf("%v; export %s is not wholly queued: POST the same body again to /v1/exports?vendor=%s&id=%s to queue the rest (nothing is queued twice)",
			err, id, url.QueryEscape(vendor), url.QueryEscape(id)))
		return
	}
	w.Header().Set("Location", "/v1/exports/"+url.PathEscape(st.ID))
	status := http.StatusCreated
	if existed && st.Enqueued == 0 {
		status = http.StatusOK
	}
	writeJSON(w, status, ExportStarted{progressOf(st.Export), st.Enqueued, st.AlreadyQueued})
}

// errSpool marks a failure of the temporary file a body is spooled to.
var errSpool = errors.New("api: spooling the body to a temporary file")

// spool copies r's body, at most Options.MaxExportBody bytes, to a
// temporary file (in $TMPDIR, readable by this user only); cleanup
// closes and removes it. A body announced larger is refused before any
// of it is read. The body may take as long as it needs while it keeps
// coming: each read pushes the read deadline streamGrace ahead.
func (s *server) spool(w http.ResponseWriter, r *http.Request) (*os.File, func(), error) {
	limit := s.o.MaxExportBody
	if r.ContentLength > limit {
		return nil, func() {}, &http.MaxBytesError{Limit: limit}
	}
	f, err := os.CreateTemp("", "shaper-export-*.ndjson")
	if err != nil {
		return nil, func() {}, fmt.Errorf("%w: %w", errSpool, err)
	}
	cleanup := func() { f.Close(); os.Remove(f.Name()) }
	in := &deadlineReader{r: http.MaxBytesReader(w, r.Body, limit), rc: http.NewResponseController(w)}
	if _, err := io.Copy(f, in); err != nil {
		if in.err == nil { // the file failed, not the body
			err = fmt.Errorf("%w: %w", errSpool, err)
		}
		return nil, cleanup, err
	}
	return f, cleanup, nil
}

// deadlineReader reads a request body, pushing its read deadline
// streamGrace ahead at most once a second; err is the body's last error.
type deadlineReader struct {
	r    io.Reader
	rc   *http.ResponseController
	last time.Time
	err  error
}

func (d *deadlineReader) Read(p []byte) (int, error) {
	if now := time.Now(); now.Sub(d.last) >= time.Second {
		d.last = now
		_ = d.rc.SetReadDeadline(now.Add(streamGrace))
	}
	n, err := d.r.Read(p)
	if err != nil && err != io.EOF {
		d.err = err
	}
	return n, err
}

// exportLines lists the bad lines of an export's body: lines' list, with
// the CLI's wording of a line that names a vendor put in the API's.
func exportLines(err error) []lineError {
	out := lines(err)
	for i, l := range out {
		if strings.HasPrefix(l.Error, `"vendor" is not part of a call line`) {
			out[i].Error = `"vendor" is not part of an export's call line: the export's vendor is given once, as ?vendor=`
		}
	}
	return out
}

// newExportID is a fresh export id, in queue's format: the API names an
// export before queueing it, so that an answer can name it whatever
// happens.
func newExportID() string {
	var b [6]byte
	_, _ = rand.Read(b[:])
	return "exp-" + time.Now().UTC().Format("20060102-150405") + "-" + hex.EncodeToString(b[:])
}

// getExport answers an export's progress.
func (s *server) getExport(w http.ResponseWriter, r *http.Request) {
	e, ok := s.export(w, r, false)
	if ok {
		writeJSON(w, http.StatusOK, progressOf(e))
	}
}

// export reads the export of r's path, answering 404 for an unknown one,
// 503 for Redis, and with ordered, 409 for an export made before exports
// kept their calls' order (its calls cannot be listed).
func (s *server) export(w http.ResponseWriter, r *http.Request, ordered bool) (queue.Export, bool) {
	id := r.PathValue("id")
	e, err := s.o.Client.ExportStatus(r.Context(), id)
	switch {
	case errors.Is(err, queue.ErrUnknownExport):
		writeError(w, http.StatusNotFound, err.Error(), nil)
		return e, false
	case err != nil:
		unavailable(w, err.Error())
		return e, false
	case ordered && !e.Ordered:
		writeError(w, http.StatusConflict, fmt.Sprintf("export %s was made by a shaper before 0.42, which did not keep an export's calls: follow its calls one by one (GET /v1/calls/{id})", id), nil)
		return e, false
	}
	return e, true
}

// resultStates are the states ?state= may name.
var resultStates = []string{queue.CallQueued, queue.CallRetrying, queue.CallRunning, queue.CallDone, queue.CallFailed, queue.CallCancelled, queue.CallExpired}

// getResults streams an export's results (queue.Client.ExportResults) as
// NDJSON, one line per call in the export's order; ?state= keeps the
// lines of calls in those states; ?follow=true writes lines as calls
// end, in order, until the export finishes (a follow holds a slot of
// Options.MaxWaiting, as a GET ?wait= does). The stream ends when every
// line is written; an error past the first line (Redis, the server
// shutting down) breaks the connection instead, so that a client never
// takes a cut stream for a whole one.
func (s *server) getResults(w http.ResponseWriter, r *http.Request) {
	q := r.URL.Query()
	var rq queue.ResultsQuery
	if f := q.Get("follow"); f != "" {
		var err error
		if rq.Follow, err = strconv.ParseBool(f); err != nil {
			writeError(w, http.StatusBadRequest, fmt.Sprintf("follow=%q: true or false", f), nil)
			return
		}
	}
	for _, v := range q["state"] {
		for st := range strings.SplitSeq(v, ",") {
			if !slices.Contains(resultStates, st) {
				writeError(w, http.StatusBadRequest, fmt.Sprintf("state=%q: want %s (comma-separated, or state= repeated)", st, strings.Join(resultStates, ", ")), nil)
				return
			}
			rq.States = append(rq.States, st)
		}
	}
	if rq.Follow {
		select {
		case s.waiting <- struct{}{}:
			defer func() { <-s.waiting }()
		default:
			w.Header().Set("Retry-After", "1")
			writeError(w, http.StatusServiceUnavailable, fmt.Sprintf("%d requests already wait (?wait=, ?follow=) on this server, as many as it holds at once: "+
				"retry after Retry-After, or read the results without ?follow=", cap(s.waiting)), nil)
			return
		}
	}
	if _, ok := s.export(w, r, true); !ok {
		return
	}
	// A shutdown ends a follow: the client sees the stream break, and
	// follows again from another server.
	ctx, cancel := context.WithCancel(r.Context())
	defer cancel()
	defer context.AfterFunc(s.base, cancel)()
	w.Header().Set("Content-Type", "application/x-ndjson")
	w.Header().Set("Cache-Control", "no-store")
	w.WriteHeader(http.StatusOK)
	out := &stream{w: w, rc: http.NewResponseController(w)}
	_, err := s.o.Client.ExportResults(ctx, r.PathValue("id"), rq, out)
	switch {
	case err == nil:
		out.Flush()
	case r.Context().Err() != nil: // the client went away
	default:
		// A 200 is sent: break the connection, so that the stream is not
		// read as ended (a chunked answer without its last chunk).
		panic(http.ErrAbortHandler)
	}
}

// stream is a results stream's writer: ExportResults flushes it when it
// waits, and each write or flush pushes the write deadline streamGrace
// ahead (at most once a second), so that the server's WriteTimeout
// never cuts a long stream, only a client that stops reading.
type stream struct {
	w    http.ResponseWriter
	rc   *http.ResponseController
	last time.Time
}

func (s *stream) Write(p []byte) (int, error) {
	s.extend()
	return s.w.Write(p)
}

// Flush sends what is written.
func (s *stream) Flush() {
	s.extend()
	_ = s.rc.Flush()
}

func (s *stream) extend() {
	if now := time.Now(); now.Sub(s.last) >= time.Second {
		s.last = now
		_ = s.rc.SetWriteDeadline(now.Add(streamGrace))
	}
}

// retryExport queues an export's failed calls again
// (queue.Client.RetryExport).
func (s *server) retryExport(w http.ResponseWriter, r *http.Request) {
	if _, ok := s.export(w, r, true); !ok {
		return
	}
	res, err := s.o.Client.RetryExport(r.Context(), r.PathValue("id"))
	if err != nil {
		unavailable(w, fmt.Sprintf("%v; %d call(s) were queued again before it: POST retry again to queue the others", err, res.Queued))
		return
	}
	writeJSON(w, http.StatusOK, res)
}

// cancelExport cancels every call of an export that has not started
// (queue.Client.CancelExport).
func (s *server) cancelExport(w http.ResponseWriter, r *http.Request) {
	if _, ok := s.export(w, r, true); !ok {
		return
	}
	res, err := s.o.Client.CancelExport(r.Context(), r.PathValue("id"))
	if err != nil {
		unavailable(w, fmt.Sprintf("%v; %d call(s) were cancelled before it: POST cancel again to cancel the others", err, res.Cancelled))
		return
	}
	writeJSON(w, http.StatusOK, res)
}

// unavailable answers 503 for Redis (or the disk), safe to retry.
func unavailable(w http.ResponseWriter, msg string) {
	w.Header().Set("Retry-After", "1")
	writeError(w, http.StatusServiceUnavailable, msg, nil)
}
