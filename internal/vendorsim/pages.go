package vendorsim

import (
	"encoding/base64"
	"encoding/json"
	"errors"
	"fmt"
	"net/http"
	"net/url"
	"strconv"
	"strings"
)

// Paging makes a Mock serve a list, one page per GET request under
// Prefix. The list has Pages pages of Items items; page k (from 1) holds
// the items {"id":"c-N"} for N from (k-1)*Items+1 to k*Items. A request
// names its page by an opaque cursor (Cursor) in a query parameter; with
// none it gets page 1. Each page but the last names the next one, by
// Style:
//   - "cursor" (the default, also ""): the body is
//     {"items":[...],"meta":{"next_cursor":CURSOR}}, null on the last page,
//     and the request sends the cursor as ?cursor=;
//   - "link": the body is {"items":[...]} and the answer carries
//     Link: <URL>; rel="next", no Link on the last page;
//   - "url": the body is {"items":[...],"links":{"next":URL}}, null on the
//     last page.
//
// URL is absolute, built from the request's Host (https when it came over
// TLS) and path, its query with page_token set to the next cursor: it
// stays under the vendor's base URL. A cursor the list did not give out
// is answered 400. Other query parameters are kept in URL and otherwise
// ignored; requests that are not GET, or not under Prefix, are answered
// as without Paging.
type Paging struct {
	Pages int // pages in the list; 0 turns paging off
	Items int // items on each page
	// Style is "cursor" (default, also ""), "link" or "url". Any other
	// value answers paged requests with 500.
	Style string
	// Prefix is the path served: that path and those under it ("/contacts"
	// serves /contacts and /contacts/x, not /contactsx). "" or "/" serves
	// every path.
	Prefix string
}

// cursorSalt is the fixed text a cursor encodes beside its page number.
const cursorSalt = "vendorsim-page:"

// Cursor is the opaque cursor naming page k of a list: base64url,
// unpadded, of "vendorsim-page:" and k. A Mock with Paging accepts the
// cursors of its pages 1 to Pages and no other string.
func Cursor(k int) string {
	return base64.RawURLEncoding.EncodeToString([]byte(cursorSalt + strconv.Itoa(k)))
}

// errPagingStyle is the error of a Paging with an unknown Style.
var errPagingStyle = errors.New("vendorsim: unknown Paging.Style: set it to \"cursor\", \"link\" or \"url\"")

// serves reports whether r is a request for a page.
func (p *Paging) serves(r *http.Request) bool {
	if p.Pages < 1 || r.Method != http.MethodGet {
		return false
	}
	prefix := strings.TrimSuffix(p.Prefix, "/")
	return prefix == "" || r.URL.Path == prefix || strings.HasPrefix(r.URL.Path, prefix+"/")
}

// param is the query parameter carrying the cursor.
func (p *Paging) param() (string, error) {
	switch p.Style {
	case "", "cursor":
		return "cursor", nil
	case "link", "url":
		return "page_token", nil
	}
	return "", errPagingStyle
}

// page is the page r asks for, from 1, or an error for an unknown cursor
// or Style.
func (p *Paging) page(r *http.Request) (int, error) {
	param, err := p.param()
	if err != nil {
		return 0, err
	}
	c := r.URL.Query().Get(param)
	if c == "" {
		return 1, nil
	}
	b, err := base64.RawURLEncoding.DecodeString(c)
	if err == nil {
		if n, ok := strings.CutPrefix(string(b), cursorSalt); ok {
			if k, err := strconv.Atoi(n); err == nil && strconv.Itoa(k) == n && k >= 1 && k <= p.Pages {
				return k, nil
			}
		}
	}
	return 0, fmt.Errorf("vendorsim: unknown cursor %q in %s: send no %s for the first page, then the one the previous page named", c, param, param)
}

// status is the status of an admitted page request: 400 for an unknown
// cursor, 500 for an unknown Style, else 0 (decided elsewhere).
func (p *Paging) status(r *http.Request) int {
	if _, err := p.page(r); errors.Is(err, errPagingStyle) {
		return http.StatusInternalServerError
	} else if err != nil {
		return http.StatusBadRequest
	}
	return 0
}

// item is one item of a page.
type item struct {
	ID string `json:"id"`
}

// write answers a page request with status, or with the error of an
// unknown cursor or Style.
func (p *Paging) write(w http.ResponseWriter, r *http.Request, status int) {
	k, err := p.page(r)
	if err != nil {
		writeJSON(w, p.status(r), errorBody(err.Error()))
		return
	}
	items := make([]item, p.Items)
	for i := range items {
		items[i].ID = "c-" + strconv.Itoa((k-1)*p.Items+i+1)
	}
	var next *string // the next page's cursor or URL; nil on the last page
	if k < p.Pages {
		c := Cursor(k + 1)
		if p.Style == "link" || p.Style == "url" {
			c = nextURL(r, c)
		}
		next = &c
	}
	var body any
	switch p.Style {
	case "", "cursor":
		type meta struct {
			NextCursor *string `json:"next_cursor"`
		}
		body = struct {
			Items []item `json:"items"`
			Meta  meta   `json:"meta"`
		}{items, meta{next}}
	case "link":
		if next != nil {
			w.Header().Set("Link", "<"+*next+`>; rel="next"`)
		}
		body = struct {
			Items []item `json:"items"`
		}{items}
	case "url":
		type links struct {
			Next *string `json:"next"`
		}
		body = struct {
			Items []item `json:"items"`
			Links links  `json:"links"`
		}{items, links{next}}
	}
	b, _ := json.Marshal(body) // strings only: cannot fail
	writeJSON(w, status, b)
}

// nextURL is the absolute URL of r with page_token set to cursor.
func nextURL(r *http.Request, cursor string) string {
	q := r.URL.Query()
	q.Set("page_token", cursor)
	u := url.URL{Scheme: "http", Host: r.Host, Path: r.URL.Path, RawPath: r.URL.RawPath, RawQuery: q.Encode()}
	if r.TLS != nil {
		u.Scheme = "https"
	}
	return u.String()
}
