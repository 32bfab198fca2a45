package queue

import (
	"context"
	"crypto/hmac"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"net/url"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/hibiken/asynq"

	"github.com/shaper-dev/shaper/internal/redistest"
)

func TestCallbackAllowList(t *testing.T) {
	allow := []string{"https://hooks.example.com/shaper", "http://127.0.0.1:9000/"}
	for _, c := range []struct {
		url string
		ok  bool
	}{
		{"https://hooks.example.com/shaper", true},
		{"https://hooks.example.com/shaper/orders?x=1", true},
		{"https://HOOKS.example.com/shaper/a", true},
		{"https://hooks.example.com/shaper-evil", false},
		{"https://hooks.example.com/", false},
		{"http://hooks.example.com/shaper", false},
		{"https://hooks.example.com.evil.test/shaper", false},
		{"https://hooks.example.com:8443/shaper", false},
		{"http://127.0.0.1:9000/anything", true},
		{"http://127.0.0.1:9001/anything", false},
	} {
		err := checkCallback(allow, &Callback{URL: c.url})
		if (err == nil) != c.ok {
			t.Errorf("%s: allowed %v, want %v (err %v)", c.url, err == nil, c.ok, err)
		}
		if err != nil && (!errors.Is(err, ErrBadCall) || !strings.Contains(err.Error(), "[callbacks] allow")) {
			t.Errorf("%s: %v: want ErrBadCall naming [callbacks] allow", c.url, err)
		}
	}
	for _, bad := range []string{"ftp://hooks.example.com/x", "/relative", "https://user:pw@hooks.example.com/shaper", "https://hooks.example.com/shaper#f"} {
		if err := checkCallback(allow, &Callback{URL: bad}); err == nil || !errors.Is(err, ErrBadCall) {
			t.Errorf("%s: %v, want ErrBadCall", bad, err)
		}
	}
	if err := checkCallback(nil, &Callback{URL: "https://hooks.example.com/shaper"}); err == nil || !strings.Contains(err.Error(), "callbacks are off") {
		t.Errorf("no allow-list: %v, want callbacks are off", err)
	}
	if err := checkCallbackConfig(CallbackConfig{Allow: allow}); err == nil || !strings.Contains(err.Error(), "secret") {
		t.Errorf("allow without secret: %v, want an error naming the secret", err)
	}
	if err := checkCallbackConfig(CallbackConfig{Allow: []string{"hooks.example.com"}, Secret: "s"}); err == nil {
		t.Error("an allow entry without a scheme was accepted")
	}
}

// verify is the receiver's check, written from the documented scheme
// alone (docs/callbacks.md), not from Verify: HMAC-SHA256 of "t.body"
// keyed by the secret, hex, in "t=...,v1=...".
func verify(secret string, r *http.Request, body []byte) error {
	var ts, sig string
	for _, kv := range strings.Split(r.Header.Get("Shaper-Signature"), ",") {
		if v, ok := strings.CutPrefix(kv, "t="); ok {
			ts = v
		}
		if v, ok := strings.CutPrefix(kv, "v1="); ok {
			sig = v
		}
	}
	m := hmac.New(sha256.New, []byte(secret))
	fmt.Fprintf(m, "%s.%s", ts, body)
	if want := hex.EncodeToString(m.Sum(nil)); ts == "" || sig != want {
		return fmt.Errorf("signature %q, want v1=%s", r.Header.Get("Shaper-Signature"), want)
	}
	return nil
}

func TestSignVerify(t *testing.T) {
	now := time.Unix(1_700_000_000, 0)
	body := []byte(`{"id":"a"}`)
	h := Sign("k", now, body)
	if err := Verify("k", h, body, 5*time.Minute, now.Add(time.Minute)); err != nil {
		t.Fatal(err)
	}
	r, _ := http.NewRequest("POST", "/", nil)
	r.Header.Set(SignatureHeader, h)
	if err := verify("k", r, body); err != nil {
		t.Errorf("the documented scheme disagrees with Sign: %v", err)
	}
	for name, err := range map[string]error{
		"body":   Verify("k", h, []byte(`{"id":"b"}`), 5*time.Minute, now),
		"secret": Verify("other", h, body, 5*time.Minute, now),
		"old":    Verify("k", h, body, 5*time.Minute, now.Add(6*time.Minute)),
		"header": Verify("k", "v1=00", body, 5*time.Minute, now),
	} {
		if !errors.Is(err, ErrBadSignature) {
			t.Errorf("%s: %v, want ErrBadSignature", name, err)
		}
	}
}

