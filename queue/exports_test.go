package queue

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"net/http"
	"runtime"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/shaper-dev/shaper/internal/redistest"
)

// exportVendor answers each call with a compact JSON body naming its
// Idempotency-Key, padded to pad bytes; the keys in fail get a 422 until
// fixed; a key in block (or every key, with blockAll) waits for its
// channel to close before it is answered. It records what it sent.
type exportVendor struct {
	pad    int
	forget bool // keep no answer (sent stays empty)

	mu       sync.Mutex
	tries    map[string]int
	sent     map[string][]byte
	fail     map[string]bool
	fixed    bool
	block    map[string]chan struct{}
	blockAll chan struct{}
	asked    atomic.Int64 // requests received
}

func newExportVendor(pad int) *exportVendor {
	return &exportVendor{pad: pad, tries: map[string]int{}, sent: map[string][]byte{}, fail: map[string]bool{}, block: map[string]chan struct{}{}}
}

// exportAnswer is the vendor's 2xx body for key, pad bytes long when pad
// is more than the bare body.
func exportAnswer(key string, pad int) []byte {
	head, end := `{"id":"`+key+`","waybill":"WB-`+key+`","pad":"`, `"}`
	return []byte(head + strings.Repeat("p", max(0, pad-len(head)-len(end))) + end)
}

func (v *exportVendor) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	key := r.Header.Get("Idempotency-Key")
	v.asked.Add(1)
	v.mu.Lock()
	wait := v.block[key]
	if v.blockAll != nil {
		wait = v.blockAll
	}
	v.mu.Unlock()
	if wait != nil {
		select {
		case <-wait:
		case <-r.Context().Done():
			return // not answered
		}
	}
	v.mu.Lock()
	v.tries[key]++
	status, body := http.StatusOK, exportAnswer(key, v.pad)
	if v.fail[key] && !v.fixed {
		status, body = http.StatusUnprocessableEntity, []byte(`{"error":"order `+key+` has no address"}`)
	}
	if !v.forget {
		v.sent[key] = body
	}
	v.mu.Unlock()
	w.Header().Set("Content-Type", "application/json")
	w.WriteHeader(status)
	_, _ = w.Write(body)
}

// answered returns how often the vendor answered key, and its last body.
func (v *exportVendor) answered(key string) (int, []byte) {
	v.mu.Lock()
	defer v.mu.Unlock()
	return v.tries[key], v.sent[key]
}

// setTimeout sets the last vendor's timeout (a test whose vendor holds
// calls for longer than the env's 5 s).
func (e *env) setTimeout(d time.Duration) { e.vendors[len(e.vendors)-1].Timeout = d }

// exportCalls makes n POST calls, with ids id(i) ("" for none).
func exportCalls(n int, id func(i int) string) []Call {
	calls := make([]Call, n)
	for i := range calls {
		calls[i] = Call{ID: id(i), Method: "POST", Path: fmt.Sprintf("/orders/%d", i), Body: []byte(fmt.Sprintf(`{"order":%d}`, i))}
	}
	return calls
}

// waitExport waits until export id finished, and returns its status.
func waitExport(t *testing.T, c *Client, id string, d time.Duration) Export {
	t.Helper()
	var e Export
	waitFor(t, d, "export "+id+" to finish", func() bool {
		var err error
		e, err = c.ExportStatus(context.Background(), id)
		if err != nil {
			t.Fatal(err)
		}
		return e.Finished()
	})
	return e
}

// results reads export id's results as they stand (or followed, with q).
func results(t *testing.T, c *Client, id string, q ResultsQuery) ([]ResultLine, ResultsSummary) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	var buf bytes.Buffer
	sum, err := c.ExportResults(ctx, id, q, &buf)
	if err != nil {
		t.Fatalf("ExportResults(%s): %v (%d lines)", id, err, sum.Lines)
	}
	lines := decodeLines(t, buf.Bytes())
	if int64(len(lines)) != sum.Lines {
		t.Errorf("ExportResults says %d lines, wrote %d", sum.Lines, len(lines))
	}
	return lines, sum
}

func decodeLines(t *testing.T, b []byte) []ResultLine {
	t.Helper()
	var out []ResultLine
	for _, raw := range bytes.Split(b, []byte("\n")) {
		if len(raw) == 0 {
			continue
		}
		var l ResultLine
		if err := json.Unmarshal(raw, &l); err != nil {
			t.Fatalf("result line %.200q: %v", raw, err)
		}
		out = append(out, l)
	}
	return out
}

// lineBody is the body of a line's answer.
func lineBody(t *testing.T, l ResultLine) []byte {
	t.Helper()
	var a CallResult
	if err := json.Unmarshal(l.Answer, &a); err != nil {
		t.Fatalf("line %s: answer %.200q: %v", l.ID, l.Answer, err)
	}
	return a.Body
}

// checkLines checks lines against the calls' ids, in order: each done,
// status 200, one attempt, its answer what the vendor sent it.
func checkLines(t *testing.T, vend *exportVendor, lines []ResultLine, ids []string) {
	t.Helper()
	if len(lines) != len(ids) {
		t.Fatalf("%d result lines, want %d", len(lines), len(ids))
	}
	bad := 0
	for i, l := range lines {
		_, sent := vend.answered(ids[i])
		if l.ID != ids[i] || l.State != CallDone || l.Status != 200 || l.Attempts != 1 || l.Error != "" || !bytes.Equal(lineBody(t, l), sent) {
			if bad++; bad <= 5 {
				t.Errorf("line %d: id %s state %s status %d attempts %d error %q answer %.80s; want id %s done, 200, 1 attempt, answer %.80s",
					i+1, l.ID, l.State, l.Status, l.Attempts, l.Error, lineBody(t, l), ids[i], sent)
			}
		}
	}
	if bad > 5 {
		t.Errorf("... %d lines wrong in all", bad)
	}
}

