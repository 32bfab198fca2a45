package ui

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/shaper-dev/shaper/internal/report"
	"github.com/shaper-dev/shaper/queue"
)

// vendorAt is vendor name read at t with granted ticks so far.
func vendorAt(name string, t time.Time, granted int64) report.VendorState {
	return report.VendorState{Name: name, ConfigRate: 10, EffectiveRate: 9.8, Window: "1s", GrantedTotal: granted, RedisTime: t}
}

// TestHistory drives the history through simulated samples: the chart is
// the granted ticks per interval over its length, the latest figure
// spans 5 s, a counter reset counts nothing, and the ring keeps its size.
func TestHistory(t *testing.T) {
	t0 := time.Unix(1_800_000_000, 0)
	h := newHistory(4, 2)
	// 10 calls/s for 2 s, then 20/s for 1.5 s, then a reset.
	h.add(vendorAt("a", t0, 100))
	h.add(vendorAt("a", t0.Add(time.Second), 110))
	h.add(vendorAt("a", t0.Add(2*time.Second), 120))
	h.add(vendorAt("a", t0.Add(3500*time.Millisecond), 150))
	s := series(h.ordered())
	if want := []float64{10, 10, 20}; fmt.Sprint(s.Started) != fmt.Sprint(want) {
		t.Errorf("started = %v, want %v", s.Started, want)
	}
	if got, want := startedRate(h.ordered(), 5*time.Second), 50/3.5; got != want {
		t.Errorf("startedRate = %v, want %v", got, want)
	}
	if got, want := startedRate(h.ordered(), 1500*time.Millisecond), 20.0; got != want {
		t.Errorf("startedRate over 1.5 s = %v, want %v", got, want)
	}
	h.add(vendorAt("a", t0.Add(4500*time.Millisecond), 3)) // the gate's state was lost
	samples := h.ordered()
	if len(samples) != 4 || !samples[0].at.Equal(t0.Add(time.Second)) {
		t.Fatalf("ring: %d samples from %v, want 4 from %v", len(samples), samples[0].at, t0.Add(time.Second))
	}
	if s := series(samples); s.Started[len(s.Started)-1] != 0 {
		t.Errorf("after a reset: started %v, want 0 last", s.Started)
	}
	if got := startedRate(samples, 5*time.Second); got != 0 {
		t.Errorf("startedRate across a reset = %v, want 0", got)
	}
	for i := range 100 {
		h.add(vendorAt("a", t0.Add(time.Duration(5+i)*time.Second), int64(10*i)))
	}
	if n := len(h.ordered()); n != 4 || cap(h.samples) != 4 {
		t.Errorf("after 100 more samples: %d kept (cap %d), want 4", n, cap(h.samples))
	}
}

// TestPauseTimeline: a pause shows from the sampling that saw it; one
// extended while it lasts stays one; one that ended before the page
// started is not shown; the timeline keeps its size.
func TestPauseTimeline(t *testing.T) {
	t0 := time.Unix(1_800_000_000, 0)
	at := func(d time.Duration, until time.Duration, reason string) report.VendorState {
		v := vendorAt("a", t0.Add(d), 0)
		v.LastPauseUntil, v.LastPauseReason = t0.Add(until).Format(time.RFC3339Nano), reason
		return v
	}
	h := newHistory(10, 2)
	h.add(at(0, -time.Minute, "old")) // ended before the page: not shown
	h.add(at(time.Second, -time.Minute, "old"))
	if len(h.pauses) != 0 {
		t.Fatalf("pauses = %v, want none", h.pauses)
	}
	h.add(at(2*time.Second, 3*time.Second, "HTTP 429, Retry-After: 1"))
	h.add(at(3*time.Second, 5*time.Second, "HTTP 429, Retry-After: 2")) // extended
	h.add(at(4*time.Second, 5*time.Second, "HTTP 429, Retry-After: 2")) // the same
	if len(h.pauses) != 1 || !h.pauses[0].Until.Equal(t0.Add(5*time.Second)) || h.pauses[0].Reason != "HTTP 429, Retry-After: 2" ||
		!h.pauses[0].Seen.Equal(t0.Add(2*time.Second)) {
		t.Fatalf("pauses = %+v, want one seen at +2s until +5s", h.pauses)
	}
	h.add(at(20*time.Second, 21*time.Second, "second"))
	h.add(at(30*time.Second, 31*time.Second, "third"))
	if len(h.pauses) != 2 || h.pauses[0].Reason != "second" || h.pauses[1].Reason != "third" {
		t.Errorf("pauses = %+v, want the last two", h.pauses)
	}
}

