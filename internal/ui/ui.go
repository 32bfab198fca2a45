// Package ui is shaper's live page: per vendor, the calls started per
// second against the limit, the effective rate and what set it, quotas,
// pauses with their reasons, 429s, the queue and the calls in flight; for
// a per-account vendor its accounts; and why one call waits (explain).
//
// The page is html/template with embedded CSS and JavaScript (no build
// step, nothing fetched from the network); the script polls /api/state
// every second and draws the chart as SVG. A sampler owned by Server.Run
// reads every vendor once a second into a bounded history, so the chart
// has the last minutes as soon as the page opens.
package ui

import (
	"context"
	"crypto/subtle"
	"embed"
	"encoding/json"
	"errors"
	"fmt"
	"html/template"
	"log/slog"
	"net"
	"net/http"
	"net/url"
	"sort"
	"strings"
	"sync"
	"time"

	"github.com/shaper-dev/shaper/internal/httpguard"
	"github.com/shaper-dev/shaper/internal/report"
	"github.com/shaper-dev/shaper/queue"
)

// Source is what the page reads. Its errors may wrap
// queue.ErrUnknownVendor, queue.ErrBadAccount or queue.ErrNoTask, which
// the page answers with 404 or 400 and the error's text.
type Source interface {
	// Report reads every configured vendor (no account's own figures).
	Report(ctx context.Context) (report.Report, error)
	// Vendor reads one vendor, with account's own figures when account
	// is not "" (report.VendorState.Account).
	Vendor(ctx context.Context, vendor, account string) (report.VendorState, error)
	// Explain says what task id waits for.
	Explain(ctx context.Context, id string) (queue.Explanation, error)
}

// Options configure a Server. Source is required.
type Options struct {
	Source Source
	// Asynq, when set, is mounted under /asynq/ (asynqmon).
	Asynq http.Handler
	// Token, when set, must come with every request: as
	// "Authorization: Bearer TOKEN", or once as ?token=TOKEN, which sets a
	// cookie for the rest.
	Token string
	// Every is the sampling period (default 1 s); Keep the samples kept
	// per vendor (default 300: 5 minutes at 1 s); KeepPauses the pauses
	// kept per vendor (default 20).
	Every      time.Duration
	Keep       int
	KeepPauses int
	Log        *slog.Logger
	// Addr is the address the page listens on (httpguard.Bound): a
	// request's Host must name it, any loopback name for a loopback
	// address, any name for a wildcard address with a token. "" takes
	// the address each connection arrived at.
	Addr string
}

// Server serves the page. Its sampler runs in Run; the handler serves
// what the sampler has (and reads the rest on demand).
type Server struct {
	o    Options
	page *template.Template

	mu      sync.Mutex
	hist    map[string]*history
	latest  report.Report
	lastErr error
}

//go:embed assets
var assets embed.FS

// New returns a server of o.
func New(o Options) (*Server, error) {
	if o.Source == nil {
		return nil, errors.New("ui: Options.Source is nil")
	}
	if o.Every <= 0 {
		o.Every = time.Second
	}
	if o.Keep <= 1 {
		o.Keep = 300
	}
	if o.KeepPauses <= 0 {
		o.KeepPauses = 20
	}
	if o.Log == nil {
		o.Log = slog.New(slog.DiscardHandler)
	}
	page, err := template.New("page.html").Funcs(template.FuncMap{"perWindow": perWindow, "limit": limitText}).ParseFS(assets, "assets/page.html")
	if err != nil {
		return nil, err
	}
	return &Server{o: o, page: page, hist: map[string]*history{}}, nil
}

// Run samples every vendor each Options.Every until ctx ends.
func (s *Server) Run(ctx context.Context) {
	t := time.NewTicker(s.o.Every)
	defer t.Stop()
	failing := false
	for {
		err := s.sample(ctx)
		switch {
		case err != nil && ctx.Err() == nil && !failing:
			s.o.Log.Warn("live page: cannot read the gate's state; the page shows the last state read", "err", err)
			failing = true
		case err == nil && failing:
			s.o.Log.Info("live page: reading the gate's state again")
			failing = false
		}
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
	}
}