// checkOnce checks that the vendor answered each of ids exactly once.
func checkOnce(t *testing.T, vend *exportVendor, ids []string) {
	t.Helper()
	for _, id := range ids {
		if n, _ := vend.answered(id); n != 1 {
			t.Errorf("the vendor answered %s %d times, want once", id, n)
		}
	}
}

// TestExportOrderAndResults: 600 calls (two chunks of StartExportFrom,
// three pages of ExportResults), a third without ids, one in seven in the
// high lane (so that they end out of the export's order), read back in
// the order given with their ids, states, statuses, attempts and answers.
// Started again under its id, the export queues nothing twice; started
// again under a new id, its calls, all ended, count there at once.
func TestExportOrderAndResults(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	vend := newExportVendor(0)
	v := e.vendor("exporder", policy(1000), 0, vend)
	c := e.newClient()
	rdb := e.rdb()
	dropKeysAtEnd(t, rdb, e.prefix, v)
	ctx := context.Background()
	const n = 600
	id := "order-" + e.prefix
	calls := exportCalls(n, func(i int) string {
		if i%3 == 0 {
			return ""
		}
		return fmt.Sprintf("%s-%04d", v, i)
	})
	for i := range calls {
		if i%7 == 0 {
			calls[i].Priority = "high"
		}
	}
	ids := make([]string, n) // the ids the export's calls have
	for i, call := range calls {
		ids[i] = call.ID
		if call.ID == "" {
			ids[i] = fmt.Sprintf("%s:%d", id, i+1)
		}
	}
	reads := 0
	src := func(fn func(Call) error) error {
		reads++
		return CallsOf(calls)(fn)
	}
	st, err := c.StartExportFrom(ctx, id, v, src)
	if err != nil {
		t.Fatal(err)
	}
	if st.Enqueued != n || st.AlreadyQueued != 0 || st.Total != n || !st.Queued || !st.Ordered || st.State() != "running" || reads != 2 {
		t.Fatalf("StartExportFrom = %+v (state %s), the source read %d times; want %d queued, running, the source read twice", st, st.State(), reads, n)
	}
	e.startWorker(nil)
	ex := waitExport(t, c, id, 2*time.Minute)
	if ex.Done != n || ex.Failed != 0 || ex.Total != n || ex.State() != "finished" {
		t.Fatalf("export %+v, want %d done", ex, n)
	}
	// The export's counts can be ahead of asynq's states by a moment:
	// wait for every line to say done.
	waitFor(t, time.Minute, "every call to be completed", func() bool {
		lines, _ := results(t, c, id, ResultsQuery{States: []string{CallDone}})
		return len(lines) == n
	})
	lines, sum := results(t, c, id, ResultsQuery{})
	checkLines(t, vend, lines, ids)
	if !sum.Finished || sum.Lines != n {
		t.Errorf("summary %+v, want %d lines, finished", sum, n)
	}
	checkOnce(t, vend, ids)
	if failed, _ := results(t, c, id, ResultsQuery{States: []string{CallFailed, CallCancelled}}); len(failed) != 0 {
		t.Errorf("%d lines failed or cancelled, want none: %+v", len(failed), failed[0])
	}

	t.Run("again under its id", func(t *testing.T) {
		again, err := c.StartExportFrom(ctx, id, v, CallsOf(calls))
		if err != nil {
			t.Fatal(err)
		}
		if again.Enqueued != 0 || again.AlreadyQueued != n || again.Total != n || again.Done != n || !again.Finished() {
			t.Errorf("started again: %+v; want nothing queued, %d already, finished", again, n)
		}
		lines, _ := results(t, c, id, ResultsQuery{})
		checkLines(t, vend, lines, ids)
		checkOnce(t, vend, ids)
	})

	t.Run("again under a new id", func(t *testing.T) {
		// The same calls, as a file that names every call's id, started
		// without an export id: every call is the first export's, ended,
		// and counts in this one at once.
		own := slices.Clone(calls)
		for i := range own {
			own[i].ID = ids[i]
		}
		// Ten of them ended before calls marked their end in their task
		// (an older shaper): their asynq state says it.
		for _, id := range ids[:10] {
			for _, q := range []string{QueueName(v), HighQueueName(v)} {
				rdb.HDel(ctx, asynqTaskKey(q, id), "shaper_end")
			}
		}
		again, err := c.StartExportFrom(ctx, "", v, CallsOf(own))
		if err != nil {
			t.Fatal(err)
		}
		if again.ID == id || again.Enqueued != 0 || again.AlreadyQueued != n || again.Total != n || again.Done != n || !again.Finished() {
			t.Fatalf("started under a new id: %+v; want a new export, nothing queued, %d already, finished", again, n)
		}
		lines, sum := results(t, c, again.ID, ResultsQuery{Follow: true, Poll: 50 * time.Millisecond})
		checkLines(t, vend, lines, ids)
		if !sum.Finished {
			t.Errorf("summary %+v, want finished", sum)
		}
		checkOnce(t, vend, ids)
	})
}

