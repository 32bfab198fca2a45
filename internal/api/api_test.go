package api

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"os"
	"sort"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/hibiken/asynq"

	"github.com/shaper-dev/shaper/internal/redistest"
	"github.com/shaper-dev/shaper/queue"
	"github.com/shaper-dev/shaper/shaper"
	"github.com/shaper-dev/shaper/vendorclients"
)

func TestMain(m *testing.M) { os.Exit(redistest.Main(m)) }

// vendor is a real HTTP vendor that answers 200 and counts each
// Idempotency-Key.
type vendor struct {
	mu   sync.Mutex
	keys map[string]int
	// hold, when set, is called with each call's key before the vendor
	// answers it (outside mu): a test holds a call at the vendor.
	hold func(key string)
	srv  *httptest.Server
}

func newVendor(t *testing.T) *vendor {
	v := &vendor{keys: map[string]int{}}
	v.srv = httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		key := r.Header.Get("Idempotency-Key")
		v.mu.Lock()
		v.keys[key]++
		hold := v.hold
		v.mu.Unlock()
		if hold != nil {
			hold(key)
		}
		w.Header().Set("Content-Type", "application/json")
		fmt.Fprint(w, `{"ok":true}`)
	}))
	t.Cleanup(v.srv.Close)
	return v
}

// setup is an API on a real Redis, for one vendor (at rate/s, queue_limit
// limit) and, when work, a worker that runs its calls until the test ends.
type setup struct {
	url    string
	vendor string
	client *queue.Client
	v      *vendor
}

// newSetup starts the API (its answers checked against openapi.json,
// checkedByOpenAPI) and the vendor; tweak, if given, changes the vendor's
// config (200 calls a second by default).
func newSetup(t *testing.T, o Options, limit int, work bool, tweak ...func(*queue.Vendor)) setup {
	t.Helper()
	v := newVendor(t)
	s := newSetupAt(t, o, v.srv.URL, limit, work, tweak...)
	s.v = v
	return s
}

// newSetupAt is newSetup for a vendor of the test's own at baseURL
// (setup.v is nil).
func newSetupAt(t *testing.T, o Options, baseURL string, limit int, work bool, tweak ...func(*queue.Vendor)) setup {
	t.Helper()
	rdb := redistest.Client(t)
	prefix := redistest.Prefix(t)
	name := "api-" + strings.ReplaceAll(prefix, ":", "-")
	vend := queue.Vendor{Endpoint: vendorclients.Endpoint{Name: name, BaseURL: baseURL, Timeout: 5 * time.Second},
		Policy: shaper.Policy{Limits: []shaper.Limit{{Rate: 200, Window: time.Second}}}, QueueLimit: limit}
	for _, f := range tweak {
		f(&vend)
	}
	c := queue.NewClient(rdb, queue.ClientConfig{Vendors: []queue.Vendor{vend}, KeyPrefix: prefix})
	t.Cleanup(func() { _ = c.Close() })
	if work {
		w, err := queue.NewWorker(rdb, queue.WorkerConfig{Vendors: []queue.Vendor{vend}, KeyPrefix: prefix})
		if err != nil {
			t.Fatal(err)
		}
		ctx, cancel := context.WithCancel(context.Background())
		done := make(chan error, 1)
		go func() { done <- w.Run(ctx) }()
		t.Cleanup(func() {
			cancel()
			if err := <-done; err != nil {
				t.Errorf("worker: %v", err)
			}
		})
	}
	o.Client = c
	srv := httptest.NewServer(checkedByOpenAPI(t, New(o)))
	t.Cleanup(srv.Close)
	return setup{url: srv.URL, vendor: name, client: c}
}

type answer struct {
	status int
	header http.Header
	body   []byte
}

func do(t *testing.T, method, url, ctype, token string, body []byte) answer {
	t.Helper()
	req, err := http.NewRequest(method, url, bytes.NewReader(body))
	if err != nil {
		t.Fatal(err)
	}
	if ctype != "" {
		req.Header.Set("Content-Type", ctype)
	}
	if token != "" {
		req.Header.Set("Authorization", "Bearer "+token)
	}
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	if err != nil {
		t.Fatal(err)
	}
	return answer{resp.StatusCode, resp.Header, b}
}