// receiver is a callback receiver that verifies each delivery, on a
// fixed address that can be taken down and brought back.
type receiver struct {
	t      *testing.T
	secret string
	addr   string
	mu     sync.Mutex
	got    map[string][]Outcome // by Idempotency-Key
	bad    []string
	hook   func(*http.Request) // called with each good delivery, under mu
	signed []signedDelivery    // the good deliveries, as received
	srv    *http.Server
}

// signedDelivery is a delivery as a receiver got it.
type signedDelivery struct{ signature, body string }

func newReceiver(t *testing.T, secret string) *receiver {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	r := &receiver{t: t, secret: secret, addr: ln.Addr().String(), got: map[string][]Outcome{}}
	r.serve(ln)
	t.Cleanup(r.down)
	return r
}

func (r *receiver) url() string { return "http://" + r.addr + "/hooks/shaper" }

func (r *receiver) serve(ln net.Listener) {
	r.srv = &http.Server{Handler: http.HandlerFunc(func(w http.ResponseWriter, req *http.Request) {
		body, _ := io.ReadAll(req.Body)
		r.mu.Lock()
		defer r.mu.Unlock()
		var o Outcome
		err := verify(r.secret, req, body)
		if err == nil {
			err = json.Unmarshal(body, &o)
		}
		if err != nil {
			r.bad = append(r.bad, err.Error())
			http.Error(w, err.Error(), http.StatusBadRequest)
			return
		}
		if key := req.Header.Get("Idempotency-Key"); key != o.ID {
			r.bad = append(r.bad, fmt.Sprintf("Idempotency-Key %q for call %q", key, o.ID))
		}
		r.got[o.ID] = append(r.got[o.ID], o)
		r.signed = append(r.signed, signedDelivery{req.Header.Get(SignatureHeader), string(body)})
		if r.hook != nil {
			r.hook(req)
		}
	})}
	go func() { _ = r.srv.Serve(ln) }()
}

func (r *receiver) down() { _ = r.srv.Close() }

func (r *receiver) up() {
	ln, err := net.Listen("tcp", r.addr)
	if err != nil {
		r.t.Fatalf("bring the receiver back on %s: %v", r.addr, err)
	}
	r.serve(ln)
}

func (r *receiver) received() int {
	r.mu.Lock()
	defer r.mu.Unlock()
	return len(r.got)
}