// sample reads every vendor into its history. Vendors gone from the
// config leave the history with their samples.
func (s *Server) sample(ctx context.Context) error {
	rctx, cancel := context.WithTimeout(ctx, 5*time.Second)
	defer cancel()
	rep, err := s.o.Source.Report(rctx)
	s.mu.Lock()
	defer s.mu.Unlock()
	s.lastErr = err
	if err != nil {
		return err
	}
	s.latest = rep
	seen := make(map[string]bool, len(rep.Vendors))
	for _, v := range rep.Vendors {
		seen[v.Name] = true
		h := s.hist[v.Name]
		if h == nil {
			h = newHistory(s.o.Keep, s.o.KeepPauses)
			s.hist[v.Name] = h
		}
		h.add(v)
	}
	for name := range s.hist {
		if !seen[name] {
			delete(s.hist, name)
		}
	}
	return nil
}

// VendorState is one vendor in /api/state: the latest report, the calls
// started per second over the last 5 s, the rate and limit the chart
// draws (see chartRates), the chart and the pauses.
type VendorState struct {
	report.VendorState
	StartedPerSecond float64 `json:"started_per_second"`
	RatePerSecond    float64 `json:"rate_per_second"`
	LimitPerSecond   float64 `json:"limit_per_second"`
	Series           Series  `json:"series"`
	Pauses           []pause `json:"pauses"`
}

// State is /api/state.
type State struct {
	At      time.Time     `json:"at"`
	EveryMS int64         `json:"every_ms"`
	Error   string        `json:"error,omitempty"` // the latest read's, when it failed
	Vendors []VendorState `json:"vendors"`
}

// startedSpan is the span the latest calls-per-second figure is taken
// over: at 1 s samples, five intervals, so that one tick more or less in
// an interval moves it by a fifth of a call per second.
const startedSpan = 5 * time.Second

func (s *Server) state(only string) (State, bool) {
	s.mu.Lock()
	defer s.mu.Unlock()
	st := State{At: s.latest.At, EveryMS: s.o.Every.Milliseconds(), Vendors: []VendorState{}}
	if s.lastErr != nil {
		st.Error = s.lastErr.Error()
	}
	found := only == ""
	for _, v := range s.latest.Vendors {
		if only != "" && v.Name != only {
			continue
		}
		found = true
		vs := VendorState{VendorState: v}
		rate, limit := chartRates(v)
		vs.RatePerSecond, vs.LimitPerSecond = report.Round2(rate), report.Round2(limit)
		if h := s.hist[v.Name]; h != nil {
			samples := h.ordered()
			vs.Series = series(samples)
			vs.StartedPerSecond = report.Round2(startedRate(samples, startedSpan))
			vs.Pauses = append([]pause{}, h.pauses...)
		}
		st.Vendors = append(st.Vendors, vs)
	}
	return st, found
}

// Handler serves the page, its API and, with Options.Asynq, asynqmon.
func (s *Server) Handler() http.Handler {
	mux := http.NewServeMux()
	mux.HandleFunc("GET /{$}", s.servePage)
	mux.HandleFunc("GET /vendors/{vendor}", s.servePage)
	mux.HandleFunc("GET /api/state", s.serveState)
	mux.HandleFunc("GET /api/vendors/{vendor}/accounts/{account}", s.serveAccount)
	mux.HandleFunc("GET /api/explain/{id}", s.serveExplain)
	mux.Handle("GET /assets/", http.FileServerFS(assets))
	if s.o.Asynq != nil {
		mux.Handle("/asynq/", s.o.Asynq)
		mux.Handle("/asynq", http.RedirectHandler("/asynq/", http.StatusMovedPermanently))
	}
	var h http.Handler = mux
	if s.o.Token != "" {
		h = s.requireToken(h)
	}
	return securityHeaders(s.guard(h))
}

// guard refuses a request whose Host does not name the page (421) and
// one a browser sent for another site's page (403): every such request
// without a token; with one, since a browser sends the token's cookie
// by itself, every request but GET and HEAD (asynqmon's pause, run and
// delete are POSTs and DELETEs).
func (s *Server) guard(next http.Handler) http.Handler {
	o := httpguard.Options{Addr: s.o.Addr, AnyHost: s.o.Token != "", CrossSite: httpguard.CheckEvery}
	if s.o.Token != "" {
		o.CrossSite = httpguard.CheckWrites
	}
	return httpguard.Wrap(next, o, httpError)
}

