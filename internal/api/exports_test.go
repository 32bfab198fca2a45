package api

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"net/url"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/shaper-dev/shaper/internal/httpguard"
	"github.com/shaper-dev/shaper/internal/vendorsim"
	"github.com/shaper-dev/shaper/queue"
)

// answerBytes is the size of the test vendor's answers (the 4 KB
// bodies).
const answerBytes = 4096

// answerVendor is a real HTTP vendor that answers each call 201 with
// vendorsim.Answer (4 KB, the same for the same request) and records the
// bodies it sent by Idempotency-Key; the keys in fail are answered 422;
// hold, when set, is called with each key before the answer (outside mu).
type answerVendor struct {
	mu   sync.Mutex
	sent map[string][][]byte
	fail map[string]bool
	hold func(key string)
	srv  *httptest.Server
}

func newAnswerVendor(t *testing.T) *answerVendor {
	v := &answerVendor{sent: map[string][][]byte{}, fail: map[string]bool{}}
	v.srv = httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		body, err := io.ReadAll(r.Body)
		if err != nil {
			http.Error(w, err.Error(), http.StatusBadRequest)
			return
		}
		key := r.Header.Get("Idempotency-Key")
		v.mu.Lock()
		hold := v.hold
		v.mu.Unlock()
		if hold != nil {
			hold(key)
		}
		v.mu.Lock()
		status, b := http.StatusCreated, vendorsim.Answer(r.Method, r.URL.Path, key, body, answerBytes)
		if v.fail[key] {
			status, b = http.StatusUnprocessableEntity, []byte(`{"error":"validation failed"}`)
		}
		v.sent[key] = append(v.sent[key], b)
		v.mu.Unlock()
		w.Header().Set("Content-Type", "application/json")
		w.WriteHeader(status)
		_, _ = w.Write(b)
	}))
	t.Cleanup(v.srv.Close)
	return v
}

// times is how many times the vendor saw key.
func (v *answerVendor) times(key string) int {
	v.mu.Lock()
	defer v.mu.Unlock()
	return len(v.sent[key])
}

// exportBody is NDJSON of n call lines without a vendor: the even ones
// with an id of their own (prefix-order-N), the odd ones without (they
// get <export id>:N). ids are the calls' ids for export id.
func exportBody(prefix, id string, n int) (body []byte, ids []string) {
	var b bytes.Buffer
	for i := 1; i <= n; i++ {
		if i%2 == 0 {
			cid := fmt.Sprintf("%s-order-%d", prefix, i)
			fmt.Fprintf(&b, `{"id":%q,"method":"POST","path":"/orders/%d","body":{"order":%d}}`+"\n", cid, i, i)
			ids = append(ids, cid)
		} else {
			fmt.Fprintf(&b, `{"method":"POST","path":"/orders/%d","body":{"order":%d}}`+"\n", i, i)
			ids = append(ids, fmt.Sprintf("%s:%d", id, i))
		}
	}
	return b.Bytes(), ids
}

func postExport(t *testing.T, s setup, query string, body []byte) (answer, ExportStarted) {
	t.Helper()
	a := do(t, "POST", s.url+"/v1/exports?"+query, "application/x-ndjson", "", body)
	var st ExportStarted
	if a.status == http.StatusOK || a.status == http.StatusCreated {
		if err := json.Unmarshal(a.body, &st); err != nil {
			t.Fatalf("POST /v1/exports: %d %s: %v", a.status, a.body, err)
		}
	}
	return a, st
}

// resultLine is a line of results with its answer read.
type resultLine struct {
	queue.ResultLine
	answer queue.CallResult
}

func parseLine(t *testing.T, b []byte) resultLine {
	t.Helper()
	var l resultLine
	if err := json.Unmarshal(b, &l.ResultLine); err != nil {
		t.Fatalf("a results line that is not JSON: %v: %s", err, b)
	}
	if len(l.Answer) > 0 {
		if err := json.Unmarshal(l.Answer, &l.answer); err != nil {
			t.Fatalf("line %s: an answer that is not an answer: %v: %s", l.ID, err, l.Answer)
		}
	}
	return l
}