// source is a Source over fixed reports, for the page's HTTP behaviour;
// the command's tests run the page on a real Redis and workers.
type source struct {
	rep report.Report
	err error
}

func (s *source) Report(context.Context) (report.Report, error) { return s.rep, s.err }

func (s *source) Vendor(_ context.Context, vendor, account string) (report.VendorState, error) {
	for _, v := range s.rep.Vendors {
		if v.Name == vendor {
			if err := queue.CheckAccount(account); err != nil {
				return report.VendorState{}, err
			}
			return v, nil
		}
	}
	return report.VendorState{}, fmt.Errorf("%w %q", queue.ErrUnknownVendor, vendor)
}

func (s *source) Explain(_ context.Context, id string) (queue.Explanation, error) {
	if id == "t1" {
		return queue.Explanation{TaskID: "t1", Vendor: "acme", Binding: queue.BindBacklog}, nil
	}
	return queue.Explanation{}, queue.ErrNoTask
}

// pageAddr is the address the tests' pages listen on (Options.Addr);
// their requests name it (newRequest).
const pageAddr = "127.0.0.1:8080"

// newRequest is a request to the page at pageAddr.
func newRequest(method, path string) *http.Request {
	req := httptest.NewRequest(method, path, nil)
	req.Host = pageAddr
	return req
}

func get(t *testing.T, h http.Handler, path string, header ...string) (int, string) {
	t.Helper()
	req := newRequest("GET", path)
	for i := 0; i+1 < len(header); i += 2 {
		req.Header.Set(header[i], header[i+1])
	}
	rec := httptest.NewRecorder()
	h.ServeHTTP(rec, req)
	b, _ := io.ReadAll(rec.Result().Body)
	return rec.Code, string(b)
}

// TestHandler: the page names every vendor, a vendor's page only its
// own; an unknown vendor, task or a bad account name is a clear 404 or
// 400 with a message, never a stack trace; a failing Redis is a 503.
func TestHandler(t *testing.T) {
	now := time.Now()
	shop := vendorAt("shop", now, 0)
	n := int64(0)
	shop.AccountsWithBacklog = &n
	src := &source{rep: report.Report{At: now, Vendors: []report.VendorState{vendorAt("acme", now, 0), vendorAt("crm<x>", now, 0), shop}}}
	s, err := New(Options{Source: src, Addr: pageAddr})
	if err != nil {
		t.Fatal(err)
	}
	if err := s.sample(context.Background()); err != nil {
		t.Fatal(err)
	}
	h := s.Handler()
	code, body := get(t, h, "/")
	if code != 200 || !strings.Contains(body, `data-vendor="acme"`) || !strings.Contains(body, `data-vendor="crm&lt;x&gt;"`) ||
		!strings.Contains(body, `data-vendor="shop"`) || !strings.Contains(body, "one account") {
		t.Errorf("/ = %d, want 200 naming acme, crm<x> (escaped) and shop with its account view:\n%s", code, body)
	}
	if code, body := get(t, h, "/vendors/acme"); code != 200 || strings.Contains(body, `data-vendor="shop"`) || !strings.Contains(body, `src="../assets/page.js"`) {
		t.Errorf("/vendors/acme = %d, want acme only with relative assets:\n%s", code, body)
	}
	for _, tc := range []struct {
		path string
		code int
		want string
	}{
		{"/vendors/nope", 404, `no vendor \"nope\" in the config; configured vendors: acme, crm\u003cx\u003e, shop`},
		{"/api/state?vendor=nope", 404, `no vendor \"nope\"`},
		{"/api/explain/t2", 404, "no such task: check the id"},
		{"/api/vendors/nope/accounts/a", 404, `unknown vendor \"nope\"`},
		{"/api/vendors/shop/accounts/bad%20name", 400, "an account name is"},
		{"/api/vendors/acme/accounts/a1", 404, `vendor \"acme\" is not per-account`},
		{"/api/explain/t1", 200, `"binding":"backlog"`},
		{"/asynq/", 404, ""}, // no asynqmon mounted
	} {
		code, body := get(t, h, tc.path)
		if code != tc.code || !strings.Contains(body, tc.want) {
			t.Errorf("%s = %d %s, want %d with %q", tc.path, code, body, tc.code, tc.want)
		}
	}
	code, body = get(t, h, "/api/state")
	var st State
	if err := json.Unmarshal([]byte(body), &st); code != 200 || err != nil || len(st.Vendors) != 3 || st.Vendors[0].LimitPerSecond != 10 {
		t.Errorf("/api/state = %d %v %+v", code, err, st)
	}
	src.err = errors.New("dial tcp 127.0.0.1:6379: connection refused")
	_ = s.sample(context.Background())
	if code, body := get(t, h, "/api/state"); code != 200 || !strings.Contains(body, `"error":"dial tcp`) || !strings.Contains(body, `"vendor":"acme"`) {
		t.Errorf("/api/state with Redis down = %d %s, want the last state read and the error", code, body)
	}
}