// WriteTimeout is the page server's write timeout (httpguard.NewServer):
// the page holds no request longer than a read of Redis.
const WriteTimeout = httpguard.ReadTimeout + 30*time.Second

// pageData is what page.html renders: the vendors' latest report, so the
// numbers are there before the script runs.
type pageData struct {
	Vendors []report.VendorState
	Only    string
	Base    string // the way back to the page's root: "" or "../"
	Asynq   bool
	Error   string
}

func (s *Server) servePage(w http.ResponseWriter, r *http.Request) {
	only := r.PathValue("vendor")
	s.mu.Lock()
	rep, lastErr := s.latest, s.lastErr
	s.mu.Unlock()
	if rep.At.IsZero() && lastErr == nil { // before the first sampling
		var err error
		if rep, err = s.o.Source.Report(r.Context()); err != nil {
			lastErr = err
		}
	}
	d := pageData{Only: only, Asynq: s.o.Asynq != nil}
	if only != "" {
		d.Base = "../"
	}
	if lastErr != nil {
		d.Error = lastErr.Error()
	}
	for _, v := range rep.Vendors {
		if only == "" || v.Name == only {
			d.Vendors = append(d.Vendors, v)
		}
	}
	if only != "" && len(d.Vendors) == 0 {
		httpError(w, http.StatusNotFound, fmt.Sprintf("no vendor %q in the config; configured vendors: %s", only, names(rep)))
		return
	}
	w.Header().Set("Content-Type", "text/html; charset=utf-8")
	if err := s.page.Execute(w, d); err != nil {
		s.o.Log.Warn("live page: rendering the page", "err", err)
	}
}

func (s *Server) serveState(w http.ResponseWriter, r *http.Request) {
	only := r.URL.Query().Get("vendor")
	st, found := s.state(only)
	if !found {
		s.mu.Lock()
		known := names(s.latest)
		s.mu.Unlock()
		httpError(w, http.StatusNotFound, fmt.Sprintf("no vendor %q in the config; configured vendors: %s", only, known))
		return
	}
	writeJSON(w, st)
}

func (s *Server) serveAccount(w http.ResponseWriter, r *http.Request) {
	v, err := s.o.Source.Vendor(r.Context(), r.PathValue("vendor"), r.PathValue("account"))
	if err != nil {
		s.sourceError(w, err)
		return
	}
	if v.Account == nil {
		httpError(w, http.StatusNotFound, fmt.Sprintf("vendor %q is not per-account: it has no accounts", v.Name))
		return
	}
	writeJSON(w, v)
}

func (s *Server) serveExplain(w http.ResponseWriter, r *http.Request) {
	ex, err := s.o.Source.Explain(r.Context(), r.PathValue("id"))
	if err != nil {
		s.sourceError(w, err)
		return
	}
	writeJSON(w, ex)
}

// sourceError answers err from the Source: 404 for what does not exist,
// 400 for a bad account name, 503 for the rest (Redis cannot answer).
func (s *Server) sourceError(w http.ResponseWriter, err error) {
	switch {
	case errors.Is(err, queue.ErrNoTask):
		httpError(w, http.StatusNotFound, err.Error()+": check the id (shaper enqueue prints it)")
	case errors.Is(err, queue.ErrUnknownVendor):
		httpError(w, http.StatusNotFound, err.Error())
	case errors.Is(err, queue.ErrBadAccount):
		httpError(w, http.StatusBadRequest, err.Error())
	default:
		s.o.Log.Warn("live page: a request failed", "err", err)
		httpError(w, http.StatusServiceUnavailable, "cannot read the gate's state: "+err.Error())
	}
}

// tokenCookie carries the token after ?token=.
const tokenCookie = "shaper_ui_token"

