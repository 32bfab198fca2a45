// Package api is shaper's HTTP API, for services in any language: POST
// calls to queue them (one JSON call, or NDJSON of many), GET one to
// follow it, optionally holding the request until it ends, DELETE one
// that has not started; POST an export (NDJSON calls whose answers are
// kept), follow its progress, stream its answers back in its order,
// retry its failed calls or cancel the rest. It calls queue.Client and
// adds nothing to the gate. Its OpenAPI document (openapi.json, served
// at /v1/openapi.json) describes every route; TestOpenAPI checks it
// against the handlers.
//
// Every answer is JSON but an export's results (NDJSON, one line per
// call). A refusal says what to fix (Refusal): {"error": "..."}, with
// "lines" for the calls of a body that are wrong (nothing of such a
// body is queued).
package api

import (
	"bytes"
	"context"
	"crypto/subtle"
	_ "embed"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"math"
	"mime"
	"net"
	"net/http"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/shaper-dev/shaper/internal/httpguard"
	"github.com/shaper-dev/shaper/queue"
)

// Defaults of Options.
const (
	DefaultMaxBody    = 8 << 20
	DefaultMaxWait    = time.Minute
	DefaultMaxWaiting = 1000
	defaultPoll       = 20 * time.Millisecond
)

// Options configure the API.
type Options struct {
	// Client queues and explains calls.
	Client *queue.Client
	// Token, when set, is the bearer token every request must carry
	// (Authorization: Bearer TOKEN), compared in constant time. Serve
	// without one on a loopback address only (ui.CheckAddr).
	Token string
	// MaxBody bounds a POST /v1/calls body (413 above); default
	// DefaultMaxBody.
	MaxBody int64
	// MaxExportBody bounds a POST /v1/exports body (413 above), which is
	// spooled to a temporary file in $TMPDIR while its calls are
	// checked and queued; default DefaultMaxExportBody.
	MaxExportBody int64
	// MaxWait bounds GET's ?wait=; default DefaultMaxWait.
	MaxWait time.Duration
	// MaxWaiting bounds the requests held at once, GETs with ?wait= and
	// results with ?follow=true; one more is answered 503 with
	// Retry-After. Default DefaultMaxWaiting.
	MaxWaiting int
	// Poll is how often a waiting GET looks at its call, while up to
	// pollShare wait; default 20 ms. With more waiting, each looks
	// less often, so that together they read Redis about pollShare
	// times per Poll.
	Poll time.Duration
	// Addr is the address the API listens on (httpguard.Bound): a
	// request's Host must name it, any loopback name for a loopback
	// address, any name for a wildcard address with a token. "" takes
	// the address each connection arrived at.
	Addr string
}

type server struct {
	o       Options
	waiting chan struct{} // a slot per request held: a GET's ?wait=, a follow
	// base ends when the server shuts down (shutdown): it ends the
	// follows, which would hold it until the export finishes.
	base     context.Context
	shutdown context.CancelFunc
}

// New returns the API's handler.
func New(o Options) http.Handler {
	h, _ := newServer(o)
	return h
}

func newServer(o Options) (http.Handler, *server) {
	if o.MaxBody <= 0 {
		o.MaxBody = DefaultMaxBody
	}
	if o.MaxExportBody <= 0 {
		o.MaxExportBody = DefaultMaxExportBody
	}
	if o.MaxWait <= 0 {
		o.MaxWait = DefaultMaxWait
	}
	if o.Poll <= 0 {
		o.Poll = defaultPoll
	}
	if o.MaxWaiting <= 0 {
		o.MaxWaiting = DefaultMaxWaiting
	}
	s := &server{o: o, waiting: make(chan struct{}, o.MaxWaiting)}
	s.base, s.shutdown = context.WithCancel(context.Background())
	mux := http.NewServeMux()
	for _, r := range s.routes() {
		mux.HandleFunc(r.pattern, r.handler)
	}
	return s.guard(s.auth(mux)), s
}