func ndjson(vendor string, ids ...string) []byte {
	var b bytes.Buffer
	for _, id := range ids {
		fmt.Fprintf(&b, `{"vendor":%q,"id":%q,"path":"/orders/%s"}`+"\n", vendor, id, id)
	}
	return b.Bytes()
}

// TestPostAndFollow: NDJSON of 50 calls is queued (202, the ids in their
// order); posting it again queues nothing and answers the same ids; a
// call without an id gets one; GET ?wait= holds until a call has ended
// and says how (completed, the vendor's status); the vendor saw every
// call once.
func TestPostAndFollow(t *testing.T) {
	s := newSetup(t, Options{}, 1000, true)
	var ids []string
	for i := range 50 {
		ids = append(ids, fmt.Sprintf("order-%d", i))
	}
	body := ndjson(s.vendor, ids...)
	for round, wantNew := range []int{50, 0} {
		a := do(t, "POST", s.url+"/v1/calls", "application/x-ndjson", "", body)
		if a.status != http.StatusAccepted {
			t.Fatalf("POST %d: %d %s", round+1, a.status, a.body)
		}
		var acc Accepted
		if err := json.Unmarshal(a.body, &acc); err != nil {
			t.Fatal(err)
		}
		if acc.Enqueued != wantNew || acc.AlreadyQueued != 50-wantNew || strings.Join(acc.IDs, ",") != strings.Join(ids, ",") {
			t.Fatalf("POST %d: %+v, want %d queued and the ids in order", round+1, acc, wantNew)
		}
	}
	one := do(t, "POST", s.url+"/v1/calls", "application/json", "", []byte(fmt.Sprintf("{\n  \"vendor\": %q,\n  \"path\": \"/ping\"\n}", s.vendor)))
	var acc Accepted
	if err := json.Unmarshal(one.body, &acc); one.status != http.StatusAccepted || err != nil || len(acc.IDs) != 1 || acc.IDs[0] == "" {
		t.Fatalf("one call without an id: %d %s", one.status, one.body)
	}
	last := do(t, "GET", s.url+"/v1/calls/"+ids[49]+"?wait=30s", "", "", nil)
	var e queue.Explanation
	if err := json.Unmarshal(last.body, &e); last.status != http.StatusOK || err != nil {
		t.Fatalf("GET: %d %s", last.status, last.body)
	}
	if e.State != "completed" || e.Status != http.StatusOK || e.TaskID != ids[49] || e.Body != `{"ok":true}` || e.Attempts != 1 {
		t.Fatalf("GET ?wait=30s: %+v, want completed with the vendor's 200, its body and 1 attempt", e)
	}
	for _, id := range ids[:49] { // each ended, in whatever order the workers took them
		var e queue.Explanation
		if a := do(t, "GET", s.url+"/v1/calls/"+id+"?wait=30s", "", "", nil); json.Unmarshal(a.body, &e) != nil || e.State != "completed" {
			t.Fatalf("GET %s ?wait=30s: %d %s", id, a.status, a.body)
		}
	}
	s.v.mu.Lock()
	defer s.v.mu.Unlock()
	for _, id := range ids {
		if n := s.v.keys[id]; n != 1 {
			t.Errorf("the vendor saw %s %d times, want once", id, n)
		}
	}
}

