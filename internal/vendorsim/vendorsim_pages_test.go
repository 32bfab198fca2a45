package vendorsim

import (
	"crypto/sha256"
	"encoding/base64"
	"encoding/hex"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"reflect"
	"strconv"
	"strings"
	"testing"
)

// send sends one request to url and returns the answer with its body read.
func send(t *testing.T, c *http.Client, method, url, key, body string) (*http.Response, []byte) {
	t.Helper()
	req, err := http.NewRequest(method, url, strings.NewReader(body))
	if err != nil {
		t.Fatal(err)
	}
	if key != "" {
		req.Header.Set("Idempotency-Key", key)
	}
	resp, err := c.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	if err != nil {
		t.Fatal(err)
	}
	return resp, b
}

// TestAnswerBytes checks that admitted requests are answered with
// exactly Answer's bytes, of the size asked for, the same for the same
// request.
func TestAnswerBytes(t *testing.T) {
	for _, n := range []int{0, 10, 300, 4096, 100_000} {
		t.Run(strconv.Itoa(n), func(t *testing.T) {
			srv := httptest.NewServer(&Mock{Rate: 1000, Window: sec, AnswerBytes: n})
			defer srv.Close()
			body := `{"to":"Ada","parcels":3}`
			var first []byte
			for range 2 {
				resp, got := send(t, srv.Client(), http.MethodPost, srv.URL+"/v1/shipments?x=1", "ship-42", body)
				want := Answer(http.MethodPost, "/v1/shipments", "ship-42", []byte(body), n)
				if n == 0 {
					want = []byte(`{"ok":true,"path":"/v1/shipments"}`) // today's answer
				}
				if resp.StatusCode != ok || string(got) != string(want) {
					t.Fatalf("status %d, body %q, want 200 and %q", resp.StatusCode, got, want)
				}
				if first != nil && string(got) != string(first) {
					t.Fatalf("the same request answered %q, then %q", first, got)
				}
				first = got
			}
			if n < 300 {
				return
			}
			if len(first) != n {
				t.Fatalf("answer of %d bytes, want %d", len(first), n)
			}
			var a answerBody
			if err := json.Unmarshal(first, &a); err != nil {
				t.Fatal(err)
			}
			sum := sha256.Sum256([]byte(body))
			if a.ID != "ship-42" || a.Method != "POST" || a.Path != "/v1/shipments" || a.RequestSHA256 != hex.EncodeToString(sum[:]) || a.Waybill != Waybill("ship-42") || strings.Trim(a.Pad, "x") != "" {
				t.Fatalf("answer %+v", a)
			}
		})
	}
}

// TestAnswerDiffers checks that Answer depends on each of its inputs.
func TestAnswerDiffers(t *testing.T) {
	base := string(Answer("POST", "/a", "k1", []byte("b"), 500))
	for name, other := range map[string][]byte{
		"method": Answer("PUT", "/a", "k1", []byte("b"), 500),
		"path":   Answer("POST", "/b", "k1", []byte("b"), 500),
		"key":    Answer("POST", "/a", "k2", []byte("b"), 500),
		"body":   Answer("POST", "/a", "k1", []byte("c"), 500),
	} {
		if string(other) == base {
			t.Errorf("Answer does not change with the %s", name)
		}
		if len(other) != 500 {
			t.Errorf("Answer with another %s is %d bytes, want 500", name, len(other))
		}
	}
	if w := Waybill("k1"); len(w) != 15 || !strings.HasPrefix(w, "WB-") || w == Waybill("k2") {
		t.Errorf("Waybill(k1) = %q, Waybill(k2) = %q", w, Waybill("k2"))
	}
}

