package queue

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"net/http"
	"strings"
	"testing"
	"time"
)

// TestExportRefusesWhatItCannotBe: an export reports every bad line of
// its source (not the first alone); its id cannot move to another vendor
// or to other calls (their lines without an id would be taken for the
// first run's, and never sent); a failure half way names the export.
func TestExportRefusesWhatItCannotBe(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	v := e.vendor("expid", policy(100), 0, http.NotFoundHandler())
	w := e.vendor("expid2", policy(100), 0, http.NotFoundHandler())
	c := e.newClient()
	ctx := context.Background()
	file := func(text string) CallSource {
		return func(fn func(Call) error) error { return ScanCalls(strings.NewReader(text), false, fn) }
	}
	_, err := c.StartExportFrom(ctx, "bad", v, file(`{"method":"POST"}`+"\n"+`{"path":"/a"}`+"\n"+`{"path":"/b","colour":1}`+"\n"+`{"path":"/c","account":"x"}`+"\n"))
	var lines []int
	if j, ok := err.(interface{ Unwrap() []error }); ok {
		for _, e := range j.Unwrap() {
			var le *LineError
			if errors.As(e, &le) {
				lines = append(lines, le.Line)
			}
		}
	}
	if fmt.Sprint(lines) != "[1 3 4]" {
		t.Errorf("bad lines reported %v (from %v); want [1 3 4], each a *LineError of one join", lines, err)
	}
	if _, err := c.ExportStatus(ctx, "bad"); !errors.Is(err, ErrUnknownExport) {
		t.Errorf("an export with bad lines was recorded: %v", err)
	}

	calls := []Call{{Path: "/a"}, {Path: "/b"}}
	if _, err := c.StartExportFrom(ctx, "one", v, CallsOf(calls)); err != nil {
		t.Fatal(err)
	}
	if st, err := c.StartExportFrom(ctx, "one", v, CallsOf(calls)); err != nil || st.Enqueued != 0 || st.AlreadyQueued != 2 {
		t.Errorf("the same calls again under the same id: %+v, %v; want nothing queued, 2 already", st, err)
	}
	if _, err := c.StartExportFrom(ctx, "one", w, CallsOf(calls)); !errors.Is(err, ErrExportExists) || !strings.Contains(err.Error(), "is on vendor "+v) {
		t.Errorf("the id on another vendor: %v; want ErrExportExists naming %s", err, v)
	}
	if _, err := c.StartExportFrom(ctx, "one", v, CallsOf([]Call{{Path: "/a"}, {Path: "/other"}})); !errors.Is(err, ErrExportExists) || !strings.Contains(err.Error(), "other calls") {
		t.Errorf("other calls under the id: %v; want ErrExportExists", err)
	}
	if e, err := c.ExportStatus(ctx, "one"); err != nil || e.Vendor != v || e.Total != 2 {
		t.Errorf("export one after the refusals: %+v, %v; want vendor %s, 2 calls", e, err, v)
	}

	// The source fails on its second pass at call 700: 500 calls are
	// queued, and the error and the result name the export.
	pass := 0
	src := func(fn func(Call) error) error {
		pass++
		for i := range 1000 {
			if pass == 2 && i == 700 {
				return errors.New("disk gone")
			}
			if err := fn(Call{Path: fmt.Sprintf("/o/%d", i)}); err != nil {
				return err
			}
		}
		return nil
	}
	st, err := c.StartExportFrom(ctx, "", v, src)
	if err == nil || st.ID == "" || st.Enqueued != 500 || !strings.Contains(err.Error(), "--id "+st.ID) {
		t.Fatalf("a source failing half way: %+v, %v; want the export's id, 500 queued, and how to finish it", st, err)
	}
	if e, err := c.ExportStatus(ctx, st.ID); err != nil || e.Queued || e.State() != "queueing" || e.Finished() {
		t.Errorf("the export cut half way: %+v (%s), %v; want it queueing, never finished", e, e.State(), err)
	}
}

// TestGoneCallsReadBack: a call cancelled by a plain Cancel counts in the
// export that adopted it (which finishes) and reads back cancelled there;
// a failed call whose archived task asynq dropped (its archive holds at
// most 10,000) reads back failed, saying so, and RetryExport lists it as
// gone rather than counting it queued.
func TestGoneCallsReadBack(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	v := e.vendor("gone", policy(100), 0, http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.URL.Path == "/api/bad" {
			w.WriteHeader(http.StatusUnprocessableEntity)
			return
		}
		fmt.Fprint(w, `{}`)
	}))
	c := e.newClient()
	ctx := context.Background()
	// Queued by a plain enqueue before any worker runs, then adopted by
	// the export, then cancelled.
	if _, err := c.Enqueue(ctx, Call{Vendor: v, ID: "later", Path: "/later"}); err != nil {
		t.Fatal(err)
	}
	st, err := c.StartExportFrom(ctx, "adopter", v, CallsOf([]Call{{ID: "later", Path: "/later"}, {ID: "bad", Path: "/bad"}}))
	if err != nil || st.AlreadyQueued != 1 {
		t.Fatalf("export adopting a queued call: %+v, %v", st, err)
	}
	if _, err := c.Cancel(ctx, "later"); err != nil {
		t.Fatal(err)
	}
	e.startWorker(nil)
	var ex Export
	waitFor(t, 30*time.Second, "the export to finish", func() bool {
		ex, _ = c.ExportStatus(ctx, "adopter")
		return ex.Finished()
	})
	if ex.Failed != 2 || ex.Done != 0 {
		t.Errorf("export after a plain Cancel of its adopted call and a 422: %+v; want 2 failed", ex)
	}
	// asynq drops the archived task of "bad" (as its archive's bound would).
	q := QueueName(v)
	waitFor(t, 10*time.Second, "bad to be archived", func() bool {
		s, _ := e.rdb().HGet(ctx, asynqTaskKey(q, "bad"), "state").Result()
		return s == "archived"
	})
	if err := e.rdb().Del(ctx, asynqTaskKey(q, "bad")).Err(); err != nil {
		t.Fatal(err)
	}
	e.rdb().ZRem(ctx, asynqKey(q, "archived"), "bad")
	var buf bytes.Buffer
	if _, err := c.ExportResults(ctx, "adopter", ResultsQuery{}, &buf); err != nil {
		t.Fatal(err)
	}
	var lines []ResultLine
	for _, raw := range bytes.Split(bytes.TrimSpace(buf.Bytes()), []byte("\n")) {
		var l ResultLine
		if err := json.Unmarshal(raw, &l); err != nil {
			t.Fatal(err)
		}
		lines = append(lines, l)
	}
	if len(lines) != 2 || lines[0].State != CallCancelled || lines[1].State != CallFailed || !strings.Contains(lines[1].Error, "archived task is gone") {
		t.Errorf("results: %+v; want later cancelled, bad failed with its task gone", lines)
	}
	r, err := c.RetryExport(ctx, "adopter")
	if err != nil || r.Queued != 0 || fmt.Sprint(r.Gone) != "[later bad]" {
		t.Errorf("RetryExport = %+v, %v; want nothing queued, both gone", r, err)
	}
}