// NewServer returns the server of the API of o (New, Traced), with
// httpguard's timeouts and a write timeout longer than the longest
// ?wait= (Options.MaxWait). An export's body and results stream push
// their own deadlines as they go (they may take longer); its Shutdown
// ends the follows of results at once (their clients see the stream
// break), and lets the other requests finish.
func NewServer(o Options, log *slog.Logger) *http.Server {
	wait := o.MaxWait
	if wait <= 0 {
		wait = DefaultMaxWait
	}
	h, s := newServer(o)
	srv := httpguard.NewServer(Traced(h, nil), httpguard.ReadTimeout+wait+30*time.Second, log)
	srv.RegisterOnShutdown(s.shutdown)
	return srv
}

// guard refuses a request whose Host does not name the API (421) and,
// without a token, one that a browser sent for another site's page
// (403): the token is a header no browser adds to another site's
// request, so with one only the Host is checked.
func (s *server) guard(next http.Handler) http.Handler {
	o := httpguard.Options{Addr: s.o.Addr, AnyHost: s.o.Token != "", CrossSite: httpguard.CheckEvery}
	if s.o.Token != "" {
		o.CrossSite = httpguard.CheckNone
	}
	return httpguard.Wrap(next, o, func(w http.ResponseWriter, status int, msg string) { writeError(w, status, msg, nil) })
}

// route is one of the API's routes: a ServeMux pattern, "METHOD PATH".
type route struct {
	pattern string
	handler http.HandlerFunc
}

// routes are every route of the API; openapi.json documents each.
func (s *server) routes() []route {
	return []route{
		{"POST /v1/calls", s.post},
		{"GET /v1/calls/{id}", s.get},
		{"DELETE /v1/calls/{id}", s.delete},
		{"POST /v1/exports", s.postExport},
		{"GET /v1/exports/{id}", s.getExport},
		{"GET /v1/exports/{id}/results", s.getResults},
		{"POST /v1/exports/{id}/retry", s.retryExport},
		{"POST /v1/exports/{id}/cancel", s.cancelExport},
		{"GET /v1/openapi.json", serveOpenAPI},
	}
}

// openAPI is the API's OpenAPI 3.1 document; docs/openapi.json is a copy
// (TestOpenAPIInDocs).
//
//go:embed openapi.json
var openAPI []byte

func serveOpenAPI(w http.ResponseWriter, _ *http.Request) {
	w.Header().Set("Content-Type", "application/json")
	_, _ = w.Write(openAPI)
}

// auth refuses a request without the token, when one is set.
func (s *server) auth(next http.Handler) http.Handler {
	if s.o.Token == "" {
		return next
	}
	want := []byte("Bearer " + s.o.Token)
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if subtle.ConstantTimeCompare([]byte(r.Header.Get("Authorization")), want) != 1 {
			w.Header().Set("WWW-Authenticate", `Bearer realm="shaper"`)
			writeError(w, http.StatusUnauthorized, "this API needs its token: send Authorization: Bearer TOKEN (the token given to --api-token or SHAPER_API_TOKEN)", nil)
			return
		}
		next.ServeHTTP(w, r)
	})
}

// Refusal is the answer to a request the API refuses: what to fix, and
// for a body with bad calls, each of them by its line.
type Refusal struct {
	Error string      `json:"error"`
	Lines []lineError `json:"lines,omitempty"`
}

// lineError is one bad call of a body, by its line (1 for a single JSON
// call).
type lineError struct {
	Line  int    `json:"line"`
	Error string `json:"error"`
}

func writeJSON(w http.ResponseWriter, status int, v any) {
	w.Header().Set("Content-Type", "application/json")
	w.WriteHeader(status)
	_ = json.NewEncoder(w).Encode(v)
}

func writeError(w http.ResponseWriter, status int, msg string, lines []lineError) {
	writeJSON(w, status, Refusal{msg, lines})
}

