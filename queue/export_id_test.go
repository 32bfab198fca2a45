package queue

import (
	"context"
	"errors"
	"fmt"
	"net/http"
	"strings"
	"testing"
)

// TestExportRefusesWhatItCannotBe: an export reports every bad line of
// its source (not the first alone); its id cannot move to another vendor
// or to other calls (their lines without an id would be taken for the
// first run's, and never sent); a failure half way names the export.
func TestExportRefusesWhatItCannotBe(t *testing.T) {
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