// runCallbacks queues n calls with a callback, every tenth refused by the
// vendor for good (400), with the receiver down for down first, and
// checks that every outcome arrives, signed, and that no call reached the
// vendor twice.
func runCallbacks(t *testing.T, n int, down time.Duration) {
	e := newEnv(t)
	const secret = "s3cret"
	var mu sync.Mutex
	seen := map[string]int{}
	v := e.vendor("cb", policy(500), 0, http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		mu.Lock()
		seen[r.Header.Get("Idempotency-Key")]++
		mu.Unlock()
		if strings.HasSuffix(r.URL.Path, "0") {
			http.Error(w, `{"error":"no such sku"}`, http.StatusBadRequest)
			return
		}
		w.WriteHeader(http.StatusCreated)
		fmt.Fprint(w, `{"ok":true}`)
	}))
	rc := newReceiver(t, secret)
	e.callbacks = CallbackConfig{Allow: []string{"http://" + rc.addr + "/hooks"}, Secret: secret}
	c := e.newClient()
	if _, err := c.Enqueue(context.Background(), Call{Vendor: v, Path: "/x", Callback: &Callback{URL: "http://" + rc.addr + "/elsewhere"}}); !errors.Is(err, ErrCallbackNotAllowed) {
		t.Fatalf("a callback outside the allow-list: %v, want ErrCallbackNotAllowed", err)
	}
	if down > 0 {
		rc.down()
	}
	calls := make([]Call, n)
	for i := range calls {
		calls[i] = Call{ID: fmt.Sprintf("cb-%04d", i), Method: "POST", Path: fmt.Sprintf("/orders/%d", i), Callback: &Callback{URL: rc.url()}}
	}
	queued := time.Now().Truncate(time.Microsecond)
	if _, err := c.EnqueueBatch(context.Background(), v, calls); err != nil {
		t.Fatal(err)
	}
	start := time.Now()
	e.startWorker(nil)
	if down > 0 {
		time.Sleep(down)
		rc.up()
	}
	waitFor(t, down+2*time.Minute, fmt.Sprintf("%d callbacks", n), func() bool { return rc.received() == n })
	t.Logf("%d callbacks received %.1fs after the worker started, the receiver down for the first %s", n, time.Since(start).Seconds(), down)
	rc.mu.Lock()
	defer rc.mu.Unlock()
	if len(rc.bad) > 0 {
		t.Fatalf("%d bad deliveries, the first: %s", len(rc.bad), rc.bad[0])
	}
	mu.Lock()
	defer mu.Unlock()
	for i := range calls {
		id := calls[i].ID
		if seen[id] != 1 {
			t.Errorf("call %s reached the vendor %d times, want once", id, seen[id])
		}
		o := rc.got[id][0]
		want, status := "completed", http.StatusCreated
		if strings.HasSuffix(calls[i].Path, "0") {
			want, status = "archived", http.StatusBadRequest
		}
		if o.Vendor != v || o.State != want || o.Status != status || o.Attempts != 1 || o.FinishedAt.IsZero() {
			t.Errorf("call %s: outcome %+v, want vendor %s, %s, HTTP %d, 1 attempt", id, o, v, want, status)
		}
		// Timings: queued during EnqueueBatch, sent once the worker ran,
		// finished after it was sent.
		if o.EnqueuedAt.Before(queued) || o.EnqueuedAt.After(start) || o.SentAt.Before(start) || o.FinishedAt.Before(o.SentAt) {
			t.Errorf("call %s: enqueued_at %s, sent_at %s, finished_at %s; want queued between %s and %s, sent after, finished last",
				id, o.EnqueuedAt.Format(time.StampMicro), o.SentAt.Format(time.StampMicro), o.FinishedAt.Format(time.StampMicro),
				queued.Format(time.StampMicro), start.Format(time.StampMicro))
		}
		if want == "archived" && !strings.Contains(o.Body, "no such sku") {
			t.Errorf("call %s: body %q, want the vendor's answer", id, o.Body)
		}
	}
}

func TestCallbacksDelivered(t *testing.T) { runCallbacks(t, 60, 2*time.Second) }

// TestLongCallbacksReceiverDown is issue 30's bar: 500 calls, the
// receiver down for 10 s.
func TestLongCallbacksReceiverDown(t *testing.T) {
	redistest.Long(t)
	runCallbacks(t, 500, 10*time.Second)
}

func TestCallbackConfigRefusedByTheWorker(t *testing.T) {
	e := newEnv(t)
	_, err := NewWorker(e.rdb(), WorkerConfig{KeyPrefix: e.prefix, Callbacks: CallbackConfig{Allow: []string{"https://hooks.example.com"}}})
	if err == nil || !strings.Contains(err.Error(), "secret") {
		t.Fatalf("callbacks without a secret: %v, want an error naming the secret", err)
	}
}

// TestCallbackJoinsTheTrace: a delivery is a span of the call's trace,
// under its run, and the receiver gets its traceparent.
func TestCallbackJoinsTheTrace(t *testing.T) {
	e := newEnv(t)
	col := newCollector(t)
	v := e.vendor("cbtrace", policy(100), 0, http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {}))
	const secret = "k"
	rc := newReceiver(t, secret)
	var traceparent string
	rc.mu.Lock()
	rc.hook = func(r *http.Request) { traceparent = r.Header.Get("traceparent") }
	rc.mu.Unlock()
	e.callbacks = CallbackConfig{Allow: []string{rc.url()}, Secret: secret}
	ctx, parent := col.tp.Tracer("test").Start(context.Background(), "enqueue")
	if _, err := e.newClient().Enqueue(ctx, Call{Vendor: v, Path: "/x", Callback: &Callback{URL: rc.url()}}); err != nil {
		t.Fatal(err)
	}
	parent.End()
	e.startTracedWorker(col.tp, nil)
	id := parent.SpanContext().TraceID()
	waitFor(t, 20*time.Second, "the delivery's span", func() bool { return len(named(col.inTrace(id), "shaper.callback")) == 1 })
	spans := col.inTrace(id)
	run := named(spans, callSpan+v)
	cb := named(spans, "shaper.callback")[0]
	if len(run) != 1 {
		t.Fatalf("%d runs of the call in its trace", len(run))
	}
	checkChild(t, cb, run[0])
	if got := attr(cb, "http.response.status_code").AsInt64(); got != http.StatusOK {
		t.Errorf("shaper.callback: status %d", got)
	}
	rc.mu.Lock()
	defer rc.mu.Unlock()
	if want := cb.SpanContext().SpanID().String(); !strings.Contains(traceparent, id.String()) || !strings.Contains(traceparent, want) {
		t.Errorf("the receiver's traceparent %q, want trace %s, span %s", traceparent, id, want)
	}
}

