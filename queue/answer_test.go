package queue

import (
	"bytes"
	"context"
	"encoding/base64"
	"encoding/json"
	"fmt"
	"net/http"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"
)

// answerVendor is a vendor whose every answer the test chose: the body
// and status by path, and what it sent, by Idempotency-Key, for a test
// to compare with what was kept.
type answerVendor struct {
	mu    sync.Mutex
	sent  map[string][]byte // body of the last answer to each key
	tries map[string]int    // requests per key
	token string            // the vendor's Authorization token, echoed by /echo
}

func newAnswerVendor(token string) *answerVendor {
	return &answerVendor{sent: map[string][]byte{}, tries: map[string]int{}, token: token}
}

// json4k is a compact 4,096-byte JSON answer naming id.
func json4k(id string) []byte {
	head := `{"id":"` + id + `","waybill":"WB-` + id + `","pad":"`
	tail := `"}`
	return []byte(head + strings.Repeat("x", 4096-len(head)-len(tail)) + tail)
}

// straddleBody is 2 MiB of text with token starting 6 bytes before the
// 1 MiB cut, so that the cut falls inside it.
func straddleBody(token string) []byte {
	b := bytes.Repeat([]byte("a"), 2<<20)
	copy(b[DefaultMaxAnswer-6:], token)
	return b
}

// binaryBody is not UTF-8.
var binaryBody = []byte{0xff, 0x00, 0xfe, 0x01, 0x80, 0x81, 'z', 0xc3}

func (v *answerVendor) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	key := r.Header.Get("Idempotency-Key")
	v.mu.Lock()
	v.tries[key]++
	try := v.tries[key]
	v.mu.Unlock()
	w.Header().Set("X-Request-Id", "req-"+key)
	w.Header().Set("X-Other", "not kept")
	status, body := http.StatusOK, []byte(nil)
	switch p := strings.TrimPrefix(r.URL.Path, "/api"); p {
	case "/json4k":
		w.Header().Set("Content-Type", "application/json")
		body = json4k(key)
	case "/big":
		w.Header().Set("Content-Type", "text/plain")
		body = straddleBody(v.token)
	case "/echo":
		// Echoes the vendor's Authorization, the call's own header and
		// its query, in the body and in a kept header.
		w.Header().Set("Content-Type", "application/json")
		w.Header().Set("X-Request-Id", "req-"+r.Header.Get("X-Customer-Token"))
		body, _ = json.Marshal(map[string]string{"auth": r.Header.Get("Authorization"), "token": v.token,
			"customer": r.Header.Get("X-Customer-Token"), "query": r.URL.RawQuery})
	case "/html":
		// Pretty-printed, with characters json.Marshal escapes for HTML.
		w.Header().Set("Content-Type", "application/json")
		body = []byte("{\n  \"next\": \"https://x.test/o?a=1&b=2\",\n  \"note\": \"<b>\"\n}\n")
	case "/text":
		w.Header().Set("Content-Type", "text/plain; charset=utf-8")
		body = []byte("waybill WB-1 for wörld\nsecond line")
	case "/binary":
		w.Header().Set("Content-Type", "application/octet-stream")
		body = binaryBody
	case "/flaky":
		if try == 1 {
			status, body = http.StatusServiceUnavailable, []byte(`{"error":"busy"}`)
		} else {
			body = []byte(`{"ok":true,"try":` + fmt.Sprint(try) + `}`)
		}
	case "/invalid":
		status, body = http.StatusUnprocessableEntity, []byte(`{"error":"order `+key+` has no address"}`)
	default:
		status, body = http.StatusNotFound, []byte("no such path "+p)
	}
	v.mu.Lock()
	v.sent[key] = body
	v.mu.Unlock()
	w.Header().Set("Content-Length", fmt.Sprint(len(body)))
	w.WriteHeader(status)
	_, _ = w.Write(body)
}

func (v *answerVendor) sentTo(key string) ([]byte, int) {
	v.mu.Lock()
	defer v.mu.Unlock()
	return v.sent[key], v.tries[key]
}

