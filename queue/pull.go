package queue

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"maps"
	"net/url"
	"strconv"
	"strings"

	"github.com/hibiken/asynq"
	"github.com/redis/go-redis/v9"

	"github.com/shaper-dev/shaper/vendorclients"
)

// DefaultMaxPages bounds a pull whose call sets no max_pages, and
// maxPages any pull: a page's place in its export is its first call's
// place times pageRoom plus the page (see exportSeq).
const (
	DefaultMaxPages = 10_000
	pageRoom        = 1 << 20
	maxPages        = pageRoom - 1
)

// Next says how a paginated call finds its next page, in one of three
// ways:
//
//	{"link": "next"}                                  a Link header's rel (RFC 8288)
//	{"cursor": "/meta/next_cursor", "param": "cursor"} a JSON pointer to a cursor in the body, and the query parameter to send it in
//	{"url": "/links/next"}                            a JSON pointer to the next page's URL in the body
//
// A next URL (from a Link header or the body) must stay under the
// vendor's base_url. A pull ends at the page whose answer names no next
// page (absent, null or ""); a URL outside base_url, a cursor seen
// before in the pull, or a page past max_pages end it with an error in
// that page's result (CallResult.NextError).
type Next struct {
	Link   string `json:"link,omitempty"`
	Cursor string `json:"cursor,omitempty"`
	Param  string `json:"param,omitempty"`
	URL    string `json:"url,omitempty"`
}

// PullPage is where a page of a pull stands: its first call's id (the
// root of the pages' ids), its page number (the first call is page 1),
// and the cursor it was asked with (to refuse a cursor seen before).
type PullPage struct {
	Root   string `json:"root"`
	Page   int    `json:"page"`
	Cursor string `json:"cursor,omitempty"`
}

// checkNext validates the call's pagination.
func (c *Call) checkNext() error {
	if c.Next == nil {
		if c.MaxPages != 0 {
			return fmt.Errorf("%w: max_pages %d without \"next\": only a paginated call has pages", ErrBadCall, c.MaxPages)
		}
		return nil
	}
	n := c.Next
	ways := 0
	for _, set := range []bool{n.Link != "", n.Cursor != "", n.URL != ""} {
		if set {
			ways++
		}
	}
	if ways != 1 {
		return fmt.Errorf(`%w: "next": give one of {"link":"next"}, {"cursor":"/json/pointer","param":"cursor"} or {"url":"/json/pointer"}`, ErrBadCall)
	}
	switch {
	case n.Link != "" && n.Param != "":
		return fmt.Errorf(`%w: "next": "param" goes with "cursor", not "link"`, ErrBadCall)
	case n.URL != "" && n.Param != "":
		return fmt.Errorf(`%w: "next": "param" goes with "cursor", not "url"`, ErrBadCall)
	case n.Cursor != "" && n.Param == "":
		return fmt.Errorf(`%w: "next": a cursor needs "param", the query parameter to send it in, e.g. {"cursor":%q,"param":"cursor"}`, ErrBadCall, n.Cursor)
	case n.Cursor != "" && !validPointer(n.Cursor):
		return fmt.Errorf(`%w: "next": cursor %q is not a JSON pointer (RFC 6901): it starts with "/", e.g. "/meta/next_cursor"`, ErrBadCall, n.Cursor)
	case n.URL != "" && !validPointer(n.URL):
		return fmt.Errorf(`%w: "next": url %q is not a JSON pointer (RFC 6901): it starts with "/", e.g. "/links/next"`, ErrBadCall, n.URL)
	case n.Param != "" && strings.ContainsAny(n.Param, "&=#? "):
		return fmt.Errorf(`%w: "next": param %q is not a query parameter name`, ErrBadCall, n.Param)
	case n.Link != "" && strings.ContainsAny(n.Link, "\"; ,"):
		return fmt.Errorf(`%w: "next": link %q is not a link relation (such as "next")`, ErrBadCall, n.Link)
	case c.MaxPages < 0 || c.MaxPages > maxPages:
		return fmt.Errorf("%w: max_pages %d: want 1 to %d (default %d)", ErrBadCall, c.MaxPages, maxPages, DefaultMaxPages)
	}
	return nil
}

// validPointer reports whether p is a JSON pointer to a member (not the
// whole document).
func validPointer(p string) bool { return strings.HasPrefix(p, "/") }

// pullBodyMax bounds the body a pull reads for its next page's cursor or
// URL (whatever max_answer keeps).
const pullBodyMax = MaxMaxAnswer

// pullNeed is how much of the answer's body call's pull reads.
func pullNeed(call Call) int64 {
	if call.Next != nil && (call.Next.Cursor != "" || call.Next.URL != "") {
		return pullBodyMax
	}
	return 0
}

// pageID is the task id of page n of the pull whose first call is root.
func pageID(root string, n int) string { return root + ":p" + strconv.Itoa(n) }