// TestRefusals: what the API refuses and how it says so; nothing of a
// refused body is queued.
func TestRefusals(t *testing.T) {
	s := newSetup(t, Options{MaxBody: 4096}, 3, false)
	for _, tc := range []struct {
		name, ctype string
		body        []byte
		status      int
		says        string
		line        int // a line the answer names (0: none)
	}{
		{"not JSON", "application/json", []byte(`{"vendor":`), http.StatusBadRequest, "not JSON", 0},
		{"an unknown vendor", "application/json", []byte(`{"vendor":"nope","path":"/x"}`), http.StatusBadRequest, `unknown vendor "nope"`, 1},
		{"a line without its path", "application/x-ndjson",
			[]byte(fmt.Sprintf("{\"vendor\":%q,\"path\":\"/a\"}\n{\"vendor\":%q}\n", s.vendor, s.vendor)), http.StatusBadRequest, `"path" is required`, 2},
		{"a line without its vendor", "application/x-ndjson", []byte(`{"path":"/a"}`), http.StatusBadRequest, `"vendor" is required`, 1},
		{"a good call, then one to an unknown vendor", "application/x-ndjson",
			[]byte(fmt.Sprintf("{\"vendor\":%q,\"path\":\"/a\"}\n{\"vendor\":\"nope\",\"path\":\"/b\"}\n", s.vendor)), http.StatusBadRequest, `unknown vendor "nope"`, 2},
		{"a body too large", "application/x-ndjson", bytes.Repeat(ndjson(s.vendor, "x"), 200), http.StatusRequestEntityTooLarge, "larger than 4096 bytes", 0},
		{"another media type", "text/plain", []byte("hi"), http.StatusUnsupportedMediaType, "application/x-ndjson", 0},
		{"a callback while callbacks are off", "application/x-ndjson",
			[]byte(fmt.Sprintf("{\"vendor\":%q,\"path\":\"/a\"}\n{\"vendor\":%q,\"path\":\"/b\",\"callback\":{\"url\":\"https://hooks.example.com/x\"}}\n", s.vendor, s.vendor)),
			http.StatusBadRequest, "callbacks are off in this config; list the receivers' URL prefixes in [callbacks] allow", 2},
		{"a callback that is not a URL", "application/json", []byte(fmt.Sprintf(`{"vendor":%q,"path":"/a","callback":{"url":"hooks"}}`, s.vendor)),
			http.StatusBadRequest, "want an absolute http or https URL", 1},
		{"more calls than the queue holds", "application/x-ndjson", ndjson(s.vendor, "a", "b", "c", "d"), http.StatusTooManyRequests, "full", 0},
	} {
		t.Run(tc.name, func(t *testing.T) {
			a := do(t, "POST", s.url+"/v1/calls", tc.ctype, "", tc.body)
			var refusal struct {
				Error string      `json:"error"`
				Lines []lineError `json:"lines"`
			}
			if err := json.Unmarshal(a.body, &refusal); err != nil {
				t.Fatalf("%d %s: not a JSON refusal: %v", a.status, a.body, err)
			}
			said := refusal.Error
			named := false
			for _, l := range refusal.Lines {
				said += "; " + l.Error
				named = named || l.Line == tc.line
			}
			if a.status != tc.status || !strings.Contains(said, tc.says) {
				t.Fatalf("%d %s, want %d saying %q", a.status, a.body, tc.status, tc.says)
			}
			if tc.line > 0 && !named {
				t.Errorf("%s does not name line %d", a.body, tc.line)
			}
			if tc.status == http.StatusTooManyRequests && a.header.Get("Retry-After") == "" {
				t.Error("a full queue's 429 without Retry-After")
			}
		})
	}
	if n, err := s.client.Waiting(context.Background(), s.vendor); err != nil || n != 0 {
		t.Fatalf("%d calls waiting after refused bodies (%v), want 0", n, err)
	}
	if a := do(t, "GET", s.url+"/v1/calls/never-queued", "", "", nil); a.status != http.StatusNotFound {
		t.Errorf("GET an unknown id: %d %s, want 404", a.status, a.body)
	}
	if a := do(t, "GET", s.url+"/v1/calls/x?wait=soon", "", "", nil); a.status != http.StatusBadRequest || !bytes.Contains(a.body, []byte("30s")) {
		t.Errorf("GET ?wait=soon: %d %s, want 400 saying how to write it", a.status, a.body)
	}
}

// TestToken: with a token, a request without it or with another is 401
// and queues nothing; with it, it is served.
func TestToken(t *testing.T) {
	s := newSetup(t, Options{Token: "s3cret"}, 10, false)
	body := ndjson(s.vendor, "t-1")
	for _, tok := range []string{"", "wrong"} {
		if a := do(t, "POST", s.url+"/v1/calls", "application/x-ndjson", tok, body); a.status != http.StatusUnauthorized || a.header.Get("WWW-Authenticate") == "" {
			t.Errorf("token %q: %d %s, want 401 with WWW-Authenticate", tok, a.status, a.body)
		}
	}
	if n, _ := s.client.Waiting(context.Background(), s.vendor); n != 0 {
		t.Fatalf("%d calls queued by unauthorized requests", n)
	}
	if a := do(t, "POST", s.url+"/v1/calls", "application/x-ndjson", "s3cret", body); a.status != http.StatusAccepted {
		t.Errorf("with the token: %d %s, want 202", a.status, a.body)
	}
}