// TestToken: with a token every path needs it (bearer header, cookie, or
// ?token= once, which sets the cookie and drops the token from the URL);
// a wrong one gets 401 saying how.
func TestToken(t *testing.T) {
	now := time.Now()
	s, err := New(Options{Source: &source{rep: report.Report{At: now, Vendors: []report.VendorState{vendorAt("acme", now, 0)}}},
		Token: "s3cret", Asynq: http.NotFoundHandler(), Addr: pageAddr})
	if err != nil {
		t.Fatal(err)
	}
	h := s.Handler()
	for _, p := range []string{"/", "/api/state", "/api/explain/x", "/assets/page.js", "/asynq/", "/?token=wrong"} {
		if code, body := get(t, h, p); code != 401 || !strings.Contains(body, "Authorization: Bearer") {
			t.Errorf("%s without the token = %d %s, want 401 saying how", p, code, body)
		}
	}
	if code, _ := get(t, h, "/api/state", "Authorization", "Bearer s3cret"); code != 200 {
		t.Errorf("bearer: %d", code)
	}
	req := newRequest("GET", "/vendors/acme?token=s3cret&x=1")
	rec := httptest.NewRecorder()
	h.ServeHTTP(rec, req)
	cookies := rec.Result().Cookies()
	if rec.Code != http.StatusSeeOther || rec.Header().Get("Location") != "/vendors/acme?x=1" || len(cookies) != 1 || !cookies[0].HttpOnly {
		t.Fatalf("?token= = %d to %q with %v, want 303 to /vendors/acme?x=1 setting an HttpOnly cookie", rec.Code, rec.Header().Get("Location"), cookies)
	}
	req = newRequest("GET", "/")
	req.AddCookie(cookies[0])
	rec = httptest.NewRecorder()
	h.ServeHTTP(rec, req)
	if rec.Code != 200 {
		t.Errorf("with the cookie: %d", rec.Code)
	}
}

// TestCheckAddr: loopback addresses need no token; any other address
// is refused without one, naming the flag and the way to set it.
func TestCheckAddr(t *testing.T) {
	for _, addr := range []string{"127.0.0.1:8080", "[::1]:8080", "localhost:0", "127.0.0.2:80"} {
		if err := CheckAddr("--addr", addr, ""); err != nil {
			t.Errorf("%s: %v", addr, err)
		}
	}
	for _, addr := range []string{"0.0.0.0:8080", ":8080", "10.1.2.3:8080", "[::]:8080", "example.com:80"} {
		err := CheckAddr("--ui-addr", addr, "")
		if err == nil || !strings.Contains(err.Error(), "--ui-addr "+addr) || !strings.Contains(err.Error(), "--ui-token or SHAPER_UI_TOKEN") {
			t.Errorf("%s without a token: %v, want a refusal naming --ui-addr and --ui-token", addr, err)
		}
		if err := CheckAddr("--ui-addr", addr, "t"); err != nil {
			t.Errorf("%s with a token: %v", addr, err)
		}
	}
	if err := CheckAddr("--addr", "8080", ""); err == nil || !strings.Contains(err.Error(), "HOST:PORT") {
		t.Errorf("bad address: %v", err)
	}
}