// TestCallbackPathsThatLeaveThePrefix: a callback URL whose path a
// receiver could resolve outside its allowed prefix (dot-segments, also
// percent-encoded or with ;parameters, encoded slashes, backslashes) is
// refused at enqueue, with an error naming the URL and the allow-list,
// and a delivery queued with one anyway (an older shaper, a task not
// queued through a Client) is archived by the worker, never sent.
func TestCallbackPathsThatLeaveThePrefix(t *testing.T) {
	var mu sync.Mutex
	var hits []string
	rc := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		mu.Lock()
		hits = append(hits, r.URL.RawPath+" "+r.URL.Path)
		mu.Unlock()
	}))
	t.Cleanup(rc.Close)
	allow := []string{rc.URL + "/hooks/"}
	bad := []string{
		rc.URL + "/hooks/../admin",
		rc.URL + "/hooks/%2e%2e/admin",
		rc.URL + "/hooks/%2E%2E/admin",
		rc.URL + "/hooks/.%2e/admin",
		rc.URL + "/hooks/..;/admin",
		rc.URL + "/hooks/./../admin",
		rc.URL + "/hooks/x/../../admin",
		rc.URL + "/hooks/..%2fadmin",
		rc.URL + "/hooks/..%2Fadmin",
		rc.URL + "/hooks/..%5cadmin",
		rc.URL + "/hooks/..\\admin",
	}
	for _, u := range bad {
		err := checkCallback(allow, &Callback{URL: u})
		if err == nil || !errors.Is(err, ErrBadCall) || !strings.Contains(err.Error(), fmt.Sprintf("%q", u)) || !strings.Contains(err.Error(), allow[0]) {
			t.Errorf("%s: %v, want ErrBadCall naming the URL and the allow-list", u, err)
		}
		if parsed, perr := url.Parse(u); perr == nil && allowed(allow, parsed) {
			t.Errorf("%s: allowed() says it is under %s", u, allow[0])
		}
	}
	for _, u := range []string{rc.URL + "/hooks/a..b", rc.URL + "/hooks/.well", rc.URL + "/hooks/x?next=../admin"} {
		if err := checkCallback(allow, &Callback{URL: u}); err != nil {
			t.Errorf("%s: %v, want it allowed (no dot-segment)", u, err)
		}
	}
	if err := checkCallbackConfig(CallbackConfig{Allow: []string{rc.URL + "/hooks/../"}, Secret: "k"}); err == nil {
		t.Error("an allowed prefix with a dot-segment was accepted")
	}

	// At enqueue, through a Client.
	e := newEnv(t)
	e.callbacks = CallbackConfig{Allow: allow, Secret: "k"}
	v := e.vendor("cbdots", policy(100), 0, http.HandlerFunc(func(http.ResponseWriter, *http.Request) {}))
	for _, u := range bad {
		_, err := e.newClient().Enqueue(context.Background(), Call{Vendor: v, Path: "/x", Callback: &Callback{URL: u}})
		if !errors.Is(err, ErrCallbackNotAllowed) || !strings.Contains(err.Error(), fmt.Sprintf("%q", u)) || !strings.Contains(err.Error(), allow[0]) {
			t.Errorf("enqueue with a callback to %s: %v, want ErrCallbackNotAllowed naming the URL and the allow-list", u, err)
		}
	}

	// At delivery: tasks queued past the Client.
	aq := asynq.NewClientFromRedisClient(e.rdb())
	t.Cleanup(func() { _ = aq.Close() })
	var ids []string
	for i, u := range bad {
		payload, _ := json.Marshal(callbackTask{URL: u, Body: json.RawMessage(`{"id":"x"}`)})
		id := fmt.Sprintf("v:dot-%d", i)
		if _, err := aq.Enqueue(asynq.NewTask(TypeCallback, payload), asynq.Queue(CallbackQueueName(e.prefix)), asynq.TaskID(id), asynq.MaxRetry(3), asynq.Retention(time.Hour)); err != nil {
			t.Fatal(err)
		}
		ids = append(ids, id)
	}
	e.startWorker(nil)
	insp := asynq.NewInspectorFromRedisClient(e.rdb())
	for i, id := range ids {
		var info *asynq.TaskInfo
		waitFor(t, 20*time.Second, "delivery "+id+" to end", func() bool {
			var err error
			info, err = insp.GetTaskInfo(CallbackQueueName(e.prefix), id)
			return err == nil && (info.State == asynq.TaskStateArchived || info.State == asynq.TaskStateCompleted)
		})
		if info.State != asynq.TaskStateArchived {
			t.Errorf("delivery to %s: %s, want archived unsent", bad[i], info.State)
		}
		if !strings.Contains(info.LastErr, "segment") && !strings.Contains(info.LastErr, "slash") {
			t.Errorf("delivery to %s archived with %q, want the path's problem named", bad[i], info.LastErr)
		}
	}
	mu.Lock()
	defer mu.Unlock()
	if len(hits) > 0 {
		t.Errorf("the receiver was called at %q", hits)
	}
}