// TestExportAgainWhileQueued: an export started again without an id
// while the first's calls are still queued (no worker runs yet) adopts
// them, and a call queued by a plain enqueue too: each call reaches the
// vendor once, and every export finishes, its adopted calls counted.
func TestExportAgainWhileQueued(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	vend := newExportVendor(0)
	v := e.vendor("exprerun", policy(200), 0, vend)
	c := e.newClient()
	rdb := e.rdb()
	dropKeysAtEnd(t, rdb, e.prefix, v)
	ctx := context.Background()
	calls := exportCalls(50, func(i int) string { return fmt.Sprintf("%s-%03d", v, i) })
	var ids []string
	for _, call := range calls {
		ids = append(ids, call.ID)
	}
	// Five of them are queued first, by a plain enqueue.
	for _, call := range calls[10:15] {
		call.Vendor = v
		if _, err := c.Enqueue(ctx, call); err != nil {
			t.Fatal(err)
		}
	}
	first, err := c.StartExportFrom(ctx, "", v, CallsOf(calls))
	if err != nil {
		t.Fatal(err)
	}
	if first.Enqueued != 45 || first.AlreadyQueued != 5 || first.State() != "running" {
		t.Fatalf("first export: %+v; want 45 queued, 5 already, running", first)
	}
	// The same calls and ten more, without an export id.
	more := append(slices.Clone(calls), exportCalls(10, func(i int) string { return fmt.Sprintf("%s-new-%d", v, i) })...)
	second, err := c.StartExportFrom(ctx, "", v, CallsOf(more))
	if err != nil {
		t.Fatal(err)
	}
	if second.ID == first.ID || second.Enqueued != 10 || second.AlreadyQueued != 50 || second.Total != 60 || second.Done != 0 || second.State() != "running" {
		t.Fatalf("second export: %+v; want a new id, 10 queued, 50 already, 60 in all, running", second)
	}
	// And the first again under its id: nothing is queued twice.
	again, err := c.StartExportFrom(ctx, first.ID, v, CallsOf(calls))
	if err != nil {
		t.Fatal(err)
	}
	if again.Enqueued != 0 || again.AlreadyQueued != 50 || again.Total != 50 {
		t.Fatalf("first export again: %+v; want nothing queued, 50 already", again)
	}
	e.startWorker(nil)
	for _, x := range []struct {
		id   string
		want int64
	}{{first.ID, 50}, {second.ID, 60}} {
		got := waitExport(t, c, x.id, 2*time.Minute)
		if got.Done != x.want || got.Failed != 0 || got.Total != x.want {
			t.Errorf("export %s: %+v; want %d done", x.id, got, x.want)
		}
	}
	allIDs := ids
	for _, call := range more[50:] {
		allIDs = append(allIDs, call.ID)
	}
	lines, sum := results(t, c, second.ID, ResultsQuery{Follow: true, Poll: 50 * time.Millisecond})
	checkLines(t, vend, lines, allIDs)
	if !sum.Finished {
		t.Errorf("summary %+v, want finished", sum)
	}
	checkOnce(t, vend, allIDs)
}

// lineSink is a writer of ExportResults that keeps each line as it
// comes, and says when.
type lineSink struct {
	mu    sync.Mutex
	lines []ResultLine
	t     *testing.T
}

func (s *lineSink) Write(p []byte) (int, error) {
	var l ResultLine
	if err := json.Unmarshal(p, &l); err != nil {
		s.t.Errorf("a write of ExportResults is not one line: %v: %.200q", err, p)
	}
	s.mu.Lock()
	s.lines = append(s.lines, l)
	s.mu.Unlock()
	return len(p), nil
}

func (s *lineSink) seen() []ResultLine {
	s.mu.Lock()
	defer s.mu.Unlock()
	return slices.Clone(s.lines)
}