// Accepted is POST /v1/calls's answer once every call of the body passed
// its checks: with 202, every call was taken; with 429, 409 or 503, Error
// says why not, and Calls says, line by line, which calls were taken
// anyway (queued now, or their id already queued) and which were not:
// post those again.
type Accepted struct {
	Error string `json:"error,omitempty"`
	// IDs are the ids of the calls taken, in the body's order: with 202,
	// the id of every call (an id already queued answers with that call).
	IDs           []string    `json:"ids"`
	Enqueued      int         `json:"enqueued"`
	AlreadyQueued int         `json:"already_queued"`
	Calls         []callState `json:"calls"`
}

// callState is what became of one call of a body, by its line (1 for a
// single JSON call): queue.StateQueued, StateAlreadyQueued (the call
// that holds its id is in Lane) or StateNotQueued (Error says why).
type callState struct {
	Line  int    `json:"line"`
	ID    string `json:"id,omitempty"`
	State string `json:"state"`
	Lane  string `json:"lane"`
	Error string `json:"error,omitempty"`
}

// post queues the calls of the body: one JSON call (application/json), or
// NDJSON of many (application/x-ndjson), each naming its vendor. Every
// call is checked first; a body with a bad one queues nothing.
func (s *server) post(w http.ResponseWriter, r *http.Request) {
	ct, ok := mediaType(r)
	if !ok {
		writeError(w, http.StatusUnsupportedMediaType, ct, nil)
		return
	}
	body, err := readBody(w, r, s.o.MaxBody)
	var tooLarge *http.MaxBytesError
	switch {
	case errors.As(err, &tooLarge):
		writeError(w, http.StatusRequestEntityTooLarge, fmt.Sprintf("the body is larger than %d bytes: send the calls in several requests", s.o.MaxBody), nil)
		return
	case err != nil:
		writeError(w, http.StatusBadRequest, "reading the body: "+err.Error(), nil)
		return
	}
	if ct == "application/json" {
		// One call, perhaps over several lines: the same checks as a
		// call line once it is on one.
		var one bytes.Buffer
		if err := json.Compact(&one, body); err != nil {
			writeError(w, http.StatusBadRequest, "the body is not JSON: "+err.Error()+" (one call as a JSON object, or NDJSON of many with Content-Type: application/x-ndjson)", nil)
			return
		}
		body = one.Bytes()
	}
	calls, err := queue.ParseVendorCalls(bytes.NewReader(body))
	if err != nil {
		writeError(w, http.StatusBadRequest, badCalls, lines(err))
		return
	}
	if len(calls) == 0 {
		writeError(w, http.StatusBadRequest, "no call in the body", nil)
		return
	}
	// Once the calls are being queued, a client that goes away does not
	// stop it half way: the body is taken whole, or the answer (if the
	// client is still there to read it) says exactly what was.
	ctx, cancel := context.WithTimeout(context.WithoutCancel(r.Context()), enqueueTimeout)
	defer cancel()
	res, status, msg, bad := s.enqueue(ctx, calls)
	switch {
	case status == http.StatusBadRequest:
		writeError(w, status, msg, bad)
		return
	case status == http.StatusTooManyRequests, status == http.StatusServiceUnavailable:
		w.Header().Set("Retry-After", "1")
	}
	writeJSON(w, status, res)
}

// enqueueTimeout bounds the queueing of one body.
const enqueueTimeout = time.Minute

// mediaType is the media type of r's body, application/json or
// application/x-ndjson, or else (false) the refusal that says what to
// send. A body without a Content-Type is refused, not read as JSON: a
// browser sends one that way (or as text/plain) to any site without
// asking it first.
func mediaType(r *http.Request) (string, bool) {
	h := r.Header.Get("Content-Type")
	ct, _, _ := mime.ParseMediaType(h)
	switch {
	case ct == "application/json" || ct == "application/x-ndjson":
		return ct, true
	case h == "":
		return "no Content-Type: send Content-Type: application/json (one call) or application/x-ndjson (one call per line)", false
	}
	return fmt.Sprintf("Content-Type %q: send application/json (one call) or application/x-ndjson (one call per line)", h), false
}

