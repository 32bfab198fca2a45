package queue

// What a call leaves behind (its stored error and result, a callback's
// outcome, the worker's log) holds no secret (G9): no query string, no
// user info, and no header or query value the vendor echoes, not even in
// part where the stored excerpt is cut.

import (
	"bytes"
	"errors"
	"io"
	"net/http"
	"net/http/httptrace"
	"net/url"
	"slices"
	"strconv"
	"strings"
	"sync"
	"time"
	"unicode/utf8"
)

// redactedMark replaces a secret.
const redactedMark = "[redacted]"

// minSecret is the shortest value treated as a secret: shorter ones
// (a page number, "asc") would blank out ordinary text.
const minSecret = 4

// safePath is a call's path as errors and logs show it: its query, which
// may hold a key, replaced by "?…".
func safePath(p string) string {
	if i := strings.IndexByte(p, '?'); i >= 0 {
		return p[:i] + "?…"
	}
	return p
}

// safeURL is raw as errors and logs show it: no user info, its query
// replaced by "?…", no fragment.
func safeURL(raw string) string {
	u, err := url.Parse(raw)
	if err != nil {
		// Unparsable: keep what comes before anything that may be secret.
		if i := strings.IndexAny(raw, "?#@"); i >= 0 {
			return raw[:i] + "…"
		}
		return raw
	}
	u.User, u.Fragment, u.RawFragment = nil, "", ""
	q := u.RawQuery != "" || u.ForceQuery
	u.RawQuery, u.ForceQuery = "", false
	if q {
		return u.String() + "?…"
	}
	return u.String()
}

// safeError returns err with the URL of any *url.Error in its chain (an
// http.Client's error names the whole URL, query and user info included)
// stripped by safeURL, in the error itself and in err's message; errors.Is
// and errors.As still see err's chain.
func safeError(err error) error {
	var ue *url.Error
	if !errors.As(err, &ue) {
		return err
	}
	raw := ue.URL
	safe := safeURL(raw)
	if safe == raw {
		return err
	}
	msg := err.Error()
	ue.URL = safe
	msg = strings.ReplaceAll(msg, strconv.Quote(raw), strconv.Quote(safe))
	msg = strings.ReplaceAll(msg, raw, safe)
	return messageError{msg, err}
}

// messageError is err with another message.
type messageError struct {
	msg string
	err error
}

func (e messageError) Error() string { return e.msg }
func (e messageError) Unwrap() error { return e.err }

// querySecrets returns the values of the query of a path or URL that
// must not reach a stored answer: each value of minSecret bytes or
// more, as sent (escaped) and decoded.
func querySecrets(p string) []string {
	_, rawQuery, ok := strings.Cut(p, "?")
	if !ok {
		return nil
	}
	rawQuery, _, _ = strings.Cut(rawQuery, "#")
	var out []string
	for _, kv := range strings.Split(rawQuery, "&") {
		_, v, _ := strings.Cut(kv, "=")
		if len(v) >= minSecret {
			out = append(out, v)
		}
		if d, err := url.QueryUnescape(v); err == nil && d != v && len(d) >= minSecret {
			out = append(out, d)
		}
	}
	return out
}

// readExcerpt reads the start of an answer for storing: at most n bytes
// with every secret replaced (excerpt). It reads the longest secret's
// length beyond n, so that a secret that starts before the cut is seen
// whole and replaced, never stored in part.
func readExcerpt(r io.Reader, n int, secrets []string) []byte {
	longest := 0
	for _, s := range secrets {
		longest = max(longest, len(s))
	}
	b, _ := io.ReadAll(io.LimitReader(r, int64(n+longest)))
	return excerpt(b, n, secrets)
}

// excerpt returns the first n bytes of b, cut back to a rune boundary,
// with each secret that starts in them replaced whole by [redacted],
// also one that runs past the cut; and where b ends inside a secret (the
// answer itself ended there), that part of it too. b must extend the
// longest secret's length beyond n, where the answer does.
func excerpt(b []byte, n int, secrets []string) []byte {
	type span struct{ from, to int }
	var spans []span
	for _, s := range secrets {
		if len(s) < minSecret {
			continue
		}
		for i := 0; i < len(b); {
			j := bytes.Index(b[i:], []byte(s))
			if j < 0 {
				break
			}
			spans = append(spans, span{i + j, i + j + len(s)})
			i += j + 1
		}
		for k := min(len(s)-1, len(b)); k >= minSecret; k-- {
			if bytes.HasSuffix(b, []byte(s[:k])) {
				spans = append(spans, span{len(b) - k, len(b)})
				break
			}
		}
	}
	cut := len(b)
	if cut > n {
		cut = n
		for cut > 0 && !utf8.RuneStart(b[cut]) {
			cut--
		}
	}
	slices.SortFunc(spans, func(a, b span) int { return a.from - b.from })
	out := make([]byte, 0, cut)
	i := 0 // b[:i] is written
	for _, sp := range spans {
		if sp.from >= cut {
			break
		}
		if sp.from >= i {
			out = append(out, b[i:sp.from]...)
			out = append(out, redactedMark...)
		}
		i = max(i, sp.to)
	}
	if i < cut {
		out = append(out, b[i:cut]...)
	}
	return out
}

// traceSent returns req with a trace that records when it went out: when
// the transport wrote its headers, which is after the gate granted its
// tick. sent reports that time; for a transport that reports nothing, the
// time sent is first called (after the answer came).
func traceSent(req *http.Request) (_ *http.Request, sent func() time.Time) {
	var mu sync.Mutex
	var at time.Time
	tr := &httptrace.ClientTrace{WroteHeaders: func() {
		mu.Lock()
		at = time.Now() // a request retried on a new connection: the last
		mu.Unlock()
	}}
	req = req.WithContext(httptrace.WithClientTrace(req.Context(), tr))
	return req, func() time.Time {
		mu.Lock()
		defer mu.Unlock()
		if at.IsZero() {
			at = time.Now()
		}
		return at
	}
}
