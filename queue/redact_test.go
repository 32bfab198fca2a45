package queue

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"net/http"
	"net/url"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/hibiken/asynq"

	"github.com/shaper-dev/shaper/internal/logtest"
	"github.com/shaper-dev/shaper/shaper"
	"github.com/shaper-dev/shaper/vendorclients"
)

// leak returns the longest prefix of secret, of minSecret bytes or more,
// that text holds ("" when none).
func leak(text, secret string) string {
	for k := len(secret); k >= minSecret; k-- {
		if strings.Contains(text, secret[:k]) {
			return secret[:k]
		}
	}
	return ""
}

// TestExcerptCutsAfterRedacting: the stored excerpt is cut after the
// secrets are replaced, so a secret that straddles the cut, or that the
// answer itself ends inside, is never stored in part; replacing does not
// pull later text (a secret cut by the read) in front of the cut.
func TestExcerptCutsAfterRedacting(t *testing.T) {
	const n = 32
	s := "SECRET-abcdefgh" // 15 bytes
	pad := func(k int) string { return strings.Repeat("x", k) }
	for _, c := range []struct {
		name, in, want string
	}{
		{"no secret", pad(40), pad(n)},
		{"whole, before the cut", pad(5) + s + pad(40), pad(5) + redactedMark + pad(n-5-len(s))},
		{"straddles the cut by 1", pad(n-1) + s + pad(40), pad(n-1) + redactedMark},
		{"straddles the cut by 4", pad(n-4) + s + pad(40), pad(n-4) + redactedMark},
		{"straddles the cut by 14", pad(n-14) + s + pad(40), pad(n-14) + redactedMark},
		{"starts at the cut", pad(n) + s, pad(n)},
		{"the answer ends inside it", pad(3) + s[:6], pad(3) + redactedMark},
		{"the answer ends inside it, under minSecret", pad(3) + s[:3], pad(3) + s[:3]},
		{"repeated past the read", strings.Repeat(s, 4), strings.Repeat(redactedMark, 3)},
		{"overlapping", pad(2) + "SECRET-SECRET-abcdefgh" + pad(20), pad(2) + "SECRET-" + redactedMark + pad(n-2-22)},
		{"a rune at the cut", pad(n-1) + "é" + pad(4), pad(n - 1)},
	} {
		t.Run(c.name, func(t *testing.T) {
			in := c.in
			if len(in) > n+len(s) {
				in = in[:n+len(s)] // what readExcerpt reads
			}
			got := string(excerpt([]byte(in), n, []string{s}))
			if got != c.want {
				t.Errorf("excerpt(%q) = %q, want %q", in, got, c.want)
			}
			if l := leak(strings.ReplaceAll(got, redactedMark, ""), s); l != "" && !strings.HasPrefix(c.name, "the answer ends inside it, under") && c.name != "overlapping" {
				t.Errorf("excerpt(%q) = %q holds %q", in, got, l)
			}
		})
	}
	if got := readExcerpt(strings.NewReader(pad(n-3)+s+pad(100)), n, []string{s}); string(got) != pad(n-3)+redactedMark {
		t.Errorf("readExcerpt = %q", got)
	}
}

// TestSafeURLs: errors and logs name a URL without its query, user info
// or fragment.
func TestSafeURLs(t *testing.T) {
	for in, want := range map[string]string{
		"/orders/1":                           "/orders/1",
		"/orders?api_key=k3y&x=1":             "/orders?…",
		"https://u:pw@h.example/a?token=t#f":  "https://h.example/a?…",
		"https://h.example/a":                 "https://h.example/a",
		"https://h.example/a?":                "https://h.example/a?…",
		"::not a url?token=abcd":              "::not a url…",
		"http://127.0.0.1:1/x?sig=0123456789": "http://127.0.0.1:1/x?…",
	} {
		got := safeURL(in)
		if strings.HasPrefix(in, "/") {
			got = safePath(in)
		}
		if got != want {
			t.Errorf("%q: %q, want %q", in, got, want)
		}
	}
	ue := &url.Error{Op: "Post", URL: "https://h.example/hook?key=s3cr3t-k3y", Err: errors.New("EOF")}
	if err := safeError(fmt.Errorf("callback: %w", ue)); strings.Contains(err.Error(), "s3cr3t") || !strings.Contains(err.Error(), "https://h.example/hook?…") {
		t.Errorf("safeError: %v", err)
	}
}