// readBody reads r's body, at most limit bytes, in chunks as they come:
// a buffer grows with what arrived, never with what Content-Length
// announces, and a body announced larger than limit is refused before
// any of it is read (*http.MaxBytesError, as for one that turns out
// larger).
func readBody(w http.ResponseWriter, r *http.Request, limit int64) ([]byte, error) {
	if r.ContentLength > limit {
		return nil, &http.MaxBytesError{Limit: limit}
	}
	var buf bytes.Buffer
	_, err := buf.ReadFrom(http.MaxBytesReader(w, r.Body, limit))
	return buf.Bytes(), err
}

// enqueue queues the calls (queue.Client.EnqueueCalls): nothing unless
// every call passes its checks (400, naming the bad lines), nothing when
// a vendor's queue has no room for all of its calls (429); past that,
// the answer says line by line what was taken (202 when all, else 409
// for ids another request is queueing, 503 for Redis).
func (s *server) enqueue(ctx context.Context, calls []queue.Call) (Accepted, int, string, []lineError) {
	c := s.o.Client
	one := calls[0].Vendor
	if slices.ContainsFunc(calls, func(c queue.Call) bool { return c.Vendor != one }) {
		// Several vendors: name the bad calls of each.
		var order []string
		byVendor := map[string][]queue.Call{}
		for _, call := range calls {
			if _, seen := byVendor[call.Vendor]; !seen {
				order = append(order, call.Vendor)
			}
			byVendor[call.Vendor] = append(byVendor[call.Vendor], call)
		}
		var bad []lineError
		for _, v := range order {
			if err := c.CheckCalls(v, byVendor[v]); err != nil {
				_, _, more := refusal(v, byVendor[v], err)
				bad = append(bad, more...)
			}
		}
		if len(bad) > 0 {
			return Accepted{}, http.StatusBadRequest, badCalls, bad
		}
	}
	res, err := c.EnqueueCalls(ctx, calls)
	if err != nil && res.Calls == nil { // refused at its checks
		status, msg, bad := refusal(one, calls, err)
		if status == http.StatusBadRequest {
			return Accepted{}, status, msg, bad
		}
		res.Calls = make([]queue.BatchCall, len(calls))
		for i := range res.Calls {
			res.Calls[i] = queue.BatchCall{State: queue.StateNotQueued, Err: err}
		}
	}
	out := Accepted{IDs: make([]string, 0, len(calls)), Enqueued: res.Enqueued, AlreadyQueued: res.AlreadyQueued, Calls: make([]callState, len(calls))}
	for i, bc := range res.Calls {
		cs := callState{Line: queue.LineOf(calls[i]), ID: bc.ID, State: bc.State, Lane: bc.Lane}
		if cs.Line == 0 {
			cs.Line = i + 1
		}
		if bc.State == queue.StateNotQueued {
			if bc.Err != nil {
				cs.Error = bc.Err.Error()
			}
		} else {
			out.IDs = append(out.IDs, bc.ID)
		}
		out.Calls[i] = cs
	}
	status := http.StatusAccepted
	switch {
	case err == nil:
	case errors.Is(err, queue.ErrQueueFull):
		status, out.Error = http.StatusTooManyRequests, err.Error()+": nothing was queued; try again when it has drained"
	case errors.Is(err, queue.ErrInProgress):
		status, out.Error = http.StatusConflict, err.Error()+"; post the calls not queued again in a moment"
	default:
		status, out.Error = http.StatusServiceUnavailable, fmt.Sprintf("%s; %d of the %d calls were taken (%d queued now, %d already queued): see calls, and post the others again",
			err, len(out.IDs), len(calls), out.Enqueued, out.AlreadyQueued)
	}
	return out, status, "", nil
}

// badCalls is the refusal of a body with bad calls.
const badCalls = "bad calls: nothing was queued"