// TestCancelCall: DELETE cancels a pending call (200, and it never
// reaches the vendor); a call at the vendor is 409 (started), a completed
// one 409 (finished); an unknown or cancelled id is 404. The vendor runs
// one call at a time and holds the first until the test lets it go.
func TestCancelCall(t *testing.T) {
	s := newSetup(t, Options{}, 100, true, func(v *queue.Vendor) { v.Concurrency = 1 })
	arrived, release := make(chan string, 1), make(chan struct{})
	s.v.mu.Lock()
	s.v.hold = func(key string) {
		if key == "held" {
			arrived <- key
			<-release
		}
	}
	s.v.mu.Unlock()
	var once sync.Once
	letGo := func() { once.Do(func() { close(release) }) }
	t.Cleanup(letGo)
	if a := do(t, "POST", s.url+"/v1/calls", "application/x-ndjson", "", ndjson(s.vendor, "held")); a.status != http.StatusAccepted {
		t.Fatalf("POST: %d %s", a.status, a.body)
	}
	select {
	case <-arrived:
	case <-time.After(30 * time.Second):
		t.Fatal("the first call did not reach the vendor in 30 s")
	}
	// The worker's one slot is taken: the next call stays pending.
	if a := do(t, "POST", s.url+"/v1/calls", "application/x-ndjson", "", ndjson(s.vendor, "later")); a.status != http.StatusAccepted {
		t.Fatalf("POST: %d %s", a.status, a.body)
	}
	a := do(t, "DELETE", s.url+"/v1/calls/later", "", "", nil)
	var got Cancelled
	if err := json.Unmarshal(a.body, &got); a.status != http.StatusOK || err != nil {
		t.Fatalf("DELETE a pending call: %d %s, want 200", a.status, a.body)
	}
	want := Cancelled{queue.Cancellation{TaskID: "later", Vendor: s.vendor, Lane: "normal", State: "pending"}, true}
	if got != want {
		t.Errorf("DELETE a pending call: %+v, want %+v", got, want)
	}
	for _, tc := range []struct {
		id     string
		status int
		says   string
	}{
		{"held", http.StatusConflict, "started"},
		{"later", http.StatusNotFound, "no such task"},
		{"never-queued", http.StatusNotFound, "no such task"},
	} {
		if a := do(t, "DELETE", s.url+"/v1/calls/"+tc.id, "", "", nil); a.status != tc.status || !bytes.Contains(a.body, []byte(tc.says)) {
			t.Errorf("DELETE %s: %d %s, want %d saying %q", tc.id, a.status, a.body, tc.status, tc.says)
		}
	}
	letGo()
	if a := do(t, "GET", s.url+"/v1/calls/held?wait=30s", "", "", nil); !bytes.Contains(a.body, []byte(`"state":"completed"`)) {
		t.Fatalf("GET held ?wait=30s: %d %s, want completed", a.status, a.body)
	}
	if a := do(t, "DELETE", s.url+"/v1/calls/held", "", "", nil); a.status != http.StatusConflict || !bytes.Contains(a.body, []byte("already finished")) {
		t.Errorf("DELETE a completed call: %d %s, want 409 saying it finished", a.status, a.body)
	}
	if n, err := s.client.Waiting(context.Background(), s.vendor); err != nil || n != 0 {
		t.Fatalf("%d calls waiting (%v), want 0", n, err)
	}
	s.v.mu.Lock()
	defer s.v.mu.Unlock()
	if s.v.keys["later"] != 0 || s.v.keys["held"] != 1 {
		t.Errorf("the vendor saw %v, want held once and not the cancelled call", s.v.keys)
	}
}