// nextPage queues the page after call's (answered res, 2xx) when the
// answer names one: a call of its own, with a deterministic id (its
// first call's id and its page number), in the step that ends this one
// (before its end is recorded): a retry of this page queues the same
// page, which is queued once. The next page joins the export after this
// one. A pull that cannot go on (a next URL outside base_url, a cursor
// seen before, max_pages reached) ends here, with the reason in
// res.NextError. It returns an error only when Redis failed: the call is
// then retried.
func (w *Worker) nextPage(ctx context.Context, rt *vendorRuntime, t *asynq.Task, id string, call Call, res *CallResult) error {
	page := PullPage{Root: id, Page: 1}
	if call.Pull != nil {
		page = *call.Pull
	}
	res.Page = page.Page
	path, key, err := nextPath(rt, call, res)
	if err != nil {
		res.NextError = err.Error()
		return nil
	}
	if path == "" {
		return nil // the last page
	}
	limit := call.MaxPages
	if limit == 0 {
		limit = DefaultMaxPages
	}
	if page.Page >= limit {
		res.NextError = fmt.Sprintf("the pull reached max_pages (%d) and a next page exists: raise max_pages to read further", limit)
		return nil
	}
	next := PullPage{Root: page.Root, Page: page.Page + 1, Cursor: key}
	nextID := pageID(page.Root, next.Page)
	if !idRe.MatchString(nextID) {
		res.NextError = fmt.Sprintf("page %d's id %q would be longer than 200 characters: give the pull's first call a shorter id", next.Page, nextID)
		return nil
	}
	seen, err := w.cursorSeen(ctx, rt.vendor.Name, page.Root, key, next.Page)
	if err != nil {
		return err
	}
	if seen > 0 {
		res.NextError = fmt.Sprintf("the answer's next page (%s) is page %d's again: the pull stops rather than loop", safePath(path), seen)
		return nil
	}
	nc := call
	nc.ID, nc.Path, nc.Pull = nextID, path, &next
	payload, err := json.Marshal(nc)
	if err != nil {
		return fmt.Errorf("queue: page %d of pull %s: %w", next.Page, page.Root, err)
	}
	if call.Export != "" {
		ttl := w.cfg.Retention + exportGrace
		order := exportCallsKey(w.cfg.KeyPrefix, call.Export)
		pipe := w.rdb.Pipeline()
		pipe.ZAddNX(ctx, order, redis.Z{Score: float64(call.Seq + int64(next.Page-1)), Member: nextID})
		pipe.Expire(ctx, order, ttl)
		if _, err := pipe.Exec(ctx); err != nil {
			return fmt.Errorf("queue: record page %d of pull %s in export %s: %w", next.Page, page.Root, call.Export, err)
		}
	}
	headers := maps.Clone(t.Headers())
	delete(headers, enqueuedHeader)
	q, _ := asynq.GetQueueName(ctx)
	maxRetry, _ := asynq.GetMaxRetry(ctx)
	task := traced(ctx, asynq.NewTaskWithHeaders(TypeCall, payload, headers), &w.stamps)
	_, err = w.aq.EnqueueContext(ctx, task, asynq.Queue(q), asynq.TaskID(nextID), asynq.MaxRetry(maxRetry), asynq.Retention(w.cfg.Retention))
	if err != nil && !errors.Is(err, asynq.ErrTaskIDConflict) { // a conflict: queued by an earlier run of this page
		return fmt.Errorf("queue: queue page %d of pull %s: %w", next.Page, page.Root, err)
	}
	return nil
}

// cursorScript records the cursor (or URL) a page of a pull is asked
// with, and says whether another page was asked with it before.
//
// KEYS[1] the pull's hash of cursors (cursor -> page); ARGV[1] the
// cursor, ARGV[2] the page, ARGV[3] the hash's time to live (ms).
// Returns the page that had the cursor before, or 0.
var cursorScript = redis.NewScript(`
local k_cursors = KEYS[1]
local a_cursor = ARGV[1]
local a_page = ARGV[2]
local a_ttl = tonumber(ARGV[3])
local had = redis.call('HGET', k_cursors, a_cursor)
if had and had ~= a_page then return tonumber(had) end
redis.call('HSET', k_cursors, a_cursor, a_page)
redis.call('PEXPIRE', k_cursors, a_ttl)
return 0
`)

// cursorSeen records that page n of the pull root is asked with key, and
// returns the earlier page asked with it, or 0.
func (w *Worker) cursorSeen(ctx context.Context, vendor, root, key string, n int) (int, error) {
	ttl := w.cfg.Retention + exportGrace
	seen, err := cursorScript.Run(ctx, w.rdb, []string{pullCursorsKey(w.cfg.KeyPrefix, vendor, root)}, key, n, ttl.Milliseconds()).Int()
	if err != nil {
		return 0, fmt.Errorf("queue: record pull %s's cursor: %w", root, err)
	}
	return seen, nil
}

