package queue

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"net/http"
	"net/url"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/shaper-dev/shaper/internal/vendorsim"
)

// pullLine is a line of an export's results, with its page's items.
type pullLine struct {
	ResultLine
	Items     []string
	NextError string
}

// readPulled reads an export's results once it finished.
func readPulled(t *testing.T, c *Client, export string) []pullLine {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	var buf bytes.Buffer
	sum, err := c.ExportResults(ctx, export, ResultsQuery{Follow: true}, &buf)
	if err != nil {
		t.Fatalf("ExportResults: %v (read %d lines)", err, sum.Lines)
	}
	var out []pullLine
	for _, raw := range bytes.Split(bytes.TrimSpace(buf.Bytes()), []byte("\n")) {
		var l pullLine
		if err := json.Unmarshal(raw, &l.ResultLine); err != nil {
			t.Fatalf("line %q: %v", raw, err)
		}
		var a struct {
			Body struct {
				Items []struct{ ID string } `json:"items"`
			} `json:"body"`
			NextError string `json:"next_error"`
		}
		_ = json.Unmarshal(l.Answer, &a)
		for _, it := range a.Body.Items {
			l.Items = append(l.Items, it.ID)
		}
		l.NextError = a.NextError
		out = append(out, l)
	}
	return out
}

// TestPullReadsEveryPage: a call with "next" pulls every page of a list
// behind a cursor, a Link header or a next URL, each page a call of its
// own (id and page number), asked once, read back in page order.
func TestPullReadsEveryPage(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		style string
		next  Next
	}{
		{"cursor", Next{Cursor: "/meta/next_cursor", Param: "cursor"}},
		{"link", Next{Link: "next"}},
		{"url", Next{URL: "/links/next"}},
	} {
		t.Run(tc.style, func(t *testing.T) {
			e := newEnv(t)
			mock := &vendorsim.Mock{Kind: "fixed", Rate: 1000, Window: time.Second,
				Paging: vendorsim.Paging{Pages: 12, Items: 5, Style: tc.style, Prefix: "/api/contacts"}}
			v := e.vendor("pull", policy(100), 0, mock)
			c := e.newClient()
			e.startWorker(nil)
			next := tc.next
			st, err := c.StartExportFrom(context.Background(), "", v, CallsOf([]Call{{ID: "sync-" + tc.style, Path: "/contacts?limit=5", Next: &next}}))
			if err != nil {
				t.Fatal(err)
			}
			lines := readPulled(t, c, st.ID)
			if len(lines) != 12 {
				t.Fatalf("%d result lines, want 12: %+v", len(lines), lines)
			}
			item := 0
			for i, l := range lines {
				want := "sync-" + tc.style
				if i > 0 {
					want = pageID(want, i+1)
				}
				if l.ID != want || l.Page != i+1 || l.State != CallDone || l.Status != 200 || l.NextError != "" {
					t.Errorf("line %d: %s page %d %s %d next_error %q; want %s page %d done 200", i, l.ID, l.Page, l.State, l.Status, l.NextError, want, i+1)
				}
				for _, it := range l.Items {
					item++
					if it != fmt.Sprintf("c-%d", item) {
						t.Errorf("line %d: item %s, want c-%d", i, it, item)
					}
				}
			}
			if item != 60 {
				t.Errorf("%d items in all, want 60", item)
			}
			sum := mock.Summarize()
			if sum.KeysSeen != 12 || sum.KeysRepeated != 0 {
				t.Errorf("the vendor saw %d keys, %d of them more than once (%v); want 12, none", sum.KeysSeen, sum.KeysRepeated, sum.RepeatedFirst)
			}
			if e, err := c.ExportStatus(context.Background(), st.ID); err != nil || e.Total != 12 || e.Done != 12 || !e.Finished() {
				t.Errorf("export status %+v, %v; want 12 of 12 done", e, err)
			}
		})
	}
}