// TestThousandCallsInOnePost: 1,000 calls in one NDJSON POST are all
// queued and run, none twice; posting the same body again queues nothing.
// Safety only: no figure of time is asserted (make bench-api measures).
func TestThousandCallsInOnePost(t *testing.T) {
	s := newSetup(t, Options{}, 2000, true, func(v *queue.Vendor) { v.Policy.Limits[0].Rate = 2000 })
	ids := make([]string, 1000)
	for i := range ids {
		ids[i] = fmt.Sprintf("k-%04d", i)
	}
	body := ndjson(s.vendor, ids...)
	for round, wantNew := range []int{1000, 0} {
		a := do(t, "POST", s.url+"/v1/calls", "application/x-ndjson", "", body)
		var acc Accepted
		if err := json.Unmarshal(a.body, &acc); a.status != http.StatusAccepted || err != nil {
			t.Fatalf("POST %d: %d %s", round+1, a.status, a.body)
		}
		if acc.Enqueued != wantNew || acc.AlreadyQueued != 1000-wantNew || len(acc.IDs) != 1000 {
			t.Fatalf("POST %d: %d queued, %d already, %d ids; want %d queued", round+1, acc.Enqueued, acc.AlreadyQueued, len(acc.IDs), wantNew)
		}
	}
	deadline := time.Now().Add(60 * time.Second)
	for {
		n, err := s.client.Waiting(context.Background(), s.vendor)
		if err != nil {
			t.Fatal(err)
		}
		if n == 0 {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("%d calls still waiting after 60 s", n)
		}
		time.Sleep(50 * time.Millisecond)
	}
	if a := do(t, "POST", s.url+"/v1/calls", "application/x-ndjson", "", body); !bytes.Contains(a.body, []byte(`"enqueued":0`)) {
		t.Errorf("POST once every call completed: %d %.200s, want nothing queued", a.status, a.body)
	}
	s.v.mu.Lock()
	defer s.v.mu.Unlock()
	for _, id := range ids {
		if n := s.v.keys[id]; n != 1 {
			t.Errorf("the vendor saw %s %d times, want once", id, n)
		}
	}
	if len(s.v.keys) != len(ids) {
		t.Errorf("the vendor saw %d keys, want %d", len(s.v.keys), len(ids))
	}
}

// TestGetWhileTaken: GETs of a call that a worker takes at that moment
// answer 200 (pending, then running or completed), never an error for a
// call that changed state while it was read. Eight readers poll the head
// of the queue, the call taken next, moving on when it is taken.
func TestGetWhileTaken(t *testing.T) {
	s := newSetup(t, Options{}, 1000, true, func(v *queue.Vendor) { v.Policy.Limits[0].Rate = 200 })
	ids := make([]string, 200)
	for i := range ids {
		ids[i] = fmt.Sprintf("g-%03d", i)
	}
	if a := do(t, "POST", s.url+"/v1/calls", "application/x-ndjson", "", ndjson(s.vendor, ids...)); a.status != http.StatusAccepted {
		t.Fatalf("POST: %d %s", a.status, a.body)
	}
	var head atomic.Int64
	var wg sync.WaitGroup
	for range 8 {
		wg.Go(func() {
			for {
				i := head.Load()
				if i >= int64(len(ids)) {
					return
				}
				a := do(t, "GET", s.url+"/v1/calls/"+ids[i], "", "", nil)
				if a.status != http.StatusOK {
					t.Errorf("GET %s while a worker takes it: %d %s", ids[i], a.status, a.body)
					head.Store(int64(len(ids)))
					return
				}
				if !bytes.Contains(a.body, []byte(`"state":"pending"`)) {
					head.CompareAndSwap(i, i+1)
				}
			}
		})
	}
	wg.Wait()
}