// results reads a whole results stream (GET path), failing on a stream
// that breaks.
func results(t *testing.T, rawURL string) []resultLine {
	t.Helper()
	resp, err := http.Get(rawURL)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK || resp.Header.Get("Content-Type") != "application/x-ndjson" {
		b, _ := io.ReadAll(resp.Body)
		t.Fatalf("GET %s: %d %s %s", rawURL, resp.StatusCode, resp.Header.Get("Content-Type"), b)
	}
	var out []resultLine
	r := bufio.NewReader(resp.Body)
	for {
		b, err := r.ReadBytes('\n')
		if errors.Is(err, io.EOF) && len(b) == 0 {
			return out
		}
		if err != nil {
			t.Fatalf("GET %s: the stream broke after %d lines: %v", rawURL, len(out), err)
		}
		out = append(out, parseLine(t, b))
	}
}

// checkAnswers checks that lines are the calls ids in order, each done
// with the vendor's 201 and the very body the vendor sent for it.
func checkAnswers(t *testing.T, v *answerVendor, lines []resultLine, ids []string) {
	t.Helper()
	if len(lines) != len(ids) {
		t.Errorf("%d lines, want %d", len(lines), len(ids))
	}
	v.mu.Lock()
	defer v.mu.Unlock()
	for i, l := range lines[:min(len(lines), len(ids))] {
		sent := v.sent[ids[i]]
		switch {
		case l.ID != ids[i]:
			t.Errorf("line %d is %s, want %s: not in the body's order", i+1, l.ID, ids[i])
		case l.State != queue.CallDone || l.Status != http.StatusCreated || l.Attempts != 1:
			t.Errorf("line %d (%s): %s, status %d, %d attempts; want done, 201, 1", i+1, l.ID, l.State, l.Status, l.Attempts)
		case len(sent) != 1:
			t.Errorf("line %d (%s): the vendor answered it %d times, want once", i+1, l.ID, len(sent))
		case !bytes.Equal(l.answer.Body, sent[0]) || l.answer.Bytes != int64(len(sent[0])) || l.answer.Cut || l.answer.Status != http.StatusCreated:
			t.Errorf("line %d (%s): answer %d bytes (cut %v, status %d) %.80s..., the vendor sent %d bytes %.80s...",
				i+1, l.ID, l.answer.Bytes, l.answer.Cut, l.answer.Status, l.answer.Body, len(sent[0]), sent[0])
		}
	}
}

// exportURL is the URL of export id's route under s (suffix "" for the
// export itself).
func exportURL(s setup, id, suffix string) string {
	return s.url + "/v1/exports/" + url.PathEscape(id) + suffix
}