// asynqWrites stands for asynqmon: it counts the requests that reach
// it, by method.
type asynqWrites struct {
	mu   sync.Mutex
	seen map[string]int
}

func (a *asynqWrites) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	a.mu.Lock()
	a.seen[r.Method]++
	a.mu.Unlock()
	w.WriteHeader(http.StatusNoContent)
}

func (a *asynqWrites) count(method string) int {
	a.mu.Lock()
	defer a.mu.Unlock()
	return a.seen[method]
}

// send is one request to a real server of the page, with headers.
func send(t *testing.T, method, url, host string, header ...string) (int, string) {
	t.Helper()
	req, err := http.NewRequest(method, url, nil)
	if err != nil {
		t.Fatal(err)
	}
	if host != "" {
		req.Host = host
	}
	for i := 0; i+1 < len(header); i += 2 {
		req.Header.Set(header[i], header[i+1])
	}
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	return resp.StatusCode, string(b)
}

// TestRefusesForeignHostsAndOtherSites: the page, served for real on
// loopback, answers 421 to a request naming another Host (DNS
// rebinding) and 403 to a request another site's page sent (Origin,
// Sec-Fetch-Site), asynqmon's writes never reached; its own origin is
// served. With a token, another site's GET link still opens the page
// and its writes are still refused: the browser sends the token's
// cookie by itself.
func TestRefusesForeignHostsAndOtherSites(t *testing.T) {
	now := time.Now()
	src := &source{rep: report.Report{At: now, Vendors: []report.VendorState{vendorAt("acme", now, 0)}}}
	for _, token := range []string{"", "s3cret"} {
		t.Run("token="+token, func(t *testing.T) {
			asynq := &asynqWrites{seen: map[string]int{}}
			s, err := New(Options{Source: src, Asynq: asynq, Token: token})
			if err != nil {
				t.Fatal(err)
			}
			srv := httptest.NewServer(s.Handler())
			defer srv.Close()
			auth := []string{}
			if token != "" {
				auth = []string{"Authorization", "Bearer " + token}
			}
			pause := srv.URL + "/asynq/api/queues/vendor:acme:pause"
			for _, host := range []string{"evil.example", "evil.example:" + strings.Split(srv.URL, ":")[2]} {
				if code, body := send(t, "GET", srv.URL+"/api/state", host, auth...); code != http.StatusMisdirectedRequest || !strings.Contains(body, host) {
					t.Errorf("GET with Host %s: %d %s, want 421 naming it", host, code, body)
				}
				if code, body := send(t, "POST", pause, host, auth...); code != http.StatusMisdirectedRequest {
					t.Errorf("POST with Host %s: %d %s, want 421", host, code, body)
				}
			}
			for _, h := range [][]string{{"Origin", "https://evil.example"}, {"Sec-Fetch-Site", "cross-site"}, {"Origin", "null"}} {
				if code, body := send(t, "POST", pause, "", append(h, auth...)...); code != http.StatusForbidden || !strings.Contains(body, "cross-site") {
					t.Errorf("POST with %s: %s: %d %s, want 403", h[0], h[1], code, body)
				}
				if code, body := send(t, "DELETE", srv.URL+"/asynq/api/queues/vendor:acme", "", append(h, auth...)...); code != http.StatusForbidden {
					t.Errorf("DELETE with %s: %s: %d %s, want 403", h[0], h[1], code, body)
				}
			}
			if n := asynq.count("POST") + asynq.count("DELETE"); n != 0 {
				t.Errorf("asynqmon got %d cross-site or misdirected writes", n)
			}
			if code, body := send(t, "POST", pause, "", append([]string{"Origin", srv.URL, "Sec-Fetch-Site", "same-origin"}, auth...)...); code != http.StatusNoContent || asynq.count("POST") != 1 {
				t.Errorf("POST from the page's own origin: %d %s, want it to reach asynqmon", code, body)
			}
			_, port, _ := strings.Cut(strings.TrimPrefix(srv.URL, "http://"), ":")
			if code, body := send(t, "GET", srv.URL+"/", "localhost:"+port, append([]string{"Sec-Fetch-Site", "cross-site", "Sec-Fetch-Mode", "navigate"}, auth...)...); code != http.StatusOK {
				t.Errorf("a link from another site to the page at localhost: %d %s, want 200", code, body)
			}
		})
	}
}