// walk follows a list from its first page to its last and returns the
// ids in the order served and the number of pages.
func walk(t *testing.T, c *http.Client, style, first string) (ids []string, pages int) {
	t.Helper()
	url := first
	for pages = 1; ; pages++ {
		if pages > 100 {
			t.Fatalf("%s: more than 100 pages", style)
		}
		resp, b := send(t, c, http.MethodGet, url, "", "")
		if resp.StatusCode != ok {
			t.Fatalf("%s: GET %s: status %d: %s", style, url, resp.StatusCode, b)
		}
		var page struct {
			Items []struct{ ID string }
			Meta  *struct {
				NextCursor *string `json:"next_cursor"`
			}
			Links *struct{ Next *string }
		}
		if err := json.Unmarshal(b, &page); err != nil {
			t.Fatalf("%s: page %d: %v: %s", style, pages, err, b)
		}
		for _, it := range page.Items {
			ids = append(ids, it.ID)
		}
		link := resp.Header.Get("Link")
		var next string
		switch style {
		case "cursor":
			if page.Meta == nil || page.Links != nil || link != "" {
				t.Fatalf("cursor: page %d has meta %v, links %v, Link %q", pages, page.Meta, page.Links, link)
			}
			if page.Meta.NextCursor == nil {
				return ids, pages
			}
			next = first + "&cursor=" + *page.Meta.NextCursor
		case "link":
			if page.Meta != nil || page.Links != nil {
				t.Fatalf("link: page %d has a body cursor: %s", pages, b)
			}
			if link == "" {
				return ids, pages
			}
			u, opened := strings.CutPrefix(link, "<")
			u, closed := strings.CutSuffix(u, `>; rel="next"`)
			if !opened || !closed {
				t.Fatalf("link: Link %q", link)
			}
			next = u
		case "url":
			if page.Links == nil || page.Meta != nil || link != "" {
				t.Fatalf("url: page %d: %s, Link %q", pages, b, link)
			}
			if page.Links.Next == nil {
				return ids, pages
			}
			next = *page.Links.Next
		}
		if style != "cursor" && (!strings.HasPrefix(next, first[:strings.Index(first, "?")]+"?") || !strings.Contains(next, "limit=3")) {
			t.Fatalf("%s: next page %q is not the list's URL %q with its query", style, next, first)
		}
		url = next
	}
}

// TestPagingStyles walks a list of 7 pages of 3 items in each style: the
// walk sees every item once, in order, and ends at the last page.
func TestPagingStyles(t *testing.T) {
	const pages, items = 7, 3
	var want []string
	for i := 1; i <= pages*items; i++ {
		want = append(want, fmt.Sprintf("c-%d", i))
	}
	for _, style := range []string{"cursor", "link", "url"} {
		t.Run(style, func(t *testing.T) {
			v := &Mock{Rate: 1000, Window: sec, Paging: Paging{Pages: pages, Items: items, Style: style, Prefix: "/contacts"}}
			srv := httptest.NewServer(v)
			defer srv.Close()
			ids, n := walk(t, srv.Client(), style, srv.URL+"/contacts?limit=3")
			if n != pages || !reflect.DeepEqual(ids, want) {
				t.Fatalf("walked %d pages with ids %v, want %d pages with %v", n, ids, pages, want)
			}
			// Outside the prefix, and other methods, get today's answer.
			for _, r := range []struct{ method, path string }{{"GET", "/contactsx"}, {"GET", "/"}, {"POST", "/contacts"}} {
				if _, b := send(t, srv.Client(), r.method, srv.URL+r.path, "", ""); string(b) != fmt.Sprintf(`{"ok":true,"path":%q}`, r.path) {
					t.Errorf("%s %s answered %s", r.method, r.path, b)
				}
			}
			if s := v.Summarize(); s.Requests != pages+3 {
				t.Errorf("vendor saw %d requests, want %d", s.Requests, pages+3)
			}
		})
	}
}

// TestPagingEveryPath checks that with no Prefix every GET path is a list,
// and a subpath of the prefix is one too.
func TestPagingEveryPath(t *testing.T) {
	for _, tt := range []struct{ prefix, path string }{{"", "/anything"}, {"/", "/x/y"}, {"/contacts/", "/contacts/abc"}} {
		rec := httptest.NewRecorder()
		v := &Mock{Rate: 10, Window: sec, Paging: Paging{Pages: 2, Items: 1, Prefix: tt.prefix}}
		v.ServeHTTP(rec, httptest.NewRequest(http.MethodGet, tt.path, nil))
		if want := `{"items":[{"id":"c-1"}],"meta":{"next_cursor":"` + Cursor(2) + `"}}`; rec.Body.String() != want {
			t.Errorf("prefix %q, GET %s: %s, want %s", tt.prefix, tt.path, rec.Body, want)
		}
	}
}