// TestExportPostAndFollow: an NDJSON export of 50 calls (half with ids
// of their own) is queued (201, Location, 50 enqueued); following its
// results gives 50 lines in the body's order, each the vendor's 201 with
// the very 4 KB body it sent, and ends once the export finished; the
// export's progress says finished, 50 done; the same POST again queues
// nothing (200, 50 already queued) and the vendor saw each call once;
// the body's temporary file is gone.
func TestExportPostAndFollow(t *testing.T) {
	tmp := t.TempDir()
	t.Setenv("TMPDIR", tmp)
	v := newAnswerVendor(t)
	s := newSetupAt(t, Options{}, v.srv.URL, 1000, true)
	body, ids := exportBody("pf", "pf-1", 50)
	a, st := postExport(t, s, "vendor="+s.vendor+"&id=pf-1", body)
	if a.status != http.StatusCreated || st.ID != "pf-1" || st.Vendor != s.vendor || st.Enqueued != 50 || st.AlreadyQueued != 0 || st.Total != 50 || !st.Queued {
		t.Fatalf("POST: %d %s, want 201 with 50 enqueued", a.status, a.body)
	}
	if loc := a.header.Get("Location"); loc != "/v1/exports/pf-1" {
		t.Errorf("Location %q, want /v1/exports/pf-1", loc)
	}
	lines := results(t, exportURL(s, "pf-1", "/results?follow=true"))
	checkAnswers(t, v, lines, ids)

	g := do(t, "GET", exportURL(s, "pf-1", ""), "", "", nil)
	var p ExportProgress
	if err := json.Unmarshal(g.body, &p); err != nil || g.status != http.StatusOK {
		t.Fatalf("GET the export: %d %s", g.status, g.body)
	}
	if p.State != "finished" || p.Done != 50 || p.Failed != 0 || p.Total != 50 || !p.Ordered || p.Created.IsZero() {
		t.Errorf("GET the export once followed: %+v, want finished with 50 done", p)
	}
	a, st = postExport(t, s, "vendor="+s.vendor+"&id=pf-1", body)
	if a.status != http.StatusOK || st.Enqueued != 0 || st.AlreadyQueued != 50 || st.State != "finished" {
		t.Errorf("the same POST again: %d %s, want 200 with nothing enqueued and 50 already queued", a.status, a.body)
	}
	// Without follow, the results read the same.
	checkAnswers(t, v, results(t, exportURL(s, "pf-1", "/results")), ids)
	for _, id := range ids {
		if n := v.times(id); n != 1 {
			t.Errorf("the vendor saw %s %d times, want once", id, n)
		}
	}
	if left, _ := os.ReadDir(tmp); len(left) != 0 {
		t.Errorf("the temporary files of the bodies are left in TMPDIR: %v", left)
	}
}

// TestExportStreamsBeforeItEnds: a follow delivers the first lines while
// a later call is still at the vendor: the vendor holds call 6 of 10
// until the test has read five lines (and seen the export running), then
// lets it go, and the stream goes on to the tenth line and ends.
func TestExportStreamsBeforeItEnds(t *testing.T) {
	v := newAnswerVendor(t)
	s := newSetupAt(t, Options{}, v.srv.URL, 1000, true)
	body, ids := exportBody("sb", "sb-1", 10)
	held, release := make(chan struct{}), make(chan struct{})
	var once, relOnce sync.Once
	letGo := func() { relOnce.Do(func() { close(release) }) }
	t.Cleanup(letGo)
	v.hold = func(key string) {
		if key == ids[5] {
			once.Do(func() { close(held) })
			<-release
		}
	}
	if a, _ := postExport(t, s, "vendor="+s.vendor+"&id=sb-1", body); a.status != http.StatusCreated {
		t.Fatalf("POST: %d %s", a.status, a.body)
	}
	resp, err := http.Get(exportURL(s, "sb-1", "/results?follow=true"))
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	type read struct {
		b   []byte
		err error
	}
	reads := make(chan read)
	go func() {
		r := bufio.NewReader(resp.Body)
		for {
			b, err := r.ReadBytes('\n')
			reads <- read{b, err}
			if err != nil {
				return
			}
		}
	}()
	next := func() read {
		t.Helper()
		select {
		case r := <-reads:
			return r
		case <-time.After(30 * time.Second):
			t.Fatal("no line within 30 s")
			return read{}
		}
	}
	var lines []resultLine
	for range 5 {
		r := next()
		if r.err != nil {
			t.Fatalf("the stream ended after %d lines while call 6 is held at the vendor: %v", len(lines), r.err)
		}
		lines = append(lines, parseLine(t, r.b))
	}
	<-held // call 6 reached the vendor and is held there
	var p ExportProgress
	if g := do(t, "GET", exportURL(s, "sb-1", ""), "", "", nil); json.Unmarshal(g.body, &p) != nil || p.State != "running" {
		t.Fatalf("five lines read, call 6 held: the export is %s (%s), want running", p.State, g.body)
	}
	letGo()
	for {
		r := next()
		if errors.Is(r.err, io.EOF) && len(r.b) == 0 {
			break
		}
		if r.err != nil {
			t.Fatalf("the stream broke after %d lines: %v", len(lines), r.err)
		}
		lines = append(lines, parseLine(t, r.b))
	}
	checkAnswers(t, v, lines, ids)
}