// nextPath is the path of the page after call's, from its answer, and
// the key that names it in the pull (its cursor, or its URL); "" when
// the answer names none.
func nextPath(rt *vendorRuntime, call Call, res *CallResult) (path, key string, err error) {
	n := call.Next
	if n == nil {
		return "", "", nil
	}
	base, err := vendorclients.AccountBaseURL(rt.vendor.BaseURL, call.Account)
	if err != nil {
		return "", "", err
	}
	current, err := url.Parse(strings.TrimSuffix(base, "/") + call.Path)
	if err != nil {
		return "", "", fmt.Errorf("the page's URL: %w", err)
	}
	switch {
	case n.Link != "":
		target := linkTarget(res.header.Values("Link"), n.Link)
		if target == "" {
			return "", "", nil
		}
		path, err := underBase(base, current, target)
		return path, path, err
	case n.URL != "":
		v, ok, err := pointerValue(res, n.URL)
		if err != nil || !ok {
			return "", "", err
		}
		path, err := underBase(base, current, v)
		return path, path, err
	default:
		v, ok, err := pointerValue(res, n.Cursor)
		if err != nil || !ok {
			return "", "", err
		}
		p, err := url.Parse(call.Path)
		if err != nil {
			return "", "", err
		}
		q := p.Query()
		q.Set(n.Param, v)
		p.RawQuery = q.Encode()
		return p.String(), v, nil
	}
}

// pointerValue reads the string (or number) at JSON pointer ptr in the
// answer's body; ok is false where the body has none there (null, "",
// absent): the last page.
func pointerValue(res *CallResult, ptr string) (v string, ok bool, err error) {
	if res.raw == nil {
		return "", false, fmt.Errorf("the answer's body is over %d bytes: its next page cannot be read", pullBodyMax)
	}
	var doc any
	if err := json.Unmarshal(res.raw, &doc); err != nil {
		return "", false, fmt.Errorf("the answer's body is not JSON (%v): its next page at %s cannot be read", err, ptr)
	}
	for _, tok := range strings.Split(ptr[1:], "/") {
		tok = strings.ReplaceAll(strings.ReplaceAll(tok, "~1", "/"), "~0", "~")
		switch d := doc.(type) {
		case map[string]any:
			doc = d[tok]
		case []any:
			i, err := strconv.Atoi(tok)
			if err != nil || i < 0 || i >= len(d) {
				return "", false, nil
			}
			doc = d[i]
		default:
			return "", false, nil
		}
	}
	switch d := doc.(type) {
	case nil:
		return "", false, nil
	case string:
		return d, d != "", nil
	case float64:
		return strconv.FormatFloat(d, 'f', -1, 64), true, nil
	}
	return "", false, fmt.Errorf("the answer's %s is a %T, not a cursor or URL", ptr, doc)
}

// linkTarget returns the target of the first link of Link header values
// whose rel names rel (RFC 8288), or "".
func linkTarget(values []string, rel string) string {
	for _, v := range values {
		for len(v) > 0 {
			v = strings.TrimLeft(v, " ,")
			if !strings.HasPrefix(v, "<") {
				return ""
			}
			end := strings.IndexByte(v, '>')
			if end < 0 {
				return ""
			}
			target, params := v[1:end], v[end+1:]
			// The link's parameters run to the next comma outside quotes.
			i, quoted := 0, false
			for ; i < len(params); i++ {
				if params[i] == '"' {
					quoted = !quoted
				} else if params[i] == ',' && !quoted {
					break
				}
			}
			v = params[i:]
			for p := range strings.SplitSeq(params[:i], ";") {
				name, val, _ := strings.Cut(strings.TrimSpace(p), "=")
				if !strings.EqualFold(strings.TrimSpace(name), "rel") {
					continue
				}
				for r := range strings.FieldsSeq(strings.Trim(strings.TrimSpace(val), `"`)) {
					if strings.EqualFold(r, rel) {
						return target
					}
				}
			}
		}
	}
	return ""
}

// underBase resolves target against the current page's URL and returns
// its path on base (the vendor's base_url); an error when it leaves it.
func underBase(base string, current *url.URL, target string) (string, error) {
	t, err := current.Parse(target)
	if err != nil {
		return "", fmt.Errorf("the next page's URL %q: %w", safeURL(target), err)
	}
	b, err := url.Parse(strings.TrimSuffix(base, "/") + "/")
	if err != nil {
		return "", err
	}
	if t.Scheme != b.Scheme || t.Host != b.Host || t.User != nil || !strings.HasPrefix(t.EscapedPath()+"/", b.EscapedPath()) {
		return "", fmt.Errorf("the next page's URL %s is not under the vendor's base_url %s: the pull stops there", safeURL(t.String()), safeURL(base))
	}
	path := strings.TrimPrefix(t.EscapedPath(), strings.TrimSuffix(b.EscapedPath(), "/"))
	if path == "" {
		path = "/"
	}
	if t.RawQuery != "" {
		path += "?" + t.RawQuery
	}
	if err := vendorclients.CheckPath(path); err != nil {
		return "", fmt.Errorf("the next page's URL %s: %w", safeURL(t.String()), err)
	}
	return path, nil
}