// TestCallbackSentAtIsWhenTheCallWentOut: calls queued together to a
// vendor at 5/s wait for their ticks in the worker (the k-th at least k
// x 200 ms after they were queued); each one's sent_at is when its
// request went out after that wait, not when the worker took it: no
// later than the vendor received it, and the k-th no earlier than k
// intervals after the calls were queued.
func TestCallbackSentAtIsWhenTheCallWentOut(t *testing.T) {
	e := newEnv(t)
	const n, rate = 6, 5
	var mu sync.Mutex
	received := map[string]time.Time{}
	v := e.vendor("sentat", policy(rate), 0, http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		at := time.Now()
		mu.Lock()
		received[r.Header.Get("Idempotency-Key")] = at
		mu.Unlock()
	}))
	e.vendors[0].Concurrency = 2 * n // every call is taken at once and waits for its tick in the worker
	rc := newReceiver(t, "k")
	e.callbacks = CallbackConfig{Allow: []string{rc.url()}, Secret: "k"}
	c := e.newClient()
	calls := make([]Call, n)
	for i := range calls {
		calls[i] = Call{ID: fmt.Sprintf("sent-%d", i), Path: "/x", Callback: &Callback{URL: rc.url()}}
	}
	queued := time.Now()
	if _, err := c.EnqueueBatch(context.Background(), v, calls); err != nil {
		t.Fatal(err)
	}
	e.startWorker(nil)
	waitFor(t, 30*time.Second, "the callbacks", func() bool { return rc.received() == n })
	rc.mu.Lock()
	defer rc.mu.Unlock()
	mu.Lock()
	defer mu.Unlock()
	var sent []time.Time
	for _, call := range calls {
		o := rc.got[call.ID][0]
		got, at := o.SentAt, received[call.ID]
		if got.IsZero() || got.After(at) {
			t.Errorf("call %s: sent_at %s, the vendor received it at %s: want sent_at no later", call.ID, got.Format(time.StampMicro), at.Format(time.StampMicro))
		}
		sent = append(sent, got)
	}
	slices.SortFunc(sent, time.Time.Compare)
	interval := time.Second / rate
	for k, s := range sent {
		if earliest := queued.Add(time.Duration(k) * interval); s.Before(earliest) {
			t.Errorf("call %d to go out has sent_at %s, %s after the calls were queued: before its tick could come (%s after)",
				k+1, s.Format(time.StampMicro), s.Sub(queued).Round(time.Millisecond), time.Duration(k)*interval)
		}
	}
}

// newCallbackClient is a client whose allow-list is e.callbacks' prefixes
// (receivers' included).
func (e *env) newCallbackClient() *Client {
	c := NewClient(e.rdb(), ClientConfig{Vendors: e.vendors, KeyPrefix: e.prefix, CallbackAllow: e.callbacks.Prefixes()})
	e.t.Cleanup(func() { _ = c.Close() })
	return c
}