// TestExportRefusals: what POST /v1/exports refuses, and how it says so;
// nothing of a refused body is queued or recorded, and no temporary file
// is left.
func TestExportRefusals(t *testing.T) {
	tmp := t.TempDir()
	t.Setenv("TMPDIR", tmp)
	v := newAnswerVendor(t)
	s := newSetupAt(t, Options{MaxExportBody: 4096}, v.srv.URL, 3, false)
	if a, _ := postExport(t, s, "vendor="+s.vendor+"&id=other", []byte(`{"path":"/a"}`+"\n")); a.status != http.StatusCreated {
		t.Fatalf("POST: %d %s", a.status, a.body)
	}
	good := `{"path":"/a"}` + "\n"
	for _, tc := range []struct {
		name, ctype, query, body string
		status                   int
		says                     string
		lines                    []int // the lines the answer names
	}{
		{"bad lines", "application/x-ndjson", "id=bad", good + `{"method":"POST"}` + "\n" + good + `{"vendor":"x","path":"/b"}` + "\n" + `{"path":"/c","colour":"red"}` + "\n",
			http.StatusBadRequest, "nothing was queued", []int{2, 4, 5}},
		{"a repeated id", "application/x-ndjson", "id=rep", `{"id":"a","path":"/a"}` + "\n" + `{"id":"a","path":"/b"}` + "\n", http.StatusBadRequest, "also on line 1", []int{2}},
		{"no vendor", "application/x-ndjson", "", good, http.StatusBadRequest, "?vendor=", nil},
		{"an unknown vendor", "application/x-ndjson", "vendor=nope&", good, http.StatusBadRequest, `unknown vendor "nope"`, nil},
		{"a bad export id", "application/x-ndjson", "id=a%20b", good, http.StatusBadRequest, "export id", nil},
		{"an empty body", "application/x-ndjson", "id=empty", "\n\n", http.StatusBadRequest, "has no calls", nil},
		{"an id on another vendor", "application/x-ndjson", "vendor=nope&id=other", good, http.StatusConflict, "is on vendor " + s.vendor, nil},
		{"a body too large", "application/x-ndjson", "id=big", strings.Repeat(good, 400), http.StatusRequestEntityTooLarge, "larger than 4096 bytes", nil},
		{"JSON", "application/json", "id=json", good, http.StatusUnsupportedMediaType, "application/x-ndjson", nil},
		{"more calls than the queue holds", "application/x-ndjson", "id=full", strings.Repeat(good, 3), http.StatusTooManyRequests, "full", nil},
	} {
		t.Run(tc.name, func(t *testing.T) {
			q := tc.query
			if !strings.Contains(q, "vendor=") && tc.name != "no vendor" {
				q = "vendor=" + s.vendor + "&" + q
			}
			a := do(t, "POST", s.url+"/v1/exports?"+q, tc.ctype, "", []byte(tc.body))
			var ref Refusal
			if err := json.Unmarshal(a.body, &ref); err != nil {
				t.Fatalf("%d %s: not a refusal: %v", a.status, a.body, err)
			}
			said := ref.Error
			var named []int
			for _, l := range ref.Lines {
				said += "; " + l.Error
				named = append(named, l.Line)
			}
			if a.status != tc.status || !strings.Contains(said, tc.says) {
				t.Fatalf("%d %s, want %d saying %q", a.status, a.body, tc.status, tc.says)
			}
			if !slices.Equal(named, tc.lines) {
				t.Errorf("the answer names lines %v, want %v: %s", named, tc.lines, a.body)
			}
			if tc.status == http.StatusTooManyRequests && a.header.Get("Retry-After") == "" {
				t.Error("429 without Retry-After")
			}
			if id := url.Values(must(url.ParseQuery(q))).Get("id"); id != "" && id != "other" {
				if g := do(t, "GET", exportURL(s, id, ""), "", "", nil); g.status != http.StatusNotFound {
					t.Errorf("GET the refused export %s: %d %s, want 404: nothing recorded", id, g.status, g.body)
				}
			}
		})
	}
	// A body of no announced length (chunked) is cut at the bound too.
	req, err := http.NewRequest("POST", s.url+"/v1/exports?vendor="+s.vendor+"&id=chunked", io.NopCloser(strings.NewReader(strings.Repeat(good, 400))))
	if err != nil {
		t.Fatal(err)
	}
	req.Header.Set("Content-Type", "application/x-ndjson")
	if resp, err := http.DefaultClient.Do(req); err != nil {
		t.Errorf("POST a chunked body too large: %v", err)
	} else {
		resp.Body.Close()
		if resp.StatusCode != http.StatusRequestEntityTooLarge || req.ContentLength != 0 {
			t.Errorf("POST a chunked body too large (length %d): %d, want 413", req.ContentLength, resp.StatusCode)
		}
	}
	a := do(t, "POST", s.url+"/v1/exports?vendor="+s.vendor+"&id=bad", "application/x-ndjson", "", []byte(`{"vendor":"x","path":"/b"}`+"\n"))
	if !bytes.Contains(a.body, []byte("?vendor=")) {
		t.Errorf("a line naming a vendor: %s, want the answer to say the vendor is ?vendor=", a.body)
	}
	if n, err := s.client.Waiting(context.Background(), s.vendor); err != nil || n != 1 {
		t.Errorf("%d calls waiting after the refused bodies (%v), want the first export's 1", n, err)
	}
	if left, _ := os.ReadDir(tmp); len(left) != 0 {
		t.Errorf("the temporary files of the bodies are left in TMPDIR: %v", left)
	}
}