// TestPullStops: a pull ends with a clear error in its last page's
// answer, never looping or leaving the vendor: a cursor seen before, a
// next URL on another host or outside base_url's path, max_pages.
func TestPullStops(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		name     string
		next     Next
		maxPages int
		answer   func(w http.ResponseWriter, r *http.Request, page int)
		pages    int
		want     string
	}{
		{"cursor repeats", Next{Cursor: "/next", Param: "c"}, 0, func(w http.ResponseWriter, r *http.Request, page int) {
			fmt.Fprintf(w, `{"next":%q}`, map[int]string{1: "a", 2: "b", 3: "a"}[page])
		}, 3, "is page 2's again"},
		{"another host", Next{Link: "next"}, 0, func(w http.ResponseWriter, r *http.Request, page int) {
			w.Header().Set("Link", `<https://evil.example/api/list?p=2>; rel="next"`)
			fmt.Fprint(w, `{}`)
		}, 1, "not under the vendor's base_url"},
		{"outside base path", Next{URL: "/next"}, 0, func(w http.ResponseWriter, r *http.Request, page int) {
			fmt.Fprintf(w, `{"next":"http://%s/apix/list?p=2"}`, r.Host)
		}, 1, "not under the vendor's base_url"},
		{"dot segments", Next{URL: "/next"}, 0, func(w http.ResponseWriter, r *http.Request, page int) {
			fmt.Fprint(w, `{"next":"../admin?p=2"}`)
		}, 1, "not under the vendor's base_url"},
		{"max_pages", Next{Cursor: "/next", Param: "c"}, 4, func(w http.ResponseWriter, r *http.Request, page int) {
			fmt.Fprintf(w, `{"next":"p%d"}`, page+1)
		}, 4, "max_pages (4)"},
		{"not JSON", Next{Cursor: "/next", Param: "c"}, 0, func(w http.ResponseWriter, r *http.Request, page int) {
			fmt.Fprint(w, `<html>`)
		}, 1, "not JSON"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			e := newEnv(t)
			var mu sync.Mutex
			seen := map[string]int{}
			v := e.vendor("stop", policy(100), 0, http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
				mu.Lock()
				seen[r.Header.Get("Idempotency-Key")]++
				mu.Unlock()
				page := 1
				if k := strings.LastIndex(r.Header.Get("Idempotency-Key"), ":p"); k >= 0 {
					fmt.Sscan(r.Header.Get("Idempotency-Key")[k+2:], &page)
				}
				tc.answer(w, r, page)
			}))
			c := e.newClient()
			e.startWorker(nil)
			next := tc.next
			st, err := c.StartExportFrom(context.Background(), "", v, CallsOf([]Call{{ID: "list", Path: "/list", Next: &next, MaxPages: tc.maxPages}}))
			if err != nil {
				t.Fatal(err)
			}
			lines := readPulled(t, c, st.ID)
			if len(lines) != tc.pages {
				t.Fatalf("%d pages, want %d: %+v", len(lines), tc.pages, lines)
			}
			last := lines[len(lines)-1]
			if !strings.Contains(last.NextError, tc.want) {
				t.Errorf("the last page's next_error is %q; want it to say %q", last.NextError, tc.want)
			}
			for _, l := range lines[:len(lines)-1] {
				if l.NextError != "" {
					t.Errorf("page %d has next_error %q", l.Page, l.NextError)
				}
			}
			mu.Lock()
			defer mu.Unlock()
			for k, n := range seen {
				if n != 1 {
					t.Errorf("the vendor saw %s %d times", k, n)
				}
			}
		})
	}
}