// TestSecretsStayOutOfStoredErrors: a vendor that echoes a call's secret
// query value and its vendor's Authorization token where the stored
// excerpt is cut (at every offset around it), or repeats them, or drops
// the connection. Neither secret, nor any prefix of it of 4 bytes or
// more, is in the task's stored error or result, the explanation
// (explain --json, the page), the callback's outcome or the worker's
// log; the error still names the path (without its query) and the
// answer.
func TestSecretsStayOutOfStoredErrors(t *testing.T) {
	const (
		header = "hdrTOKEN-7f3a9c2e1b5d4a60"
		query  = "qryKEY-0c9d8e7f6a5b4c3d"
	)
	e := newEnv(t)
	echo := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		q := r.URL.Query()
		if q.Get("drop") != "" {
			conn, _, err := w.(http.Hijacker).Hijack()
			if err == nil {
				_ = conn.Close()
			}
			return
		}
		secret := q.Get("api_key")
		if q.Get("which") == "h" {
			secret = strings.TrimPrefix(r.Header.Get("Authorization"), "Bearer ")
		}
		w.WriteHeader(http.StatusBadRequest)
		if q.Get("repeat") != "" {
			fmt.Fprint(w, strings.Repeat(secret+" ", 60))
			return
		}
		off, _ := strconv.Atoi(q.Get("o"))
		fmt.Fprint(w, strings.Repeat("x", excerptBytes-off)+secret+" and the rest of the answer")
	})
	name := e.vendor("echo", shaper.Policy{Limits: []shaper.Limit{{Rate: 50, Window: time.Second}}}, 0, echo)
	e.vendors[0].Headers = map[string]string{"Authorization": "Bearer " + header}
	rc := newReceiver(t, "k")
	e.callbacks = CallbackConfig{Allow: []string{rc.url()}, Secret: "k"}
	c := e.newClient()
	var ids []string
	add := func(id, query string) {
		t.Helper()
		if _, err := c.Enqueue(context.Background(), Call{ID: id, Vendor: name, Path: "/echo?" + query, Callback: &Callback{URL: rc.url()}}); err != nil {
			t.Fatal(err)
		}
		ids = append(ids, id)
	}
	for _, which := range []string{"q", "h"} {
		for _, off := range []int{0, 1, 3, 4, 5, 12, len(header) - 1, len(header), len(header) + 1} {
			add(fmt.Sprintf("%s-off-%d", which, off), fmt.Sprintf("api_key=%s&which=%s&o=%d", query, which, off))
		}
		add(which+"-repeat", fmt.Sprintf("api_key=%s&which=%s&repeat=1", query, which))
	}
	add("drop", "api_key="+query+"&drop=1")
	log := &logtest.Buffer{}
	e.startWorker(func(w *Worker) {
		w.log = slog.New(slog.NewTextHandler(log, &slog.HandlerOptions{Level: slog.LevelDebug}))
	})
	insp := asynq.NewInspectorFromRedisClient(e.rdb())
	for _, id := range ids {
		var info *asynq.TaskInfo
		waitFor(t, 30*time.Second, "call "+id+" to fail", func() bool {
			var err error
			info, err = insp.GetTaskInfo(QueueName(name), id)
			return err == nil && (info.State == asynq.TaskStateArchived || info.State == asynq.TaskStateRetry)
		})
		ex, err := c.Explain(context.Background(), id)
		if err != nil {
			t.Fatal(err)
		}
		explained, _ := json.Marshal(ex)
		texts := map[string]string{"error": info.LastErr, "result": string(info.Result), "explanation": string(explained)}
		if id != "drop" {
			waitFor(t, 30*time.Second, "the callback of "+id, func() bool {
				rc.mu.Lock()
				defer rc.mu.Unlock()
				return len(rc.got[id]) > 0
			})
			rc.mu.Lock()
			outcome, _ := json.Marshal(rc.got[id][0])
			rc.mu.Unlock()
			texts["callback"] = string(outcome)
		}
		for what, text := range texts {
			for _, s := range []string{header, query} {
				if l := leak(text, s); l != "" {
					t.Errorf("call %s: its %s holds %q of a secret: %s", id, what, l, text)
				}
			}
		}
		if !strings.Contains(info.LastErr, "GET /echo?…: ") {
			t.Errorf("call %s: error %q, want it to name the path without its query", id, info.LastErr)
		}
		if id != "drop" && !strings.Contains(info.LastErr, "HTTP 400") {
			t.Errorf("call %s: error %q lost the vendor's answer", id, info.LastErr)
		}
	}
	for _, s := range []string{header, query} {
		if l := leak(log.String(), s); l != "" {
			t.Errorf("the worker's log holds %q of a secret:\n%s", l, log.String())
		}
	}
}

// TestUserHandlersErrorsNameNoQuery: a user's handler that calls the
// vendor through HTTPClient (a vendor SDK) returns the http.Client's
// *url.Error, which names the whole URL; the task's stored error names
// it without its query.
func TestUserHandlersErrorsNameNoQuery(t *testing.T) {
	const token = "tok3n-in-the-query-77aa"
	e := newEnv(t)
	v := e.vendor("sdk", policy(50), 0, http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if conn, _, err := w.(http.Hijacker).Hijack(); err == nil {
			_ = conn.Close()
		}
	}))
	e.startWorker(func(w *Worker) {
		if err := w.Handle("test:sdk", func(ctx context.Context, _ *asynq.Task, vendor *vendorclients.Client) error {
			u, err := vendor.URL("/report?token=" + token)
			if err != nil {
				return err
			}
			req, _ := http.NewRequestWithContext(ctx, http.MethodGet, u.String(), nil)
			resp, err := vendor.HTTPClient().Do(req)
			if err != nil {
				return err
			}
			resp.Body.Close()
			return nil
		}); err != nil {
			t.Fatal(err)
		}
	})
	info, err := e.newClient().EnqueueTask(context.Background(), Target{Vendor: v}, asynq.NewTask("test:sdk", nil), asynq.MaxRetry(1))
	if err != nil {
		t.Fatal(err)
	}
	insp := asynq.NewInspectorFromRedisClient(e.rdb())
	waitFor(t, 30*time.Second, "the task to fail", func() bool {
		info, err = insp.GetTaskInfo(QueueName(v), info.ID)
		return err == nil && info.LastErr != ""
	})
	if l := leak(info.LastErr, token); l != "" || !strings.Contains(info.LastErr, "/report?…") {
		t.Errorf("stored error %q: want the URL without its query", info.LastErr)
	}
}