func must[T any](v T, err error) T {
	if err != nil {
		panic(err)
	}
	return v
}

// TestExportUnknown: every route of an export that does not exist is
// 404, saying so; results' bad parameters are 400.
func TestExportUnknown(t *testing.T) {
	s := newSetup(t, Options{}, 10, false)
	for _, tc := range []struct{ method, suffix string }{
		{"GET", ""}, {"GET", "/results"}, {"GET", "/results?follow=true"}, {"POST", "/retry"}, {"POST", "/cancel"},
	} {
		a := do(t, tc.method, exportURL(s, "no-such-export", tc.suffix), "", "", nil)
		if a.status != http.StatusNotFound || !bytes.Contains(a.body, []byte(`unknown export \"no-such-export\"`)) {
			t.Errorf("%s %s of an unknown export: %d %s, want 404 saying so", tc.method, tc.suffix, a.status, a.body)
		}
	}
	for _, q := range []string{"follow=maybe", "state=lost", "state=done,lost"} {
		if a := do(t, "GET", exportURL(s, "no-such-export", "/results?"+q), "", "", nil); a.status != http.StatusBadRequest {
			t.Errorf("GET results?%s: %d %s, want 400", q, a.status, a.body)
		}
	}
}

// TestExportRetry: calls the vendor answers 422 end failed; results
// ?state=failed lists exactly them with the vendor's 422; once the
// vendor takes them, POST retry queues them again (queued 2) under their
// own ids, and the export finishes with every answer the vendor's.
func TestExportRetry(t *testing.T) {
	v := newAnswerVendor(t)
	s := newSetupAt(t, Options{}, v.srv.URL, 1000, true)
	body, ids := exportBody("rt", "rt-1", 10)
	v.fail[ids[2]], v.fail[ids[7]] = true, true
	if a, _ := postExport(t, s, "vendor="+s.vendor+"&id=rt-1", body); a.status != http.StatusCreated {
		t.Fatalf("POST: %d %s", a.status, a.body)
	}
	if all := results(t, exportURL(s, "rt-1", "/results?follow=true")); len(all) != 10 {
		t.Fatalf("%d lines, want 10", len(all))
	}
	failed := results(t, exportURL(s, "rt-1", "/results?state=failed"))
	var got []string
	for _, l := range failed {
		got = append(got, l.ID)
		if l.Status != http.StatusUnprocessableEntity || l.Error == "" || l.answer.Status != http.StatusUnprocessableEntity {
			t.Errorf("failed line %s: status %d, error %q, answer %d; want the vendor's 422 and an error", l.ID, l.Status, l.Error, l.answer.Status)
		}
	}
	if want := []string{ids[2], ids[7]}; !slices.Equal(got, want) {
		t.Fatalf("results?state=failed: %v, want %v", got, want)
	}
	v.mu.Lock()
	clear(v.fail)
	v.mu.Unlock()
	a := do(t, "POST", exportURL(s, "rt-1", "/retry"), "", "", nil)
	var r queue.ExportRetry
	if err := json.Unmarshal(a.body, &r); err != nil || a.status != http.StatusOK || r.Queued != 2 || len(r.Gone) != 0 {
		t.Fatalf("POST retry: %d %s, want 200 with 2 queued", a.status, a.body)
	}
	lines := results(t, exportURL(s, "rt-1", "/results?follow=true"))
	for _, l := range lines {
		if l.State != queue.CallDone || l.answer.Status != http.StatusCreated {
			t.Errorf("after the retry, %s is %s with %d, want done with 201", l.ID, l.State, l.answer.Status)
		}
	}
	for i, id := range ids {
		want := 1
		if i == 2 || i == 7 {
			want = 2
		}
		if n := v.times(id); n != want {
			t.Errorf("the vendor saw %s %d times, want %d", id, n, want)
		}
	}
	var p ExportProgress
	if g := do(t, "GET", exportURL(s, "rt-1", ""), "", "", nil); json.Unmarshal(g.body, &p) != nil || p.State != "finished" || p.Done != 10 || p.Failed != 0 {
		t.Errorf("after the retry: %s, want finished with 10 done", g.body)
	}
}