// taskEnd waits until the task id of vendor has ended (completed or
// archived) and returns that state.
func taskEnd(t *testing.T, rdb *redis.Client, vendor, id string) string {
	t.Helper()
	var state string
	waitFor(t, time.Minute, "call "+id+" to end", func() bool {
		state, _ = rdb.HGet(context.Background(), asynqTaskKey(QueueName(vendor), id), "state").Result()
		return state == "completed" || state == "archived"
	})
	return state
}

// storedAnswer reads the answer a call keeps: its task's result.
func storedAnswer(t *testing.T, rdb *redis.Client, vendor, id string) (CallResult, []byte) {
	t.Helper()
	raw, err := rdb.HGet(context.Background(), asynqTaskKey(QueueName(vendor), id), "result").Bytes()
	if err != nil {
		t.Fatalf("read the result of %s: %v", id, err)
	}
	var res CallResult
	if err := json.Unmarshal(raw, &res); err != nil {
		t.Fatalf("result of %s is not a CallResult: %v: %.200s", id, err, raw)
	}
	return res, raw
}

// dropKeysAtEnd deletes the test's keys when it ends (its answers can
// weigh megabytes in a shared Redis): register it before the worker
// starts, so that it runs after the worker stopped.
func dropKeysAtEnd(t *testing.T, rdb *redis.Client, prefix string, vendors ...string) {
	t.Helper()
	t.Cleanup(func() {
		ctx := context.Background()
		patterns := []string{prefix + ":*"}
		for _, v := range vendors {
			patterns = append(patterns, "asynq:{"+QueueName(v)+"}*", "asynq:{"+HighQueueName(v)+"}*")
		}
		for _, p := range patterns {
			iter := rdb.Scan(ctx, 0, p, 1000).Iterator()
			var keys []string
			for iter.Next(ctx) {
				keys = append(keys, iter.Val())
				if len(keys) == 500 {
					rdb.Unlink(ctx, keys...)
					keys = keys[:0]
				}
			}
			if len(keys) > 0 {
				rdb.Unlink(ctx, keys...)
			}
		}
	})
}