// refusal says how the API refuses err, from checking or queueing calls
// of vendor: 400 naming the bad calls (an unknown vendor: each of its
// calls), 429 for a full queue, else 503 (Redis).
func refusal(vendor string, calls []queue.Call, err error) (status int, msg string, bad []lineError) {
	var le *queue.LineError
	switch {
	case errors.Is(err, queue.ErrUnknownVendor):
		for _, call := range calls {
			bad = append(bad, lineError{Line: queue.LineOf(call), Error: fmt.Sprintf("unknown vendor %q: name a [vendors.NAME] table of the config", vendor)})
		}
		return http.StatusBadRequest, badCalls, bad
	case errors.Is(err, queue.ErrQueueFull):
		return http.StatusTooManyRequests, err.Error() + ": nothing was queued; try again when it has drained", nil
	case errors.As(err, &le):
		return http.StatusBadRequest, badCalls, lines(err)
	}
	return http.StatusServiceUnavailable, err.Error(), nil
}

// lines lists the bad calls in err (a join of *queue.LineError).
func lines(err error) []lineError {
	if err == nil {
		return nil
	}
	var out []lineError
	for _, e := range unjoin(err) {
		var le *queue.LineError
		if errors.As(e, &le) {
			out = append(out, lineError{Line: le.Line, Error: le.Err.Error()})
		} else {
			out = append(out, lineError{Error: e.Error()})
		}
	}
	return out
}

// unjoin lists the errors joined in err, joins of joins flattened (an
// export's source returns its bad lines joined, and StartExportFrom
// joins that with its own).
func unjoin(err error) []error {
	j, ok := err.(interface{ Unwrap() []error })
	if !ok {
		return []error{err}
	}
	var out []error
	for _, e := range j.Unwrap() {
		out = append(out, unjoin(e)...)
	}
	return out
}

// get answers what a call waits for, or how it ended (queue.Explanation).
// With ?wait=D (at most MaxWait), it holds the request until the call
// ends or D has passed. ?vendor= names the vendor of an id that more
// than one vendor's calls carry (409 without it).
func (s *server) get(w http.ResponseWriter, r *http.Request) {
	id, vendor := r.PathValue("id"), r.URL.Query().Get("vendor")
	var wait time.Duration
	if q := r.URL.Query().Get("wait"); q != "" {
		d, err := time.ParseDuration(q)
		if err != nil || d < 0 {
			if n, nerr := strconv.ParseFloat(q, 64); nerr == nil && n >= 0 && !math.IsInf(n, 0) {
				d, err = time.Duration(n*float64(time.Second)), nil
			}
		}
		if err != nil || d < 0 {
			writeError(w, http.StatusBadRequest, fmt.Sprintf("wait=%q: a duration such as 30s, or seconds", q), nil)
			return
		}
		wait = min(d, s.o.MaxWait)
	}
	if wait > 0 {
		select {
		case s.waiting <- struct{}{}:
			defer func() { <-s.waiting }()
		default:
			w.Header().Set("Retry-After", "1")
			writeError(w, http.StatusServiceUnavailable, fmt.Sprintf("%d requests already wait (?wait=) on this server, as many as it holds at once: "+
				"retry after Retry-After, or GET without ?wait=", cap(s.waiting)), nil)
			return
		}
	}
	deadline := time.Now().Add(wait)
	e, err := s.explain(r.Context(), vendor, id)
	// While it waits, the request reads only the call's state (one
	// read, where an Explain of a pending call takes about 20 commands),
	// and explains it again at the end.
	for err == nil && !ended(e) && time.Now().Add(s.o.Poll).Before(deadline) {
		select {
		case <-r.Context().Done():
			return
		case <-time.After(s.poll()):
		}
		var state string
		if state, err = s.o.Client.State(r.Context(), e); err == nil && (state == "completed" || state == "archived") {
			e, err = s.explain(r.Context(), vendor, id)
		}
	}
	if err == nil && !ended(e) && wait > 0 {
		e, err = s.explain(r.Context(), vendor, id)
	}
	switch {
	case errors.Is(err, queue.ErrNoTask):
		writeError(w, http.StatusNotFound, err.Error(), nil)
	case errors.Is(err, queue.ErrAmbiguous):
		writeError(w, http.StatusConflict, err.Error(), nil)
	case errors.Is(err, queue.ErrUnknownVendor):
		writeError(w, http.StatusBadRequest, err.Error(), nil)
	case err != nil:
		w.Header().Set("Retry-After", "1")
		writeError(w, http.StatusServiceUnavailable, err.Error(), nil)
	default:
		writeJSON(w, http.StatusOK, e)
	}
}