// TestExportResultsFollow: a follow writes the lines of the calls that
// ended while a call before the others is still at the vendor, waits at
// that call (the lines after it wait, in order, though their calls
// ended), and ends when the export finishes.
func TestExportResultsFollow(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	vend := newExportVendor(0)
	release := make(chan struct{})
	const n, held = 20, 10 // call 10 waits at the vendor
	calls := exportCalls(n, func(int) string { return "" })
	v := e.vendor("expfollow", policy(100), 0, vend)
	e.setTimeout(2 * time.Minute)
	c := e.newClient()
	rdb := e.rdb()
	dropKeysAtEnd(t, rdb, e.prefix, v)
	ctx := context.Background()
	id := "follow-" + e.prefix
	heldID := fmt.Sprintf("%s:%d", id, held)
	vend.block[heldID] = release
	defer func() {
		select {
		case <-release:
		default:
			close(release)
		}
	}()
	if _, err := c.StartExportFrom(ctx, id, v, CallsOf(calls)); err != nil {
		t.Fatal(err)
	}
	e.startWorker(nil)
	sink := &lineSink{t: t}
	type followed struct {
		sum ResultsSummary
		err error
	}
	done := make(chan followed, 1)
	fctx, cancel := context.WithTimeout(ctx, 3*time.Minute)
	defer cancel()
	go func() {
		sum, err := c.ExportResults(fctx, id, ResultsQuery{Follow: true, Poll: 50 * time.Millisecond}, sink)
		done <- followed{sum, err}
	}()
	// Every call but the held one ends.
	waitFor(t, 2*time.Minute, "every call but the held one to end", func() bool {
		for i := 1; i <= n; i++ {
			if i == held {
				continue
			}
			st, _ := rdb.HGet(ctx, asynqTaskKey(QueueName(v), fmt.Sprintf("%s:%d", id, i)), "state").Result()
			if st != "completed" {
				return false
			}
		}
		return true
	})
	waitFor(t, time.Minute, "the lines before the held call", func() bool { return len(sink.seen()) >= held-1 })
	time.Sleep(500 * time.Millisecond) // ten polls: a line past the held call would be written by now
	if tries, _ := vend.answered(heldID); tries != 0 {
		t.Fatalf("the vendor answered the held call %d times", tries)
	}
	seen := sink.seen()
	if len(seen) != held-1 {
		t.Errorf("while call %d is at the vendor, the follow wrote %d lines; want the %d before it", held, len(seen), held-1)
	}
	for i, l := range seen {
		if want := fmt.Sprintf("%s:%d", id, i+1); l.ID != want || l.State != CallDone || len(l.Answer) == 0 {
			t.Errorf("line %d: %s %s answer %q; want %s done with its answer", i+1, l.ID, l.State, l.Answer, want)
		}
	}
	select {
	case f := <-done:
		t.Fatalf("the follow ended before the export finished: %+v, %v", f.sum, f.err)
	default:
	}
	close(release)
	var f followed
	select {
	case f = <-done:
	case <-time.After(3 * time.Minute):
		t.Fatal("the follow did not end once the export finished")
	}
	if f.err != nil || !f.sum.Finished || f.sum.Lines != n {
		t.Fatalf("follow = %+v, %v; want %d lines, finished", f.sum, f.err, n)
	}
	ids := make([]string, n)
	for i := range ids {
		ids[i] = fmt.Sprintf("%s:%d", id, i+1)
	}
	checkLines(t, vend, sink.seen(), ids)

	t.Run("context ends", func(t *testing.T) {
		// A follow of an export that never finishes (a call cancelled
		// from Redis by hand would do) ends with its context.
		rdb.HDel(ctx, exportKey(e.prefix, id), "queued")
		short, cancel := context.WithTimeout(ctx, 300*time.Millisecond)
		defer cancel()
		sum, err := c.ExportResults(short, id, ResultsQuery{Follow: true, Poll: 50 * time.Millisecond}, &bytes.Buffer{})
		if !errors.Is(err, context.DeadlineExceeded) || sum.Finished || sum.Lines != n {
			t.Errorf("follow of an export still queueing = %+v, %v; want its %d lines, then the context's end", sum, err, n)
		}
	})
}

// TestExportFailedAndRetry: 30 of 200 calls are refused (422, not
// retried): the export finishes with 30 failed, listed with their status
// and error; once the vendor is fixed RetryExport queues them again under
// their ids, and the export finishes with every call done, each refused
// call having reached the vendor twice under its one Idempotency-Key.
func TestExportFailedAndRetry(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	vend := newExportVendor(0)
	v := e.vendor("expretry", policy(500), 0, vend)
	c := e.newClient()
	rdb := e.rdb()
	dropKeysAtEnd(t, rdb, e.prefix, v)
	ctx := context.Background()
	const n = 200
	calls := exportCalls(n, func(i int) string { return fmt.Sprintf("%s-%03d", v, i) })
	var ids, refused []string
	for i, call := range calls {
		ids = append(ids, call.ID)
		if i%6 == 0 && i < 180 {
			refused = append(refused, call.ID)
			vend.fail[call.ID] = true
		}
	}
	exp, _, err := c.StartExport(ctx, "", v, calls)
	if err != nil {
		t.Fatal(err)
	}
	e.startWorker(nil)
	got := waitExport(t, c, exp.ID, 2*time.Minute)
	if got.Done != n-30 || got.Failed != 30 {
		t.Fatalf("export %+v; want %d done, 30 failed", got, n-30)
	}
	failedLines := func() []ResultLine {
		lines, _ := results(t, c, exp.ID, ResultsQuery{States: []string{CallFailed}})
		return lines
	}
	waitFor(t, time.Minute, "the 30 refused calls to be archived", func() bool { return len(failedLines()) == 30 })
	lines := failedLines()
	for i, l := range lines {
		_, sent := vend.answered(refused[i])
		if l.ID != refused[i] || l.Status != 422 || l.Attempts != 1 || !strings.Contains(l.Error, "HTTP 422") || !bytes.Equal(lineBody(t, l), sent) {
			t.Errorf("failed line %d: %s status %d attempts %d error %q answer %s; want %s, 422, its error and answer %s",
				i+1, l.ID, l.Status, l.Attempts, l.Error, lineBody(t, l), refused[i], sent)
		}
	}
	if done, _ := results(t, c, exp.ID, ResultsQuery{States: []string{CallDone}}); len(done) != n-30 {
		t.Errorf("%d done lines, want %d", len(done), n-30)
	}

	vend.mu.Lock()
	vend.fixed = true
	vend.mu.Unlock()
	// One refused call looks as it does between its end and asynq's
	// archiving it (the export counts it failed already): RetryExport
	// waits for it.
	key := asynqTaskKey(QueueName(v), refused[0])
	rdb.HSet(ctx, key, "state", "active")
	archived := make(chan struct{})
	go func() {
		defer close(archived)
		time.Sleep(300 * time.Millisecond)
		rdb.HSet(ctx, key, "state", "archived")
	}()
	r, err := c.RetryExport(ctx, exp.ID)
	<-archived
	if err != nil || r.Queued != 30 || len(r.Gone) != 0 {
		t.Fatalf("RetryExport = %+v, %v; want 30 queued", r, err)
	}
	got = waitExport(t, c, exp.ID, 2*time.Minute)
	if got.Done != n || got.Failed != 0 {
		t.Fatalf("export after the retry: %+v; want %d done, 0 failed", got, n)
	}
	all, sum := results(t, c, exp.ID, ResultsQuery{Follow: true, Poll: 50 * time.Millisecond})
	if !sum.Finished || len(all) != n {
		t.Fatalf("after the retry: %d lines, %+v; want %d, finished", len(all), sum, n)
	}
	for i, l := range all {
		_, sent := vend.answered(ids[i])
		if l.ID != ids[i] || l.State != CallDone || l.Status != 200 || !bytes.Equal(lineBody(t, l), sent) {
			t.Errorf("line %d after the retry: %s %s %d %s; want %s done, 200, answer %s", i+1, l.ID, l.State, l.Status, lineBody(t, l), ids[i], sent)
		}
	}
	for _, id := range ids {
		want := 1
		if vend.fail[id] {
			want = 2
		}
		if tries, _ := vend.answered(id); tries != want {
			t.Errorf("the vendor saw %s %d times, want %d", id, tries, want)
		}
	}
	if r, err := c.RetryExport(ctx, exp.ID); err != nil || r.Queued != 0 {
		t.Errorf("RetryExport of a finished export = %+v, %v; want nothing queued", r, err)
	}
}