// TestAnswersKeptWhole runs calls whose answers are JSON, text, binary,
// cut, echoed secrets, a retry and a refusal through a worker, and reads
// what each call keeps as its result. It measures what a kept 4 KB
// answer costs in Redis memory (MEMORY USAGE of the task hash) against a
// call whose vendor keeps no body.
func TestAnswersKeptWhole(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	const token = "tok-3f9c2a7e51d04b68"
	vend := newAnswerVendor(token)
	kept := e.vendor("answers", policy(200), 0, vend)
	e.vendors[len(e.vendors)-1].Headers = map[string]string{"Authorization": "Bearer " + token}
	e.vendors[len(e.vendors)-1].KeepHeaders = []string{"x-request-id", "Content-Type"}
	noneVend := newAnswerVendor(token)
	none := e.vendor("noanswer", policy(200), 0, noneVend)
	e.vendors[len(e.vendors)-1].MaxAnswer = NoAnswerBody
	e.vendors[len(e.vendors)-1].KeepHeaders = []string{"X-Request-Id"}
	c := e.newClient()
	rdb := e.rdb()
	dropKeysAtEnd(t, rdb, e.prefix, kept, none)
	ctx := context.Background()
	calls := []Call{
		{ID: kept + "-json", Path: "/json4k"},
		{ID: kept + "-big", Path: "/big"},
		{ID: kept + "-echo", Path: "/echo?api_key=qk-secret-4561", Headers: map[string]string{"X-Customer-Token": "cust-secret-123"}},
		{ID: kept + "-text", Path: "/text"},
		{ID: kept + "-html", Path: "/html"},
		{ID: kept + "-binary", Path: "/binary"},
		{ID: kept + "-flaky", Path: "/flaky"},
		{ID: kept + "-invalid", Path: "/invalid"},
	}
	for _, call := range calls {
		call.Vendor = kept
		if _, err := c.Enqueue(ctx, call); err != nil {
			t.Fatal(err)
		}
	}
	if _, err := c.Enqueue(ctx, Call{Vendor: none, ID: none + "-json", Path: "/json4k"}); err != nil {
		t.Fatal(err)
	}
	e.startWorker(nil)

	t.Run("json", func(t *testing.T) {
		id := kept + "-json"
		if st := taskEnd(t, rdb, kept, id); st != "completed" {
			t.Fatalf("state %s, want completed", st)
		}
		res, _ := storedAnswer(t, rdb, kept, id)
		sent, _ := vend.sentTo(id)
		if !bytes.Equal(res.Body, sent) {
			t.Errorf("kept body (%d bytes) differs from the %d the vendor sent:\n%.120s\n%.120s", len(res.Body), len(sent), res.Body, sent)
		}
		if res.Status != 200 || res.Cut || res.Bytes != 4096 || res.Text != "" || res.Base64 != "" {
			t.Errorf("answer status %d cut %v bytes %d text %q base64 %q; want 200, whole, 4096 bytes, as JSON", res.Status, res.Cut, res.Bytes, res.Text, res.Base64)
		}
		want := map[string]string{"X-Request-Id": "req-" + id, "Content-Type": "application/json"}
		if fmt.Sprint(res.Headers) != fmt.Sprint(want) {
			t.Errorf("kept headers %v, want only %v (keep_headers)", res.Headers, want)
		}
	})

	t.Run("cut", func(t *testing.T) {
		id := kept + "-big"
		taskEnd(t, rdb, kept, id)
		res, raw := storedAnswer(t, rdb, kept, id)
		if !res.Cut || res.Bytes != 2<<20 || len(res.Body) != 0 {
			t.Errorf("cut %v, bytes %d, json body %d bytes; want cut, 2 MiB sent, kept as text", res.Cut, res.Bytes, len(res.Body))
		}
		// The token starts 6 bytes before the cut: it is replaced whole,
		// and no part of it is kept.
		wantText := strings.Repeat("a", DefaultMaxAnswer-6) + redactedMark
		if res.Text != wantText {
			t.Errorf("kept text: %d bytes ending %q; want %d bytes ending %q", len(res.Text), tail(res.Text, 30), len(wantText), tail(wantText, 30))
		}
		if bytes.Contains(raw, []byte(token[:minSecret])) {
			t.Errorf("the stored answer holds a part of the vendor's token")
		}
	})

	t.Run("secrets", func(t *testing.T) {
		id := kept + "-echo"
		taskEnd(t, rdb, kept, id)
		res, raw := storedAnswer(t, rdb, kept, id)
		for _, s := range []string{token, "cust-secret-123", "qk-secret-4561"} {
			if bytes.Contains(raw, []byte(s)) {
				t.Errorf("the stored answer holds secret %q: %s", s, raw)
			}
		}
		var body map[string]string
		if err := json.Unmarshal(res.Body, &body); err != nil {
			t.Fatalf("redacted body is not kept as JSON: %v: %s", err, raw)
		}
		want := map[string]string{"auth": redactedMark, "token": redactedMark, "customer": redactedMark, "query": "api_key=" + redactedMark}
		if fmt.Sprint(body) != fmt.Sprint(want) {
			t.Errorf("kept body %v, want %v", body, want)
		}
		if got := res.Headers["X-Request-Id"]; got != "req-"+redactedMark {
			t.Errorf("kept header X-Request-Id %q, want the call's secret redacted", got)
		}
	})

	t.Run("json as sent", func(t *testing.T) {
		// A JSON body is kept as JSON: what the vendor sent, compacted (a
		// result line is one line), with no HTML escaping (& < > as sent).
		id := kept + "-html"
		taskEnd(t, rdb, kept, id)
		res, _ := storedAnswer(t, rdb, kept, id)
		sent, _ := vend.sentTo(id)
		var got, want any
		if err := json.Unmarshal(res.Body, &got); err != nil {
			t.Fatalf("kept body is not JSON: %v: %s", err, res.Body)
		}
		_ = json.Unmarshal(sent, &want)
		if fmt.Sprint(got) != fmt.Sprint(want) || res.Bytes != int64(len(sent)) {
			t.Errorf("kept %s (%d bytes sent), want %s (%d bytes)", res.Body, res.Bytes, sent, len(sent))
		}
		var compact bytes.Buffer
		_ = json.Compact(&compact, sent)
		if !bytes.Equal(res.Body, compact.Bytes()) {
			t.Errorf("kept body %s, want the vendor's compacted byte for byte: %s", res.Body, compact.Bytes())
		}
	})

	t.Run("text", func(t *testing.T) {
		id := kept + "-text"
		taskEnd(t, rdb, kept, id)
		res, _ := storedAnswer(t, rdb, kept, id)
		sent, _ := vend.sentTo(id)
		if res.Text != string(sent) || len(res.Body) != 0 || res.Base64 != "" || res.Cut {
			t.Errorf("text answer kept as body %q text %q base64 %q; want text %q", res.Body, res.Text, res.Base64, sent)
		}
	})

	t.Run("binary", func(t *testing.T) {
		id := kept + "-binary"
		taskEnd(t, rdb, kept, id)
		res, _ := storedAnswer(t, rdb, kept, id)
		got, err := base64.StdEncoding.DecodeString(res.Base64)
		if err != nil || !bytes.Equal(got, binaryBody) || res.Text != "" || len(res.Body) != 0 || res.Bytes != int64(len(binaryBody)) {
			t.Errorf("binary answer kept as base64 %q (%v), text %q, bytes %d; want %x", res.Base64, err, res.Text, res.Bytes, binaryBody)
		}
	})

	t.Run("retried", func(t *testing.T) {
		id := kept + "-flaky"
		if st := taskEnd(t, rdb, kept, id); st != "completed" {
			t.Fatalf("state %s, want completed after a 503 and a 200", st)
		}
		res, _ := storedAnswer(t, rdb, kept, id)
		sent, tries := vend.sentTo(id)
		if tries != 2 || res.Status != 200 || !bytes.Equal(res.Body, sent) {
			t.Errorf("after %d tries kept status %d body %s; want the 200's answer %s after 2 tries", tries, res.Status, res.Body, sent)
		}
	})

	t.Run("refused", func(t *testing.T) {
		id := kept + "-invalid"
		if st := taskEnd(t, rdb, kept, id); st != "archived" {
			t.Fatalf("state %s, want archived (a 422 is not retried)", st)
		}
		res, _ := storedAnswer(t, rdb, kept, id)
		sent, tries := vend.sentTo(id)
		if tries != 1 || res.Status != 422 || !bytes.Equal(res.Body, sent) {
			t.Errorf("after %d tries kept status %d body %s; want the 422's answer %s after 1 try", tries, res.Status, res.Body, sent)
		}
	})

	t.Run("no body", func(t *testing.T) {
		id := none + "-json"
		taskEnd(t, rdb, none, id)
		res, raw := storedAnswer(t, rdb, none, id)
		want := CallResult{Status: 200, Headers: map[string]string{"X-Request-Id": "req-" + id}, Bytes: 4096}
		if res.Status != want.Status || fmt.Sprint(res.Headers) != fmt.Sprint(want.Headers) || res.Bytes != want.Bytes ||
			len(res.Body) != 0 || res.Text != "" || res.Base64 != "" || res.Cut {
			t.Errorf("max_answer = none kept %s; want the status, X-Request-Id and bytes only", raw)
		}
	})

	t.Run("redis memory", func(t *testing.T) {
		withBody, withoutBody := kept+"-json", none+"-json"
		taskEnd(t, rdb, kept, withBody)
		taskEnd(t, rdb, none, withoutBody)
		usage := func(vendor, id string) (mem, result int64) {
			key := asynqTaskKey(QueueName(vendor), id)
			mem, err := rdb.MemoryUsage(ctx, key, 0).Result()
			if err != nil {
				t.Fatalf("MEMORY USAGE %s: %v", key, err)
			}
			result, _ = rdb.HStrLen(ctx, key, "result").Result()
			return mem, result
		}
		memKept, resKept := usage(kept, withBody)
		memNone, resNone := usage(none, withoutBody)
		t.Logf("Redis memory of a completed call's task hash (MEMORY USAGE key SAMPLES 0): %d bytes keeping a 4,096-byte JSON answer (result field %d bytes); %d bytes with max_answer none (result field %d bytes); the kept answer costs %d bytes",
			memKept, resKept, memNone, resNone, memKept-memNone)
		if memKept-memNone < 4096 || memKept-memNone > 4096+2048 {
			t.Errorf("a kept 4 KB answer costs %d bytes of Redis memory; want 4 KB plus at most 2 KB", memKept-memNone)
		}
		if memNone > 2048 {
			t.Errorf("a call that keeps no body holds %d bytes of Redis memory; want at most 2 KB", memNone)
		}
	})
}