// TestPullPageRetried: a page answered 503 is retried; the page after it
// is queued once, by the run that succeeded, and every page reads back
// in order.
func TestPullPageRetried(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	var mu sync.Mutex
	hits := map[string]int{}
	v := e.vendor("retried", policy(100), 0, http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		key := r.Header.Get("Idempotency-Key")
		mu.Lock()
		hits[key]++
		n := hits[key]
		mu.Unlock()
		if key == "feed:p3" && n == 1 {
			w.WriteHeader(http.StatusServiceUnavailable)
			return
		}
		page := 1
		if c := r.URL.Query().Get("cursor"); c != "" {
			fmt.Sscan(c, &page)
		}
		if page < 5 {
			fmt.Fprintf(w, `{"page":%d,"next":"%d"}`, page, page+1)
			return
		}
		fmt.Fprintf(w, `{"page":%d,"next":null}`, page)
	}))
	c := e.newClient()
	e.startWorker(nil)
	st, err := c.StartExportFrom(context.Background(), "", v, CallsOf([]Call{{ID: "feed", Path: "/feed", Next: &Next{Cursor: "/next", Param: "cursor"}}}))
	if err != nil {
		t.Fatal(err)
	}
	lines := readPulled(t, c, st.ID)
	if len(lines) != 5 {
		t.Fatalf("%d pages, want 5", len(lines))
	}
	for i, l := range lines {
		var a struct {
			Body struct{ Page int } `json:"body"`
		}
		_ = json.Unmarshal(l.Answer, &a)
		if l.Page != i+1 || a.Body.Page != i+1 || l.State != CallDone {
			t.Errorf("line %d: page %d, body's page %d, %s", i, l.Page, a.Body.Page, l.State)
		}
		if want := 1 + btoi(i == 2); l.Attempts != want {
			t.Errorf("page %d: %d attempts, want %d", i+1, l.Attempts, want)
		}
	}
	mu.Lock()
	defer mu.Unlock()
	if hits["feed:p3"] != 2 || hits["feed:p4"] != 1 || len(hits) != 5 {
		t.Errorf("the vendor saw %v; want page 3 twice, every other page once", hits)
	}
}

func btoi(b bool) int {
	if b {
		return 1
	}
	return 0
}

// TestPullsInterleaveInOrder: an export's pulls and plain calls read
// back in the export's order, each pull's pages after its first call.
func TestPullsInterleaveInOrder(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	mock := &vendorsim.Mock{Kind: "fixed", Rate: 1000, Window: time.Second, Paging: vendorsim.Paging{Pages: 4, Items: 2, Prefix: "/api/list"}}
	v := e.vendor("mixed", policy(100), 0, mock)
	c := e.newClient()
	e.startWorker(nil)
	next := &Next{Cursor: "/meta/next_cursor", Param: "cursor"}
	calls := []Call{{Path: "/list/a", Next: next}, {Path: "/one"}, {Path: "/list/b", Next: next}, {Path: "/two"}}
	st, err := c.StartExportFrom(context.Background(), "mixed", v, CallsOf(calls))
	if err != nil {
		t.Fatal(err)
	}
	var got []string
	for _, l := range readPulled(t, c, st.ID) {
		got = append(got, l.ID)
	}
	want := []string{"mixed:1", "mixed:1:p2", "mixed:1:p3", "mixed:1:p4", "mixed:2", "mixed:3", "mixed:3:p2", "mixed:3:p3", "mixed:3:p4", "mixed:4"}
	if strings.Join(got, " ") != strings.Join(want, " ") {
		t.Errorf("results in order %v; want %v", got, want)
	}
}

func TestLinkTarget(t *testing.T) {
	for _, tc := range []struct {
		values []string
		rel    string
		want   string
	}{
		{[]string{`<https://a/x?p=2>; rel="next"`}, "next", "https://a/x?p=2"},
		{[]string{`<https://a/x?p=1>; rel="prev", <https://a/x?p=3>; rel="next"`}, "next", "https://a/x?p=3"},
		{[]string{`<https://a/x?p=1>; rel="first"`, `<https://a/x?p=3>; rel=next`}, "next", "https://a/x?p=3"},
		{[]string{`<https://a/x?p=3>; title="a, b"; rel="last next"`}, "next", "https://a/x?p=3"},
		{[]string{`<https://a/x?p=3>; rel="NEXT"`}, "next", "https://a/x?p=3"},
		{[]string{`<https://a/x?p=1>; rel="prev"`}, "next", ""},
		{[]string{`garbage`}, "next", ""},
		{nil, "next", ""},
	} {
		if got := linkTarget(tc.values, tc.rel); got != tc.want {
			t.Errorf("linkTarget(%q, %q) = %q; want %q", tc.values, tc.rel, got, tc.want)
		}
	}
}