// requireToken lets a request through when it carries the token: a
// bearer header, the cookie, or ?token= (which sets the cookie and
// redirects to the same URL without it, so the token leaves the address
// bar and the history).
func (s *Server) requireToken(next http.Handler) http.Handler {
	ok := func(got string) bool { return subtle.ConstantTimeCompare([]byte(got), []byte(s.o.Token)) == 1 }
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if t, found := strings.CutPrefix(r.Header.Get("Authorization"), "Bearer "); found && ok(t) {
			next.ServeHTTP(w, r)
			return
		}
		if c, err := r.Cookie(tokenCookie); err == nil && ok(c.Value) {
			next.ServeHTTP(w, r)
			return
		}
		if q := r.URL.Query(); q.Has("token") && ok(q.Get("token")) {
			http.SetCookie(w, &http.Cookie{Name: tokenCookie, Value: s.o.Token, Path: "/", HttpOnly: true,
				SameSite: http.SameSiteStrictMode, Secure: r.TLS != nil})
			q.Del("token")
			u := url.URL{Path: r.URL.Path, RawQuery: q.Encode()}
			http.Redirect(w, r, u.String(), http.StatusSeeOther)
			return
		}
		httpError(w, http.StatusUnauthorized, "this page needs its token: open it once as /?token=TOKEN (a cookie keeps it), or send Authorization: Bearer TOKEN")
	})
}

// securityHeaders keeps the page from being framed or sniffed and its
// scripts to its own (asynqmon's pages are left to asynqmon).
func securityHeaders(next http.Handler) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		h := w.Header()
		h.Set("X-Content-Type-Options", "nosniff")
		h.Set("X-Frame-Options", "DENY")
		h.Set("Referrer-Policy", "no-referrer")
		if !strings.HasPrefix(r.URL.Path, "/asynq") {
			h.Set("Content-Security-Policy", "default-src 'self'; img-src 'self' data:; frame-ancestors 'none'")
		}
		next.ServeHTTP(w, r)
	})
}

// CheckAddr refuses to serve on addr without a token unless addr is a
// loopback address (127.0.0.0/8, ::1, localhost). flag names the flag
// that set addr, for the message.
func CheckAddr(flag, addr, token string) error {
	host, _, err := net.SplitHostPort(addr)
	if err != nil {
		return fmt.Errorf("%s %q: %v (want HOST:PORT, e.g. 127.0.0.1:8080)", flag, addr, err)
	}
	if token != "" || isLoopback(host) {
		return nil
	}
	return fmt.Errorf("%s %s is not a loopback address, and the page shows your vendors' traffic to anyone who reaches it: "+
		"set a token with --ui-token or SHAPER_UI_TOKEN (every request must then carry it), or bind 127.0.0.1", flag, addr)
}

func isLoopback(host string) bool {
	if host == "localhost" {
		return true
	}
	ip := net.ParseIP(host)
	return ip != nil && ip.IsLoopback()
}

func names(rep report.Report) string {
	var out []string
	for _, v := range rep.Vendors {
		out = append(out, v.Name)
	}
	sort.Strings(out)
	if len(out) == 0 {
		return "none"
	}
	return strings.Join(out, ", ")
}

// perWindow prints rate calls per window w, as the config writes it
// (report.PerWindow).
func perWindow(rate float64, w string) string {
	d, err := time.ParseDuration(w)
	if err != nil {
		return fmt.Sprintf("%g/%s", report.Round2(rate), w)
	}
	return report.PerWindow(rate, d)
}

// limitText is v's limit as the config has it: "5/s", "3/s each account".
func limitText(v report.VendorState) string {
	s := perWindow(float64(v.ConfigRate), v.Window)
	if v.AccountsWithBacklog != nil {
		s += " each account"
	}
	return s
}

func writeJSON(w http.ResponseWriter, v any) {
	w.Header().Set("Content-Type", "application/json")
	w.Header().Set("Cache-Control", "no-store")
	_ = json.NewEncoder(w).Encode(v)
}

// httpError answers status with msg, as JSON ({"error": msg}) so the
// page's script can show it; a person reading it in a browser reads the
// message too.
func httpError(w http.ResponseWriter, status int, msg string) {
	w.Header().Set("Content-Type", "application/json")
	w.Header().Set("Cache-Control", "no-store")
	w.WriteHeader(status)
	_ = json.NewEncoder(w).Encode(map[string]string{"error": msg})
}