// tail is the last n bytes of s.
func tail(s string, n int) string { return s[max(0, len(s)-n):] }

// TestAnswerReadBounds reads answers of every size around the bound, in
// memory, and checks what readAnswer keeps and counts: cut exactly past
// max_answer, the bytes the vendor sent counted (or at least those read),
// a secret across the cut redacted whole.
func TestAnswerReadBounds(t *testing.T) {
	const secret = "sk-0123456789"
	for _, tc := range []struct {
		name      string
		max       int64
		body      string
		wantKept  string // text or JSON kept
		wantJSON  bool   // kept as JSON (Body), not text
		wantCut   bool
		wantBytes int64
	}{
		{"under", 10, `{"a":1}`, `{"a":1}`, true, false, 7},
		{"at the bound", 10, `"abcdefgh"`, `"abcdefgh"`, true, false, 10},
		{"one past", 10, `0123456789X`, `0123456789`, false, true, 11},
		{"cut JSON is text", 3, `1234567`, `123`, false, true, 7},
		{"secret inside", 100, `{"k":"` + secret + `"}`, `{"k":"[redacted]"}`, true, false, 21},
		{"secret across the cut", 8, `abcdef` + secret + `tail`, `abcdef[redacted]`, false, true, 23},
		{"secret starts at the cut", 6, `abcdef` + secret, `abcdef`, false, true, 19},
		{"secret prefix at the end", 100, `abc` + secret[:6], `abc[redacted]`, false, false, 9},
		{"none", NoAnswerBody, `{"a":1}`, ``, false, false, 7},
		{"far past", 4, strings.Repeat("z", 3<<20), `zzzz`, false, true, -1},
	} {
		t.Run(tc.name, func(t *testing.T) {
			resp := &http.Response{StatusCode: 201, Header: http.Header{}, Body: readCloser{strings.NewReader(tc.body)}}
			res := readAnswer(resp, answerKeep{max: tc.max, secrets: []string{secret}})
			got := res.Text + string(res.Body)
			if got != tc.wantKept || res.Cut != tc.wantCut || res.Status != 201 || (len(res.Body) > 0) != tc.wantJSON {
				t.Errorf("kept %q (as JSON: %v) cut %v status %d; want %q (as JSON: %v) cut %v", got, len(res.Body) > 0, res.Cut, res.Status, tc.wantKept, tc.wantJSON, tc.wantCut)
			}
			switch {
			case tc.wantBytes >= 0 && res.Bytes != tc.wantBytes:
				t.Errorf("bytes %d, want %d", res.Bytes, tc.wantBytes)
			case tc.wantBytes < 0 && (res.Bytes <= answerDrain || res.Bytes > int64(len(tc.body))):
				t.Errorf("bytes %d of a %d-byte body: want at least what was read (over %d)", res.Bytes, len(tc.body), answerDrain)
			}
			if strings.Contains(got, secret[:minSecret]) {
				t.Errorf("kept %q holds a part of the secret", got)
			}
		})
	}
}

type readCloser struct{ *strings.Reader }

func (readCloser) Close() error { return nil }