// TestUnknownCursor checks that a cursor the list did not give out is
// answered 400 with a message saying so, and recorded as such.
func TestUnknownCursor(t *testing.T) {
	b64 := base64.RawURLEncoding.EncodeToString
	for _, tt := range []struct {
		style, query string
		status       int
	}{
		{"cursor", "cursor=" + Cursor(4), ok},
		{"cursor", "cursor=" + Cursor(1), ok},
		{"cursor", "cursor=nonsense", http.StatusBadRequest},
		{"cursor", "cursor=" + Cursor(0), http.StatusBadRequest},
		{"cursor", "cursor=" + Cursor(5), http.StatusBadRequest},
		{"cursor", "cursor=" + b64([]byte(cursorSalt+"02")), http.StatusBadRequest},
		{"cursor", "cursor=" + b64([]byte("other-salt:2")), http.StatusBadRequest},
		{"cursor", "cursor=" + Cursor(2) + "%3D", http.StatusBadRequest},
		{"link", "page_token=" + Cursor(3), ok},
		{"link", "page_token=x", http.StatusBadRequest},
		{"url", "page_token=" + Cursor(-1), http.StatusBadRequest},
		{"bogus", "", http.StatusInternalServerError},
	} {
		v := &Mock{Rate: 10, Window: sec, Paging: Paging{Pages: 4, Items: 2, Style: tt.style}}
		rec := httptest.NewRecorder()
		v.ServeHTTP(rec, httptest.NewRequest(http.MethodGet, "/c?"+tt.query, nil))
		if rec.Code != tt.status {
			t.Errorf("%s ?%s: status %d, want %d: %s", tt.style, tt.query, rec.Code, tt.status, rec.Body)
			continue
		}
		if got := v.Requests()[0].Status; got != tt.status {
			t.Errorf("%s ?%s: recorded %d, want %d", tt.style, tt.query, got, tt.status)
		}
		var e struct{ Error string }
		if tt.status == http.StatusBadRequest && (json.Unmarshal(rec.Body.Bytes(), &e) != nil || !strings.Contains(e.Error, "unknown cursor")) {
			t.Errorf("%s ?%s: body %s does not say the cursor is unknown", tt.style, tt.query, rec.Body)
		}
	}
}

// TestFailsEvery checks FailsEvery against FNV-1a values published for
// "a" (0xaf63dc4c8601ec8c) and "b" (0xaf63df4c8601f1a5) and computed for
// the others.
func TestFailsEvery(t *testing.T) {
	for _, tt := range []struct {
		key   string
		every int
		want  bool
	}{
		{"a", 2, true},
		{"b", 2, false},
		{"a", 1, true},
		{"a", 3, false},
		{"call-3", 3, true}, // 0x9582ba995d76bbcd
		{"call-2", 3, false},
		{"", 1, false},
		{"a", 0, false},
		{"a", -2, false},
	} {
		if got := FailsEvery(tt.key, tt.every); got != tt.want {
			t.Errorf("FailsEvery(%q, %d) = %t, want %t", tt.key, tt.every, got, tt.want)
		}
	}
}