// pollShare is how many waiting GETs look at their calls every
// Options.Poll; more wait longer between looks (poll).
const pollShare = 50

// poll is how long a waiting GET sleeps between looks at its call:
// Options.Poll while up to pollShare GETs wait, longer in proportion
// beyond, so that the API's reads stay near pollShare per Poll (2,500 a
// second at the defaults) whatever the number waiting.
func (s *server) poll() time.Duration {
	return s.o.Poll * time.Duration(1+(len(s.waiting)-1)/pollShare)
}

// Cancelled is DELETE /v1/calls/{id}'s answer: the call, and the state
// it was cancelled in.
type Cancelled struct {
	queue.Cancellation
	Cancelled bool `json:"cancelled"`
}

// delete cancels a call that has not started (queue.Client.CancelVendor):
// 409 for one that has started or finished, or for an id that more than
// one vendor's calls carry unless ?vendor= names one.
func (s *server) delete(w http.ResponseWriter, r *http.Request) {
	c, err := s.o.Client.CancelVendor(r.Context(), r.URL.Query().Get("vendor"), r.PathValue("id"))
	switch {
	case err == nil:
		writeJSON(w, http.StatusOK, Cancelled{c, true})
	case errors.Is(err, queue.ErrNoTask):
		writeError(w, http.StatusNotFound, err.Error(), nil)
	case errors.Is(err, queue.ErrUnknownVendor):
		writeError(w, http.StatusBadRequest, err.Error(), nil)
	case errors.Is(err, queue.ErrStarted), errors.Is(err, queue.ErrFinished), errors.Is(err, queue.ErrAmbiguous):
		writeError(w, http.StatusConflict, err.Error(), nil)
	default:
		writeError(w, http.StatusServiceUnavailable, err.Error(), nil)
	}
}

// explainTries bounds how often get reads a call whose state changed
// while Explain read it.
const explainTries = 3

// explain is Client.ExplainVendor, read again after an error other than
// ErrNoTask (or an ambiguous id, or an unknown vendor): a call a worker takes while Explain reads it as pending
// fails the read ("no longer pending"), and the next read sees it
// running.
func (s *server) explain(ctx context.Context, vendor, id string) (queue.Explanation, error) {
	var err error
	for range explainTries {
		var e queue.Explanation
		if e, err = s.o.Client.ExplainVendor(ctx, vendor, id); err == nil || errors.Is(err, queue.ErrNoTask) || errors.Is(err, queue.ErrAmbiguous) ||
			errors.Is(err, queue.ErrUnknownVendor) || ctx.Err() != nil {
			return e, err
		}
	}
	return queue.Explanation{}, err
}

// ended reports whether the call finished: completed, or archived after
// its retries.
func ended(e queue.Explanation) bool {
	return e.State == "completed" || e.State == "archived" || strings.EqualFold(e.Binding, queue.BindDone)
}

// CheckAddr refuses to serve the API on addr without a token unless addr
// is a loopback address: anyone who reaches it could queue calls with the
// vendors' credentials. flag names the flag that set addr, for the error.
func CheckAddr(flag, addr, token string) error {
	host, _, err := net.SplitHostPort(addr)
	if err != nil {
		return fmt.Errorf("%s %q: %v (want HOST:PORT, e.g. 127.0.0.1:8081)", flag, addr, err)
	}
	if ip := net.ParseIP(host); token != "" || host == "localhost" || ip != nil && ip.IsLoopback() {
		return nil
	}
	return fmt.Errorf("%s %s is not a loopback address, and the API queues calls with your vendors' credentials for anyone who reaches it: "+
		"set a token with --api-token or SHAPER_API_TOKEN (every request must then send Authorization: Bearer TOKEN), or bind 127.0.0.1", flag, addr)
}