// TestSameTaskAsEnqueueBatch is why the API adds nothing to the gate's cost
// per grant: a call posted to the API is queued as the very task
// queue.Client.EnqueueBatch writes for a Go caller (type, payload bytes,
// queue, retries, timeout, retention, header names), so the worker's gate
// cannot tell the two apart. Each of the call's fields is set.
func TestSameTaskAsEnqueueBatch(t *testing.T) {
	s := newSetup(t, Options{}, 100, false, func(v *queue.Vendor) { v.PerAccount = true })
	call := queue.Call{Vendor: s.vendor, ID: "same-1", Method: "POST", Path: "/orders/7",
		Headers: map[string]string{"X-Tenant": "t1"}, Body: json.RawMessage(`{"n":7}`),
		Account: "acct-1", Cost: 2, Priority: "high"}
	line, err := json.Marshal(call)
	if err != nil {
		t.Fatal(err)
	}
	if a := do(t, "POST", s.url+"/v1/calls", "application/json", "", line); a.status != http.StatusAccepted {
		t.Fatalf("POST: %d %s", a.status, a.body)
	}
	insp := asynq.NewInspectorFromRedisClient(redistest.Client(t))
	read := func() *asynq.TaskInfo {
		t.Helper()
		for _, q := range []string{queue.QueueName(s.vendor), queue.HighQueueName(s.vendor)} {
			if info, err := insp.GetTaskInfo(q, call.ID); err == nil {
				return info
			}
		}
		t.Fatalf("task %s is in neither of %s's queues", call.ID, s.vendor)
		return nil
	}
	viaAPI := read()
	if err := insp.DeleteTask(viaAPI.Queue, call.ID); err != nil {
		t.Fatal(err)
	}
	res, err := s.client.EnqueueBatch(context.Background(), s.vendor, []queue.Call{call})
	if err != nil || res.Enqueued != 1 {
		t.Fatalf("EnqueueBatch: %+v, %v", res, err)
	}
	viaGo := read()

	if viaAPI.Type != viaGo.Type || !bytes.Equal(viaAPI.Payload, viaGo.Payload) || viaAPI.Queue != viaGo.Queue ||
		viaAPI.MaxRetry != viaGo.MaxRetry || viaAPI.Timeout != viaGo.Timeout || viaAPI.Retention != viaGo.Retention ||
		viaAPI.State != viaGo.State {
		t.Errorf("the API queued another task than EnqueueBatch:\nAPI: %s %s %s retries=%d timeout=%v retention=%v %v\nGo:  %s %s %s retries=%d timeout=%v retention=%v %v",
			viaAPI.Type, viaAPI.Payload, viaAPI.Queue, viaAPI.MaxRetry, viaAPI.Timeout, viaAPI.Retention, viaAPI.State,
			viaGo.Type, viaGo.Payload, viaGo.Queue, viaGo.MaxRetry, viaGo.Timeout, viaGo.Retention, viaGo.State)
	}
	names := func(h map[string]string) []string {
		var n []string
		for k := range h {
			n = append(n, k)
		}
		sort.Strings(n)
		return n
	}
	if a, g := names(viaAPI.Headers), names(viaGo.Headers); fmt.Sprint(a) != fmt.Sprint(g) {
		t.Errorf("task headers: API %v, EnqueueBatch %v", a, g)
	}
}

// TestRefusesACallbackOutsideTheAllowList: with [callbacks] allow set, a
// body with one call whose callback is elsewhere queues nothing, and the
// answer names its line and the allow-list.
func TestRefusesACallbackOutsideTheAllowList(t *testing.T) {
	rdb := redistest.Client(t)
	prefix := redistest.Prefix(t)
	name := "api-" + strings.ReplaceAll(prefix, ":", "-")
	vend := queue.Vendor{Endpoint: vendorclients.Endpoint{Name: name, BaseURL: "http://127.0.0.1:9", Timeout: time.Second},
		Policy: shaper.Policy{Limits: []shaper.Limit{{Rate: 10, Window: time.Second}}}}
	c := queue.NewClient(rdb, queue.ClientConfig{Vendors: []queue.Vendor{vend}, KeyPrefix: prefix,
		CallbackAllow: []string{"https://hooks.example.com/shaper"}})
	t.Cleanup(func() { _ = c.Close() })
	srv := httptest.NewServer(checkedByOpenAPI(t, New(Options{Client: c})))
	t.Cleanup(srv.Close)

	body := fmt.Sprintf(`{"vendor":%q,"path":"/a","callback":{"url":"https://hooks.example.com/shaper/done"}}
{"vendor":%q,"path":"/b","callback":{"url":"https://hooks.example.com/shaperx"}}
{"vendor":%q,"path":"/c","callback":{"url":"https://evil.example.net/shaper"}}
`, name, name, name)
	a := do(t, "POST", srv.URL+"/v1/calls", "application/x-ndjson", "", []byte(body))
	var refusal struct {
		Lines []lineError `json:"lines"`
	}
	if err := json.Unmarshal(a.body, &refusal); err != nil || a.status != http.StatusBadRequest {
		t.Fatalf("%d %s, want 400 naming lines 2 and 3", a.status, a.body)
	}
	var named []int
	for _, l := range refusal.Lines {
		if !strings.Contains(l.Error, "not under any prefix of [callbacks] allow") {
			t.Errorf("line %d: %q, want it to name [callbacks] allow", l.Line, l.Error)
		}
		named = append(named, l.Line)
	}
	if fmt.Sprint(named) != "[2 3]" {
		t.Errorf("lines named %v, want [2 3] (a prefix matches at a path segment's end only): %s", named, a.body)
	}
	if n, err := c.Waiting(context.Background(), name); err != nil || n != 0 {
		t.Errorf("%d calls waiting after a refused body (%v), want 0", n, err)
	}
}