func TestUnderBase(t *testing.T) {
	cur, _ := url.Parse("https://api.example/v1/list?p=1")
	for _, tc := range []struct {
		base, target, want string
		ok                 bool
	}{
		{"https://api.example/v1", "https://api.example/v1/list?p=2", "/list?p=2", true},
		{"https://api.example/v1/", "?p=2", "/list?p=2", true},
		{"https://api.example/v1", "/v1/list?cursor=a%2Fb", "/list?cursor=a%2Fb", true},
		{"https://api.example", "https://api.example/v1/list?p=2", "/v1/list?p=2", true},
		{"https://api.example/v1", "https://api.example/v1x/list", "", false},
		{"https://api.example/v1", "http://api.example/v1/list", "", false},
		{"https://api.example/v1", "https://evil.example/v1/list", "", false},
		{"https://api.example/v1", "https://user@api.example/v1/list", "", false},
		{"https://api.example/v1", "../admin", "", false},
		{"https://api.example/v1", "//evil.example/v1/list", "", false},
	} {
		got, err := underBase(tc.base, cur, tc.target)
		if (err == nil) != tc.ok || got != tc.want {
			t.Errorf("underBase(%s, %s) = %q, %v; want %q, ok %v", tc.base, tc.target, got, err, tc.want, tc.ok)
		}
	}
}

func TestCheckNext(t *testing.T) {
	for _, tc := range []struct {
		call Call
		want string // "" for valid
	}{
		{Call{Path: "/x", Next: &Next{Link: "next"}}, ""},
		{Call{Path: "/x", Next: &Next{Cursor: "/a/b", Param: "cursor"}, MaxPages: 50}, ""},
		{Call{Path: "/x", Next: &Next{URL: "/links/next"}}, ""},
		{Call{Path: "/x", Next: &Next{}}, "give one of"},
		{Call{Path: "/x", Next: &Next{Link: "next", URL: "/a"}}, "give one of"},
		{Call{Path: "/x", Next: &Next{Cursor: "/a"}}, `needs "param"`},
		{Call{Path: "/x", Next: &Next{Cursor: "a", Param: "c"}}, "not a JSON pointer"},
		{Call{Path: "/x", Next: &Next{URL: "links.next"}}, "not a JSON pointer"},
		{Call{Path: "/x", Next: &Next{Cursor: "/a", Param: "c&d"}}, "not a query parameter"},
		{Call{Path: "/x", Next: &Next{Link: "next", Param: "c"}}, `"param" goes with "cursor"`},
		{Call{Path: "/x", MaxPages: 5}, "without \"next\""},
		{Call{Path: "/x", Next: &Next{Link: "next"}, MaxPages: pageRoom}, "max_pages"},
		{Call{Path: "/x", Pull: &PullPage{Root: "a", Page: 2}}, "set by the worker"},
	} {
		err := tc.call.Validate()
		if (tc.want == "") != (err == nil) || err != nil && !strings.Contains(err.Error(), tc.want) {
			t.Errorf("Validate(%+v) = %v; want %q", tc.call, err, tc.want)
		}
	}
}

// TestParseNext: a call line's "next" and "max_pages".
func TestParseNext(t *testing.T) {
	calls, err := ParseCalls(strings.NewReader(`{"path":"/c","next":{"cursor":"/meta/next","param":"cursor"},"max_pages":20}` + "\n"))
	if err != nil || len(calls) != 1 || calls[0].Next == nil || calls[0].Next.Cursor != "/meta/next" || calls[0].MaxPages != 20 {
		t.Fatalf("ParseCalls = %+v, %v", calls, err)
	}
	for line, want := range map[string]string{
		`{"path":"/c","next":{"cursor":"/m"}}`:               `needs "param"`,
		`{"path":"/c","next":{"link":"next"},"max_pages":0}`: "max_pages",
		`{"path":"/c","next":{"rel":"next"}}`:                "unknown field",
		`{"path":"/c","pull":{"root":"a","page":2}}`:         "unknown field",
	} {
		if _, err := ParseCalls(strings.NewReader(line + "\n")); err == nil || !strings.Contains(err.Error(), want) {
			t.Errorf("%s: %v; want %q", line, err, want)
		}
	}
}
