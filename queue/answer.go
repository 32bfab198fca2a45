package queue

import (
	"encoding/base64"
	"encoding/json"
	"io"
	"net/http"
	"strings"
	"time"
	"unicode/utf8"
)

// Answer bounds (Vendor.MaxAnswer).
const (
	// DefaultMaxAnswer is how much of an answer's body a call keeps when
	// its vendor says nothing: 1 MiB.
	DefaultMaxAnswer = 1 << 20
	// MaxMaxAnswer is the most a vendor may ask to keep: 16 MiB. Every
	// call a worker holds may hold this much while it stores its answer.
	MaxMaxAnswer = 16 << 20
	// NoAnswerBody keeps no body (max_answer = 0): the status and the
	// kept headers only.
	NoAnswerBody = -1
	// answerDrain is how much of a cut body is read past the bound and
	// dropped, so that the connection can be used again.
	answerDrain = 1 << 20
	// excerptBytes bounds the body excerpt a callback's outcome and
	// explain show.
	excerptBytes = 512
)

// CallResult is a call's answer, stored as its task's result (asynq's
// "result" field of the task hash) for the retention: the status, the
// headers its vendor keeps (keep_headers), and the body up to the
// vendor's max_answer, with every secret redacted (see redact.go). A
// JSON body is kept as JSON (Body); another is kept as text (Text), or as
// base64 when it is not UTF-8 (Base64). A body longer than max_answer is
// cut there and marked Cut; Bytes is how many bytes the vendor sent (at
// least that many when Cut).
type CallResult struct {
	Status  int               `json:"status"`
	Headers map[string]string `json:"headers,omitempty"`
	Body    json.RawMessage   `json:"body,omitempty"`
	Text    string            `json:"text,omitempty"`
	Base64  string            `json:"body_base64,omitempty"`
	Cut     bool              `json:"cut,omitempty"`
	Bytes   int64             `json:"bytes"`
	// Page is the page of a paginated pull the answer is (1 for its first
	// call; 0 for a call that is not a pull), and NextError why the pull
	// ended at this page without reaching its last (see pull.go).
	Page      int    `json:"page,omitempty"`
	NextError string `json:"next_error,omitempty"`
	// Excerpt is the first 512 bytes of the body, as shaper kept it
	// before answers were kept whole: read from older results only.
	Excerpt string `json:"body_excerpt,omitempty"`
	// SentAt is when the request went out (its headers written, after its
	// tick), for a callback; not stored.
	SentAt time.Time `json:"-"`

	// raw is the body as read (up to answerKeep.need), and header the
	// answer's headers: a pull finds its next page in them. Not stored.
	raw    []byte
	header http.Header
}

// BodyExcerpt is the start of the kept body, at most n bytes cut back
// to a rune boundary (callbacks and explain show it).
func (r CallResult) BodyExcerpt(n int) string {
	s := r.Excerpt
	switch {
	case len(r.Body) > 0:
		s = string(r.Body)
	case r.Text != "":
		s = r.Text
	case r.Base64 != "":
		s = "[base64] " + r.Base64
	}
	if len(s) <= n {
		return s
	}
	s = s[:n]
	for len(s) > 0 && !utf8.ValidString(s) {
		s = s[:len(s)-1]
	}
	return s
}

// answerKeep is what a vendor keeps of its calls' answers.
type answerKeep struct {
	max     int64    // body bytes; NoAnswerBody for none
	need    int64    // body bytes a pull reads (its next page's cursor or URL)
	headers []string // canonical header names
	secrets []string
}

// answerKeepOf is v's answerKeep, for a call with secrets of its own.
func answerKeepOf(v *Vendor, secrets []string) answerKeep {
	k := answerKeep{max: v.MaxAnswer, secrets: secrets}
	if k.max == 0 {
		k.max = DefaultMaxAnswer
	}
	for _, h := range v.KeepHeaders {
		k.headers = append(k.headers, http.CanonicalHeaderKey(h))
	}
	return k
}

// readAnswer reads resp's body into a CallResult as k says, and drains
// what it does not keep (up to answerDrain) so the connection can serve
// another call. It does not close the body.
func readAnswer(resp *http.Response, k answerKeep) CallResult {
	res := CallResult{Status: resp.StatusCode, header: resp.Header}
	for _, name := range k.headers {
		if vs := resp.Header.Values(name); len(vs) > 0 {
			if res.Headers == nil {
				res.Headers = map[string]string{}
			}
			res.Headers[name] = string(redact([]byte(strings.Join(vs, ", ")), k.secrets))
		}
	}
	longest := 0
	for _, s := range k.secrets {
		longest = max(longest, len(s))
	}
	// Read the bound, the longest secret past it (so that a secret
	// across the cut is redacted whole) and one byte more (to know it is
	// cut); or what a pull needs, when more.
	b, _ := io.ReadAll(io.LimitReader(resp.Body, max(k.max+int64(longest)+1, k.need+1)))
	res.Bytes = int64(len(b))
	if k.need > 0 && int64(len(b)) <= k.need {
		res.raw = b
	}
	if int64(len(b)) > max(k.max, k.need) {
		n, _ := io.Copy(io.Discard, io.LimitReader(resp.Body, answerDrain))
		res.Bytes += n
	}
	if k.max == NoAnswerBody {
		return res
	}
	res.Cut = int64(len(b)) > k.max
	kept := excerpt(b, int(min(k.max, int64(len(b)))), k.secrets)
	switch {
	case !res.Cut && len(kept) > 0 && json.Valid(kept):
		res.Body = kept
	case utf8.Valid(kept):
		res.Text = string(kept)
	default:
		res.Base64 = base64.StdEncoding.EncodeToString(kept)
	}
	return res
}