// TestExportCancel: with the vendor's one slot held by the first call,
// POST cancel cancels the four waiting calls (cancelled 4, running 1);
// they never reach the vendor, the first ends as it will, and the
// export finishes with 1 done and 4 failed, its results saying which.
func TestExportCancel(t *testing.T) {
	v := newAnswerVendor(t)
	s := newSetupAt(t, Options{}, v.srv.URL, 1000, true, func(v *queue.Vendor) { v.Concurrency = 1 })
	body, ids := exportBody("cx", "cx-1", 5)
	arrived, release := make(chan struct{}), make(chan struct{})
	var once, relOnce sync.Once
	letGo := func() { relOnce.Do(func() { close(release) }) }
	t.Cleanup(letGo)
	v.hold = func(key string) {
		if key == ids[0] {
			once.Do(func() { close(arrived) })
			<-release
		}
	}
	if a, _ := postExport(t, s, "vendor="+s.vendor+"&id=cx-1", body); a.status != http.StatusCreated {
		t.Fatalf("POST: %d %s", a.status, a.body)
	}
	select {
	case <-arrived:
	case <-time.After(30 * time.Second):
		t.Fatal("the first call did not reach the vendor in 30 s")
	}
	a := do(t, "POST", exportURL(s, "cx-1", "/cancel"), "", "", nil)
	var c queue.ExportCancel
	if err := json.Unmarshal(a.body, &c); err != nil || a.status != http.StatusOK || c.Cancelled != 4 || c.Running != 1 {
		t.Fatalf("POST cancel: %d %s, want 200 with 4 cancelled and 1 running", a.status, a.body)
	}
	letGo()
	lines := results(t, exportURL(s, "cx-1", "/results?follow=true"))
	var states []string
	for _, l := range lines {
		states = append(states, l.State)
	}
	if want := []string{"done", "cancelled", "cancelled", "cancelled", "cancelled"}; !slices.Equal(states, want) {
		t.Errorf("results after the cancel: %v, want %v", states, want)
	}
	var p ExportProgress
	if g := do(t, "GET", exportURL(s, "cx-1", ""), "", "", nil); json.Unmarshal(g.body, &p) != nil || p.State != "finished" || p.Done != 1 || p.Failed != 4 {
		t.Errorf("after the cancel: %s, want finished, 1 done and 4 failed", g.body)
	}
	for _, id := range ids[1:] {
		if n := v.times(id); n != 0 {
			t.Errorf("the cancelled call %s reached the vendor %d times", id, n)
		}
	}
}