// TestExportRetryAdopted: an export started again without an id after
// the first finished with failures counts them failed; RetryExport of
// this second export runs them again, and both exports finish.
func TestExportRetryAdopted(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	vend := newExportVendor(0)
	v := e.vendor("expadopt", policy(200), 0, vend)
	c := e.newClient()
	rdb := e.rdb()
	dropKeysAtEnd(t, rdb, e.prefix, v)
	ctx := context.Background()
	calls := exportCalls(20, func(i int) string { return fmt.Sprintf("%s-%02d", v, i) })
	for i := 0; i < 20; i += 4 {
		vend.fail[calls[i].ID] = true
	}
	first, _, err := c.StartExport(ctx, "", v, calls)
	if err != nil {
		t.Fatal(err)
	}
	e.startWorker(nil)
	if got := waitExport(t, c, first.ID, 2*time.Minute); got.Done != 15 || got.Failed != 5 {
		t.Fatalf("first export %+v; want 15 done, 5 failed", got)
	}
	waitFor(t, time.Minute, "the refused calls to be archived", func() bool {
		lines, _ := results(t, c, first.ID, ResultsQuery{States: []string{CallFailed}})
		return len(lines) == 5
	})
	second, err := c.StartExportFrom(ctx, "", v, CallsOf(calls))
	if err != nil {
		t.Fatal(err)
	}
	if second.AlreadyQueued != 20 || second.Done != 15 || second.Failed != 5 || !second.Finished() {
		t.Fatalf("second export %+v; want the 20 calls adopted, 15 done, 5 failed, finished", second)
	}
	vend.mu.Lock()
	vend.fixed = true
	vend.mu.Unlock()
	r, err := c.RetryExport(ctx, second.ID)
	if err != nil || r.Queued != 5 {
		t.Fatalf("RetryExport = %+v, %v; want 5 queued", r, err)
	}
	for _, id := range []string{second.ID, first.ID} {
		if got := waitExport(t, c, id, time.Minute); got.Done != 20 || got.Failed != 0 {
			t.Errorf("export %s after the retry: %+v; want 20 done", id, got)
		}
	}
	for _, call := range calls {
		want := 1
		if vend.fail[call.ID] {
			want = 2
		}
		if tries, _ := vend.answered(call.ID); tries != want {
			t.Errorf("the vendor saw %s %d times, want %d", call.ID, tries, want)
		}
	}
}