// TestCallbackSecretForTheLongestPrefix: a delivery is signed with the
// secret of the longest prefix its URL is under.
func TestCallbackSecretForTheLongestPrefix(t *testing.T) {
	cfg := CallbackConfig{
		Allow:     []string{"https://a.example/", "https://c.example/hooks"},
		Secret:    "default",
		Receivers: []CallbackReceiver{{"https://a.example/hooks/", "a"}, {"https://a.example/hooks/b", "b"}, {"https://c.example/hooks", "c"}},
	}
	for raw, want := range map[string]string{
		"https://a.example/other":      "default",
		"https://a.example/hooks":      "a",
		"https://a.example/hooks/x":    "a",
		"https://a.example/hooks/b":    "b",
		"https://a.example/hooks/b/1":  "b",
		"https://a.example/hooks/bb":   "a",
		"https://c.example/hooks/z":    "c", // a receiver's secret beats allow's for the same prefix
		"https://d.example/hooks/z":    "",
		"https://a.example/hooks/../b": "",
	} {
		u, _ := url.Parse(raw)
		got, ok := cfg.secretFor(u)
		if got != want || ok != (want != "") {
			t.Errorf("%s: secret %q (%v), want %q", raw, got, ok, want)
		}
	}
	for _, bad := range []CallbackConfig{
		{Receivers: []CallbackReceiver{{"https://a.example/hooks", ""}}},
		{Receivers: []CallbackReceiver{{"https://a.example/hooks", "a"}, {"https://a.example/hooks", "b"}}},
		{Receivers: []CallbackReceiver{{"a.example/hooks", "a"}}},
		{Allow: []string{"https://a.example/"}, Receivers: []CallbackReceiver{{"https://a.example/hooks", "a"}}},
	} {
		if err := checkCallbackConfig(bad); err == nil {
			t.Errorf("%+v accepted", bad)
		}
	}
	if err := checkCallbackConfig(CallbackConfig{Receivers: []CallbackReceiver{{"https://a.example/hooks", "a"}}}); err != nil {
		t.Errorf("receivers alone, each with its secret: %v", err)
	}
}

// TestCallbackSecretPerReceiver: two receivers with secrets of their
// own and one under the default secret each verify their deliveries with
// their secret, and a delivery to one does not verify with another's: a
// receiver cannot sign (forge) for another.
func TestCallbackSecretPerReceiver(t *testing.T) {
	e := newEnv(t)
	v := e.vendor("cbsecrets", policy(100), 0, http.HandlerFunc(func(http.ResponseWriter, *http.Request) {}))
	secrets := map[string]string{"a": "secret-of-a", "b": "secret-of-b", "c": "the-default"}
	rcs := map[string]*receiver{}
	for name, s := range secrets {
		rcs[name] = newReceiver(t, s)
	}
	e.callbacks = CallbackConfig{
		// a's whole origin is allowed under the default secret; its
		// receiver prefix, longer, has its own.
		Allow:  []string{"http://" + rcs["c"].addr + "/hooks", "http://" + rcs["a"].addr + "/"},
		Secret: secrets["c"],
		Receivers: []CallbackReceiver{
			{Prefix: "http://" + rcs["a"].addr + "/hooks", Secret: secrets["a"]},
			{Prefix: "http://" + rcs["b"].addr + "/hooks/", Secret: secrets["b"]},
		},
	}
	c := e.newCallbackClient()
	const each = 3
	for name, rc := range rcs {
		for i := range each {
			if _, err := c.Enqueue(context.Background(), Call{ID: fmt.Sprintf("%s-%d", name, i), Vendor: v, Path: "/x", Callback: &Callback{URL: rc.url()}}); err != nil {
				t.Fatal(err)
			}
		}
	}
	e.startWorker(nil)
	for name, rc := range rcs {
		waitFor(t, 30*time.Second, "the callbacks to "+name, func() bool {
			rc.mu.Lock()
			defer rc.mu.Unlock()
			return len(rc.got) == each || len(rc.bad) > 0
		})
	}
	now := time.Now()
	for name, rc := range rcs {
		rc.mu.Lock()
		if len(rc.bad) > 0 {
			t.Errorf("receiver %s could not verify a delivery with its secret: %s", name, rc.bad[0])
		}
		for _, d := range rc.signed {
			if err := Verify(secrets[name], d.signature, []byte(d.body), time.Minute, now); err != nil {
				t.Errorf("receiver %s: %v", name, err)
			}
			for other, s := range secrets {
				if other != name && Verify(s, d.signature, []byte(d.body), time.Minute, now) == nil {
					t.Errorf("a delivery to %s verifies with %s's secret: %s could sign for %s", name, other, other, name)
				}
			}
		}
		rc.mu.Unlock()
	}
}