// serveAPI serves the API of s's client as `shaper serve` does
// (NewServer), but with the write timeout given, on a free port; stop
// shuts it down.
func serveAPI(t *testing.T, s setup, srv *http.Server) (base string, stop func()) {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	done := make(chan error, 1)
	go func() { done <- srv.Serve(ln) }()
	var once sync.Once
	stop = func() {
		once.Do(func() {
			ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
			defer cancel()
			if err := srv.Shutdown(ctx); err != nil {
				t.Errorf("Shutdown: %v", err)
			}
			if err := <-done; !errors.Is(err, http.ErrServerClosed) {
				t.Errorf("Serve: %v", err)
			}
		})
	}
	t.Cleanup(stop)
	return "http://" + ln.Addr().String(), stop
}

// TestExportFollowOutlivesWriteTimeout: a follow that lasts longer than
// the server's WriteTimeout (half a second here; NewServer's is 2.5
// minutes) is not cut by it: 20 calls at 10 a second take two seconds,
// and the stream gives every line, then ends.
func TestExportFollowOutlivesWriteTimeout(t *testing.T) {
	v := newAnswerVendor(t)
	s := newSetupAt(t, Options{}, v.srv.URL, 1000, true, func(v *queue.Vendor) { v.Policy.Limits[0].Rate = 10 })
	h, _ := newServer(Options{Client: s.client})
	base, _ := serveAPI(t, s, httpguard.NewServer(Traced(h, nil), 500*time.Millisecond, nil))
	s.url = base
	body, ids := exportBody("wt", "wt-1", 20)
	if a, _ := postExport(t, s, "vendor="+s.vendor+"&id=wt-1", body); a.status != http.StatusCreated {
		t.Fatalf("POST: %d %s", a.status, a.body)
	}
	start := time.Now()
	lines := results(t, exportURL(s, "wt-1", "/results?follow=true"))
	t.Logf("followed %d lines in %s", len(lines), time.Since(start).Round(time.Millisecond))
	checkAnswers(t, v, lines, ids)
}

// TestExportFollowEndsOnShutdown: shutting the server down ends a follow
// at once, and its client sees the stream break (not end as if whole),
// while the vendor still holds the export's first call.
func TestExportFollowEndsOnShutdown(t *testing.T) {
	v := newAnswerVendor(t)
	s := newSetupAt(t, Options{}, v.srv.URL, 1000, true)
	release := make(chan struct{})
	t.Cleanup(func() { close(release) })
	v.hold = func(string) { <-release }
	base, stop := serveAPI(t, s, NewServer(Options{Client: s.client}, nil))
	s.url = base
	body, _ := exportBody("sd", "sd-1", 3)
	if a, _ := postExport(t, s, "vendor="+s.vendor+"&id=sd-1", body); a.status != http.StatusCreated {
		t.Fatalf("POST: %d %s", a.status, a.body)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second) // no hang if it fails
	defer cancel()
	req, err := http.NewRequestWithContext(ctx, "GET", exportURL(s, "sd-1", "/results?follow=true"), nil)
	if err != nil {
		t.Fatal(err)
	}
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		t.Fatalf("GET results: %d", resp.StatusCode)
	}
	read := make(chan error, 1)
	go func() {
		_, err := io.ReadAll(resp.Body)
		read <- err
	}()
	go stop()
	select {
	case err := <-read:
		if err == nil {
			t.Error("the follow ended as if whole when the server shut down, with the export's calls unfinished: want the stream broken")
		}
	case <-time.After(5 * time.Second):
		t.Error("the follow went on 5 s after the server began to shut down")
	}
}