// TestCancelExport: CancelExport cancels the calls not started (the
// vendor holds those that are) and counts them failed; once the vendor
// answers the rest the export finishes, its results show the cancelled
// calls, and RetryExport cannot run them again (Gone).
func TestCancelExport(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	vend := newExportVendor(0)
	release := make(chan struct{})
	vend.blockAll = release
	defer func() {
		select {
		case <-release:
		default:
			close(release)
		}
	}()
	v := e.vendor("expcancel", policy(5), 0, vend)
	e.setTimeout(2 * time.Minute)
	c := e.newClient()
	rdb := e.rdb()
	dropKeysAtEnd(t, rdb, e.prefix, v)
	ctx := context.Background()
	const n = 40
	calls := exportCalls(n, func(i int) string { return fmt.Sprintf("%s-%02d", v, i) })
	exp, _, err := c.StartExport(ctx, "", v, calls)
	if err != nil {
		t.Fatal(err)
	}
	e.startWorker(nil)
	waitFor(t, time.Minute, "a call to reach the vendor", func() bool { return vend.asked.Load() > 0 })
	cn, err := c.CancelExport(ctx, exp.ID)
	if err != nil {
		t.Fatal(err)
	}
	if cn.Cancelled == 0 || cn.Running == 0 || cn.Cancelled+cn.Running != n {
		t.Fatalf("CancelExport = %+v; want every one of the %d calls cancelled or running, some of each", cn, n)
	}
	st, err := c.ExportStatus(ctx, exp.ID)
	if err != nil || st.Failed != int64(cn.Cancelled) || st.Finished() {
		t.Fatalf("export after the cancel: %+v, %v; want %d failed, not finished", st, err, cn.Cancelled)
	}
	// Again: the running calls stay running (one a worker gave back to
	// the queue to wait for its tick meanwhile would be cancelled now).
	again, err := c.CancelExport(ctx, exp.ID)
	if err != nil || again.Cancelled+again.Running != cn.Running {
		t.Errorf("CancelExport again = %+v, %v; want the %d running calls running (or cancelled)", again, err, cn.Running)
	}
	cn.Cancelled += again.Cancelled
	cn.Running -= again.Cancelled
	close(release)
	got := waitExport(t, c, exp.ID, 2*time.Minute)
	if got.Done != int64(cn.Running) || got.Failed != int64(cn.Cancelled) {
		t.Fatalf("export %+v; want the %d running done, the %d cancelled failed", got, cn.Running, cn.Cancelled)
	}
	var cancelled []string
	waitFor(t, time.Minute, "every line to say done or cancelled", func() bool {
		lines, _ := results(t, c, exp.ID, ResultsQuery{})
		cancelled = cancelled[:0]
		done := 0
		for _, l := range lines {
			switch l.State {
			case CallCancelled:
				cancelled = append(cancelled, l.ID)
			case CallDone:
				done++
			}
		}
		return len(lines) == n && len(cancelled) == cn.Cancelled && done == cn.Running
	})
	for _, id := range cancelled {
		if tries, _ := vend.answered(id); tries != 0 {
			t.Errorf("cancelled call %s reached the vendor %d times", id, tries)
		}
	}
	if only, _ := results(t, c, exp.ID, ResultsQuery{States: []string{CallCancelled}}); len(only) != cn.Cancelled {
		t.Errorf("%d cancelled lines, want %d", len(only), cn.Cancelled)
	}
	r, err := c.RetryExport(ctx, exp.ID)
	if err != nil || r.Queued != 0 || !slices.Equal(r.Gone, cancelled) {
		t.Errorf("RetryExport = %+v, %v; want nothing queued, the %d cancelled gone", r, err, len(cancelled))
	}
}

// TestCancelExportCountsInAdopters: calls queued by one export and
// adopted by another (started again without an id while they wait) are
// cancelled by CancelExport of the first: both exports count them
// cancelled and finish.
func TestCancelExportCountsInAdopters(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	vend := newExportVendor(0)
	v := e.vendor("expcanceladopt", policy(10), 0, vend)
	c := e.newClient()
	rdb := e.rdb()
	dropKeysAtEnd(t, rdb, e.prefix, v)
	ctx := context.Background()
	calls := exportCalls(12, func(i int) string { return fmt.Sprintf("%s-%02d", v, i) })
	first, _, err := c.StartExport(ctx, "", v, calls) // no worker runs: they stay queued
	if err != nil {
		t.Fatal(err)
	}
	second, err := c.StartExportFrom(ctx, "", v, CallsOf(calls))
	if err != nil || second.AlreadyQueued != 12 {
		t.Fatalf("second export: %+v, %v; want the 12 calls adopted", second, err)
	}
	cn, err := c.CancelExport(ctx, first.ID)
	if err != nil || cn.Cancelled != 12 {
		t.Fatalf("CancelExport = %+v, %v; want 12 cancelled", cn, err)
	}
	for _, id := range []string{first.ID, second.ID} {
		got, err := c.ExportStatus(ctx, id)
		if err != nil || got.Failed != 12 || got.Done != 0 || !got.Finished() {
			t.Errorf("export %s after the cancel: %+v, %v; want 12 failed, finished", id, got, err)
		}
		lines, _ := results(t, c, id, ResultsQuery{Follow: true, Poll: 50 * time.Millisecond})
		for _, l := range lines {
			if l.State != CallCancelled {
				t.Errorf("export %s: line %s is %s, want cancelled", id, l.ID, l.State)
			}
		}
		if len(lines) != 12 {
			t.Errorf("export %s: %d lines, want 12", id, len(lines))
		}
	}
}

// TestRerunScript: rerunScript readies an archived call only, adds the
// export to those that count the call (once), and asks to wait for a
// call that ended failed while asynq archives it.
func TestRerunScript(t *testing.T) {
	rdb := redistest.Client(t)
	ctx := context.Background()
	key := redistest.Prefix(t) + ":task"
	t.Cleanup(func() { rdb.Del(ctx, key) })
	for _, tc := range []struct {
		name                   string
		fields                 []any // the task hash before ("" for none)
		want                   int
		wantEnd, wantFollowers string
	}{
		{"gone", nil, rerunNo, "", ""},
		{"pending", []any{"state", "pending"}, rerunNo, "", ""},
		{"completed", []any{"state", "completed", "shaper_end", "ok"}, rerunNo, "ok", ""},
		{"being archived", []any{"state", "active", "shaper_end", "failed"}, rerunWait, "failed", ""},
		{"archived", []any{"state", "archived", "shaper_end", "failed"}, rerunReady, "", "exp-b"},
		{"archived, adopted", []any{"state", "archived", "shaper_end", "failed", "shaper_exports", "exp-c"}, rerunReady, "", "exp-c,exp-b"},
		{"archived, counted", []any{"state", "archived", "shaper_end", "failed", "shaper_exports", "exp-b,exp-c"}, rerunReady, "", "exp-b,exp-c"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			rdb.Del(ctx, key)
			if len(tc.fields) > 0 {
				rdb.HSet(ctx, key, tc.fields...)
			}
			got, err := rerunScript.Run(ctx, rdb, []string{key}, "exp-b").Int()
			if err != nil || got != tc.want {
				t.Fatalf("rerunScript = %d, %v; want %d", got, err, tc.want)
			}
			end, _ := rdb.HGet(ctx, key, "shaper_end").Result()
			followers, _ := rdb.HGet(ctx, key, "shaper_exports").Result()
			if end != tc.wantEnd || followers != tc.wantFollowers {
				t.Errorf("after: shaper_end %q, shaper_exports %q; want %q, %q", end, followers, tc.wantEnd, tc.wantFollowers)
			}
		})
	}
}