// TestFailSelection checks that the vendor answers 422 to exactly the keys
// FailKeys and FailsEvery pick, every time they are sent, and that those
// answers count against the limit.
func TestFailSelection(t *testing.T) {
	listed := map[string]bool{"k-1": true, "k-150": true}
	v := &Mock{Rate: 1000, Window: sec, FailKeys: listed, FailEvery: 7, AnswerBytes: 400}
	var failed int
	for round := range 2 {
		for i := range 300 {
			key := "k-" + strconv.Itoa(i)
			rec := httptest.NewRecorder()
			req := httptest.NewRequest(http.MethodPost, "/v1/x", strings.NewReader("{}"))
			req.Header.Set("Idempotency-Key", key)
			v.ServeHTTP(rec, req)
			want := listed[key] || FailsEvery(key, 7)
			if got := rec.Code == http.StatusUnprocessableEntity; got != want {
				t.Fatalf("round %d, %s: status %d, want 422 %t", round, key, rec.Code, want)
			}
			if want {
				failed++
				if b := fmt.Sprintf(`{"error":"validation failed","id":%q}`, key); rec.Body.String() != b {
					t.Fatalf("%s: body %s, want %s", key, rec.Body, b)
				}
			}
		}
	}
	// One key in 7 of 300, and two listed: far from none and from all.
	if failed < 2*20 || failed > 2*80 {
		t.Fatalf("%d of 600 requests failed, want about 2*45", failed)
	}
	if s := v.Summarize(); s.Failed != failed {
		t.Fatalf("summary counts %d 422s, want %d", s.Failed, failed)
	}
	// Without a key nothing fails.
	rec := httptest.NewRecorder()
	(&Mock{Rate: 1, Window: sec, FailEvery: 1}).ServeHTTP(rec, httptest.NewRequest(http.MethodGet, "/x", nil))
	if rec.Code != ok {
		t.Fatalf("a request without a key answered %d with FailEvery 1", rec.Code)
	}

	// At 2 per window, a 422 uses one of the two.
	for _, kind := range []string{"fixed", "sliding", "gcra"} {
		v := &Mock{Kind: kind, Rate: 2, Window: sec, Burst: 2, FailKeys: map[string]bool{"bad": true}}
		var got []int
		for _, key := range []string{"bad", "good-1", "good-2"} {
			clk := &fakeClock{t: base}
			v.now = clk.Now
			rec := httptest.NewRecorder()
			req := httptest.NewRequest(http.MethodPost, "/x", nil)
			req.Header.Set("Idempotency-Key", key)
			v.ServeHTTP(rec, req)
			got = append(got, rec.Code)
		}
		if want := []int{http.StatusUnprocessableEntity, ok, limited}; !reflect.DeepEqual(got, want) {
			t.Errorf("%s: answers %v, want %v", kind, got, want)
		}
	}
}

// TestSummaryKeys checks the key counts of Summarize: distinct keys over
// every answer, keys sent more than once and the first of them, 422s.
func TestSummaryKeys(t *testing.T) {
	clk := &fakeClock{t: base}
	v := &Mock{Rate: 4, Window: sec, FailKeys: map[string]bool{"c": true}, now: clk.Now}
	// Four per window: "b" again and "a" a third time are answered 429.
	for _, key := range []string{"a", "b", "a", "c", "b", "a", "", "", "d"} {
		req := httptest.NewRequest(http.MethodPost, "/x", nil)
		req.Header.Set("Idempotency-Key", key)
		v.ServeHTTP(httptest.NewRecorder(), req)
	}
	s := v.Summarize()
	want := Summary{Requests: 9, RateLimited: 5, MaxPerWindow: 9, MaxSliding: 9, DistinctKeys: 2, DuplicateKeys: 1,
		KeysSeen: 4, KeysRepeated: 2, RepeatedFirst: []string{"a", "b"}, Failed: 1}
	if !reflect.DeepEqual(s, want) {
		t.Fatalf("summary\n%+v, want\n%+v", s, want)
	}

	// Only the first five repeated keys are listed; all are counted.
	v = &Mock{Rate: 100, Window: sec}
	for range 2 {
		for i := range 8 {
			req := httptest.NewRequest(http.MethodPost, "/x", nil)
			req.Header.Set("Idempotency-Key", "k"+strconv.Itoa(i))
			v.ServeHTTP(httptest.NewRecorder(), req)
		}
	}
	if s := v.Summarize(); s.KeysSeen != 8 || s.KeysRepeated != 8 || !reflect.DeepEqual(s.RepeatedFirst, []string{"k0", "k1", "k2", "k3", "k4"}) || s.DuplicateKeys != 8 {
		t.Fatalf("summary %+v", s)
	}
}