// TestCallbacksReload: a running worker takes an edit of [callbacks] at
// once. A receiver removed while a delivery to it waits for a retry
// (the receiver was down) never receives it: the delivery is archived,
// naming its URL; a receiver whose secret changed gets the next
// deliveries signed with the new one; the notes name what changed and no
// secret.
func TestCallbacksReload(t *testing.T) {
	e := newEnv(t)
	v := e.vendor("cbreload", policy(100), 0, http.HandlerFunc(func(http.ResponseWriter, *http.Request) {}))
	ra, rb := newReceiver(t, "a-first"), newReceiver(t, "b-secret")
	prefixA, prefixB := "http://"+ra.addr+"/hooks", "http://"+rb.addr+"/hooks"
	e.callbacks = CallbackConfig{Receivers: []CallbackReceiver{{prefixA, "a-first"}, {prefixB, "b-secret"}}}
	c := e.newCallbackClient()
	enqueue := func(id string, rc *receiver) {
		t.Helper()
		if _, err := c.Enqueue(context.Background(), Call{ID: id, Vendor: v, Path: "/x", Callback: &Callback{URL: rc.url()}}); err != nil {
			t.Fatal(err)
		}
	}
	var w *Worker
	e.startWorker(func(x *Worker) { w = x })
	enqueue("a-1", ra)
	enqueue("b-1", rb)
	waitFor(t, 30*time.Second, "the first callbacks", func() bool { return ra.received() == 1 && rb.received() == 1 })

	rb.down()
	enqueue("b-2", rb)
	insp := asynq.NewInspectorFromRedisClient(e.rdb())
	delivery := v + ":b-2"
	waitFor(t, 30*time.Second, "the delivery to the receiver that is down to fail once", func() bool {
		info, err := insp.GetTaskInfo(CallbackQueueName(e.prefix), delivery)
		return err == nil && info.State == asynq.TaskStateRetry
	})
	notes, err := w.ApplyCallbacks(CallbackConfig{Receivers: []CallbackReceiver{{prefixA, "a-second"}}})
	if err != nil {
		t.Fatal(err)
	}
	text := strings.Join(notes, "\n")
	for _, want := range []string{"receiver " + prefixB + " removed", "receiver " + prefixA + ": its secret changed"} {
		if !strings.Contains(text, want) {
			t.Errorf("notes %q, want %q", notes, want)
		}
	}
	for _, s := range []string{"a-first", "a-second", "b-secret"} {
		if strings.Contains(text, s) {
			t.Errorf("the notes name a secret: %q", notes)
		}
	}
	rb.up()
	ra.mu.Lock()
	ra.secret = "a-second"
	ra.mu.Unlock()
	enqueue("a-2", ra)
	var info *asynq.TaskInfo
	waitFor(t, 30*time.Second, "the delivery to the removed receiver to end", func() bool {
		info, err = insp.GetTaskInfo(CallbackQueueName(e.prefix), delivery)
		return err == nil && (info.State == asynq.TaskStateArchived || info.State == asynq.TaskStateCompleted)
	})
	if info.State != asynq.TaskStateArchived || !strings.Contains(info.LastErr, rb.url()) || !strings.Contains(info.LastErr, "not sent") {
		t.Errorf("the delivery to the removed receiver: %s, %q; want archived, naming its URL, not sent", info.State, info.LastErr)
	}
	waitFor(t, 30*time.Second, "the callback to a after the reload", func() bool { return ra.received() == 2 })
	if n := rb.received(); n != 1 {
		t.Errorf("the removed receiver got %d callbacks, want only the one before the reload", n)
	}
	ra.mu.Lock()
	defer ra.mu.Unlock()
	if len(ra.bad) > 0 {
		t.Errorf("after the reload a could not verify with its new secret: %s", ra.bad[0])
	}
}