// TestExportUnknownAndLegacy: an unknown export is ErrUnknownExport
// everywhere; an export of the old layout (a hash and two sets, no
// order) reports its progress, and its results cannot be read back.
func TestExportUnknownAndLegacy(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	v := e.vendor("explegacy", policy(10), 0, http.NotFoundHandler())
	c := e.newClient()
	rdb := e.rdb()
	dropKeysAtEnd(t, rdb, e.prefix, v)
	ctx := context.Background()
	var buf bytes.Buffer
	if _, err := c.ExportStatus(ctx, "nope"); !errors.Is(err, ErrUnknownExport) {
		t.Errorf("ExportStatus(nope) = %v, want ErrUnknownExport", err)
	}
	if _, err := c.ExportResults(ctx, "nope", ResultsQuery{}, &buf); !errors.Is(err, ErrUnknownExport) {
		t.Errorf("ExportResults(nope) = %v, want ErrUnknownExport", err)
	}
	if _, err := c.RetryExport(ctx, "nope"); !errors.Is(err, ErrUnknownExport) {
		t.Errorf("RetryExport(nope) = %v, want ErrUnknownExport", err)
	}
	if _, err := c.CancelExport(ctx, "nope"); !errors.Is(err, ErrUnknownExport) {
		t.Errorf("CancelExport(nope) = %v, want ErrUnknownExport", err)
	}
	created := time.Date(2026, 11, 30, 12, 0, 0, 0, time.UTC)
	legacy := func(id string, total int, done, failed []string) {
		pipe := rdb.TxPipeline()
		pipe.HSet(ctx, exportKey(e.prefix, id), "vendor", v, "total", total, "created", created.Format(time.RFC3339))
		for _, d := range done {
			pipe.SAdd(ctx, exportDoneKey(e.prefix, id), d)
		}
		for _, f := range failed {
			pipe.SAdd(ctx, exportFailedKey(e.prefix, id), f)
		}
		if _, err := pipe.Exec(ctx); err != nil {
			t.Fatal(err)
		}
	}
	legacy("old-done", 3, []string{"a", "b"}, []string{"c"})
	legacy("old-running", 3, []string{"a"}, nil)
	for _, tc := range []struct {
		id   string
		want Export
	}{
		{"old-done", Export{ID: "old-done", Vendor: v, Total: 3, Done: 2, Failed: 1, Queued: true, Created: created}},
		{"old-running", Export{ID: "old-running", Vendor: v, Total: 3, Done: 1, Queued: true, Created: created}},
	} {
		got, err := c.ExportStatus(ctx, tc.id)
		if err != nil || got != tc.want {
			t.Errorf("ExportStatus(%s) = %+v, %v; want %+v", tc.id, got, err, tc.want)
		}
		buf.Reset()
		_, err = c.ExportResults(ctx, tc.id, ResultsQuery{}, &buf)
		if err == nil || errors.Is(err, ErrUnknownExport) || !strings.Contains(err.Error(), "explain") || buf.Len() != 0 {
			t.Errorf("ExportResults(%s) = %v, wrote %q; want an error saying to read its calls with explain", tc.id, err, buf.String())
		}
		if _, err := c.RetryExport(ctx, tc.id); err == nil || errors.Is(err, ErrUnknownExport) {
			t.Errorf("RetryExport(%s) = %v, want an error", tc.id, err)
		}
		if _, err := c.CancelExport(ctx, tc.id); err == nil || errors.Is(err, ErrUnknownExport) {
			t.Errorf("CancelExport(%s) = %v, want an error", tc.id, err)
		}
	}
	if got, _ := c.ExportStatus(ctx, "old-done"); got.State() != "finished" {
		t.Errorf("old-done is %s, want finished", got.State())
	}
	if got, _ := c.ExportStatus(ctx, "old-running"); got.State() != "running" {
		t.Errorf("old-running is %s, want running", got.State())
	}
}

// TestExportResultsBigAnswers: answers of 1 MiB each, more than a page's
// budget of answers together, are read back whole (those past the
// budget one at a time).
func TestExportResultsBigAnswers(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	const n = 12
	vend := newExportVendor(DefaultMaxAnswer)
	v := e.vendor("expbig", policy(100), 0, vend)
	c := e.newClient()
	rdb := e.rdb()
	dropKeysAtEnd(t, rdb, e.prefix, v)
	exp, _, err := c.StartExport(context.Background(), "", v, exportCalls(n, func(int) string { return "" }))
	if err != nil {
		t.Fatal(err)
	}
	e.startWorker(nil)
	lines, sum := results(t, c, exp.ID, ResultsQuery{Follow: true, Poll: 50 * time.Millisecond})
	if !sum.Finished {
		t.Errorf("summary %+v, want finished", sum)
	}
	ids := make([]string, n)
	for i := range ids {
		ids[i] = fmt.Sprintf("%s:%d", exp.ID, i+1)
	}
	if n*DefaultMaxAnswer <= resultsBudget {
		t.Fatalf("%d answers of %d bytes fit in one page's budget of %d: the test reads none alone", n, DefaultMaxAnswer, resultsBudget)
	}
	checkLines(t, vend, lines, ids)
}