// TestExportFollowClientGone: a follow holds a slot of MaxWaiting (one
// here: a second follow is 503 with Retry-After) until its client goes
// away: then the request's end stops ExportResults and frees the slot,
// and the next follow is served, though the export has not finished.
func TestExportFollowClientGone(t *testing.T) {
	v := newAnswerVendor(t)
	s := newSetupAt(t, Options{MaxWaiting: 1}, v.srv.URL, 1000, true)
	release := make(chan struct{})
	t.Cleanup(func() { close(release) })
	v.hold = func(string) { <-release }
	body, _ := exportBody("cg", "cg-1", 3)
	if a, _ := postExport(t, s, "vendor="+s.vendor+"&id=cg-1", body); a.status != http.StatusCreated {
		t.Fatalf("POST: %d %s", a.status, a.body)
	}
	follow := exportURL(s, "cg-1", "/results?follow=true")
	ctx, cancel := context.WithCancel(context.Background())
	req, err := http.NewRequestWithContext(ctx, "GET", follow, nil)
	if err != nil {
		t.Fatal(err)
	}
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	if resp.StatusCode != http.StatusOK {
		t.Fatalf("the first follow: %d", resp.StatusCode)
	}
	if a := do(t, "GET", follow, "", "", nil); a.status != http.StatusServiceUnavailable || a.header.Get("Retry-After") == "" {
		t.Fatalf("a second follow while the first holds the one slot: %d %s, want 503 with Retry-After", a.status, a.body)
	}
	cancel() // the client goes away
	resp.Body.Close()
	for deadline := time.Now().Add(10 * time.Second); ; time.Sleep(20 * time.Millisecond) {
		ctx, cancel := context.WithCancel(context.Background())
		req, _ := http.NewRequestWithContext(ctx, "GET", follow, nil)
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		status := resp.StatusCode
		cancel()
		resp.Body.Close()
		if status == http.StatusOK {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("a follow 10 s after the first one's client went away: %d, want its slot free", status)
		}
	}
}

// TestExportFromPython is the fourth bar in small: the same
// export from Python's standard library alone (testdata/export_client.py,
// urllib and json): it POSTs 200 calls, follows the results stream to
// its end and compares every answer with what a vendor answering as
// `shaper mock-vendor --answer-bytes 4096` sent (vendorsim.Answer,
// recomputed in Python), then posts the body again (nothing queued).
// Skipped where python3 is not on PATH (CI installs it).
func TestExportFromPython(t *testing.T) {
	py, err := exec.LookPath("python3")
	if err != nil {
		t.Skip("testdata/export_client.py needs python3 on PATH (Debian: apt-get install python3)")
	}
	mock := &vendorsim.Mock{Rate: 1000, Window: time.Second, AnswerBytes: answerBytes}
	vs := httptest.NewServer(mock)
	t.Cleanup(vs.Close)
	s := newSetupAt(t, Options{Token: "tok"}, vs.URL, 1000, true)
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	cmd := exec.CommandContext(ctx, py, filepath.Join("testdata", "export_client.py"), "--api", s.url, "--vendor", s.vendor,
		"--calls", "200", "--answer-bytes", fmt.Sprint(answerBytes), "--id", "py-1")
	cmd.Env = append(os.Environ(), "SHAPER_API_TOKEN=tok")
	out, err := cmd.CombinedOutput()
	t.Logf("python3 testdata/export_client.py:\n%s", out)
	if err != nil {
		t.Fatalf("export_client.py: %v", err)
	}
	if !bytes.Contains(out, []byte("OK: 200 of 200 answers match")) {
		t.Errorf("export_client.py did not say every answer matched")
	}
	if sum := mock.Summarize(); sum.Requests != 200 {
		t.Errorf("the vendor saw %d requests, want 200 (each call once)", sum.Requests)
	}
}