// heapSink is a writer of ExportResults that counts its lines and, every
// few lines, collects the garbage and reads the live heap: the peak is
// what the read held at once.
type heapSink struct {
	lines int
	bytes int64
	peak  uint64
	last  string // the last line's id
}

func (s *heapSink) Write(p []byte) (int, error) {
	s.lines++
	s.bytes += int64(len(p))
	var l struct{ ID string }
	_ = json.Unmarshal(p, &l)
	s.last = l.ID
	if s.lines%32 == 1 {
		runtime.GC()
		var m runtime.MemStats
		runtime.ReadMemStats(&m)
		s.peak = max(s.peak, m.HeapAlloc)
	}
	return len(p), nil
}

// TestExportResultsMemoryFlat reads back an export of 3,000 calls whose
// answers are 16 KB each (48 MB in all): the live heap during the read
// stays far below the export's size (the read holds a page at a time).
func TestExportResultsMemoryFlat(t *testing.T) {
	e := newEnv(t)
	const n, size = 3000, 16 << 10
	vend := newExportVendor(size)
	vend.forget = true
	v := e.vendor("expmem", policy(1000), 0, vend)
	c := e.newClient()
	rdb := e.rdb()
	dropKeysAtEnd(t, rdb, e.prefix, v)
	ctx := context.Background()
	exp, _, err := c.StartExport(ctx, "", v, exportCalls(n, func(int) string { return "" }))
	if err != nil {
		t.Fatal(err)
	}
	e.startWorker(nil)
	if got := waitExport(t, c, exp.ID, 3*time.Minute); got.Done != n {
		t.Fatalf("export %+v, want %d done", got, n)
	}
	waitFor(t, time.Minute, "the last call to be completed", func() bool {
		st, _ := rdb.HGet(ctx, asynqTaskKey(QueueName(v), fmt.Sprintf("%s:%d", exp.ID, n)), "state").Result()
		return st == "completed"
	})
	runtime.GC()
	var m runtime.MemStats
	runtime.ReadMemStats(&m)
	base := m.HeapAlloc
	sink := &heapSink{}
	sum, err := c.ExportResults(ctx, exp.ID, ResultsQuery{}, sink)
	if err != nil {
		t.Fatal(err)
	}
	total := int64(n) * size
	held := int64(sink.peak) - int64(base)
	t.Logf("read %d lines, %d bytes (answers %d bytes in all): live heap %d bytes before, at most %d during (%d above)",
		sum.Lines, sink.bytes, total, base, sink.peak, held)
	if sum.Lines != n || sink.lines != n || sink.last != fmt.Sprintf("%s:%d", exp.ID, n) || sink.bytes < total {
		t.Fatalf("read %d lines (%d written, last %s, %d bytes); want %d, the last %s:%d, over %d bytes", sum.Lines, sink.lines, sink.last, sink.bytes, n, exp.ID, n, total)
	}
	if held > total/2 {
		t.Errorf("the read held %d bytes at once, over half the export's %d bytes of answers: it does not stream", held, total)
	}
}

// TestOwnRedisEndOfRunOnAFreshServer: the end of a run (the answer and
// the export's count, in one round trip) is sent by its script's hash;
// on a Redis that has never seen the script, and after SCRIPT FLUSH
// (a restart, a failover to a replica), it is sent whole instead: every
// answer is stored and every call counted.
func TestOwnRedisEndOfRunOnAFreshServer(t *testing.T) {
	t.Parallel()
	rs := redistest.Start(t)
	e := newEnv(t)
	e.addr = rs.Addr
	vend := newExportVendor(0)
	v := e.vendor("fresh", policy(100), 0, vend)
	c := e.newClient()
	ctx := context.Background()
	e.startWorker(nil)
	for round, flush := range []bool{false, true} {
		if flush {
			if err := e.rdb().ScriptFlush(ctx).Err(); err != nil {
				t.Fatal(err)
			}
		}
		id := fmt.Sprintf("fresh-%d", round)
		calls := exportCalls(5, func(i int) string { return fmt.Sprintf("%s-%d-%d", v, round, i) })
		if _, _, err := c.StartExport(ctx, id, v, calls); err != nil {
			t.Fatal(err)
		}
		ex := waitExport(t, c, id, 30*time.Second)
		if ex.Done != 5 || ex.Failed != 0 {
			t.Fatalf("round %d (script flushed: %v): export %+v, want 5 done", round, flush, ex)
		}
		lines, _ := results(t, c, id, ResultsQuery{})
		if len(lines) != 5 {
			t.Fatalf("round %d: %d lines, want 5", round, len(lines))
		}
		for _, l := range lines {
			if l.Status != http.StatusOK || !strings.Contains(string(l.Answer), "WB-") {
				t.Errorf("round %d (script flushed: %v): line %+v has no stored answer", round, flush, l)
			}
		}
	}
}
