package main

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"math/rand/v2"
	"net/http"
	"net/http/httptest"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/shaper-dev/shaper/internal/redistest"
	"github.com/shaper-dev/shaper/internal/vendorsim"
	"github.com/shaper-dev/shaper/queue"
)

// exportLine is a line of `shaper export results`.
type exportLine struct {
	ID       string `json:"id"`
	State    string `json:"state"`
	Status   int    `json:"status"`
	Attempts int    `json:"attempts"`
	Page     int    `json:"page"`
	Error    string `json:"error"`
	Answer   struct {
		Status    int             `json:"status"`
		Body      json.RawMessage `json:"body"`
		Cut       bool            `json:"cut"`
		Bytes     int64           `json:"bytes"`
		NextError string          `json:"next_error"`
	} `json:"answer"`
}

func readExportLines(t *testing.T, b []byte) []exportLine {
	t.Helper()
	var out []exportLine
	sc := bufio.NewScanner(bytes.NewReader(b))
	sc.Buffer(make([]byte, 1<<20), 32<<20)
	for sc.Scan() {
		var l exportLine
		if err := json.Unmarshal(sc.Bytes(), &l); err != nil {
			t.Fatalf("results line %q: %v", sc.Text(), err)
		}
		out = append(out, l)
	}
	return out
}

// orderLines is n POST calls without ids, each with a body of its own.
func orderLines(n int) (string, [][]byte) {
	var b strings.Builder
	bodies := make([][]byte, n)
	for i := range n {
		bodies[i] = fmt.Appendf(nil, `{"order":%d,"sku":"A-%d"}`, i+1, i%7)
		fmt.Fprintf(&b, `{"method":"POST","path":"/orders","body":%s}`+"\n", bodies[i])
	}
	return b.String(), bodies
}

// exportRun is the outcome of runExportBar.
type exportRun struct {
	lines                []exportLine
	cliRSS, workerRSS    int64 // peak resident memory, KiB
	maxPerWindow, calls  int
	elapsed              time.Duration
	repeatedKeys, tooBig int
}

// runExportBar runs the first bar with n calls: a vendor answering
// every call with a 4 KB JSON body at 100/s in fixed windows of a hidden
// phase, workers shaper worker processes, `shaper export --wait --out`,
// and checks that the file holds every call in the file's order, each
// answer whole and equal to what the vendor sent, and no window over the
// limit.
func runExportBar(t *testing.T, n, workers int) exportRun {
	addr := redistest.Addr(t)
	vend := &vendorsim.Mock{Rate: 100, Window: time.Second, Phase: time.Duration(rand.Int64N(int64(time.Second))), AnswerBytes: 4096}
	srv := httptest.NewServer(vend)
	defer srv.Close()
	vendor := "exp-" + redistest.Prefix(t)[5:]
	cfg := writeConfig(t, addr, vendor, srv.URL, 100)
	var procs []*exec.Cmd
	for range workers {
		w, _ := startWorker(t, cfg)
		procs = append(procs, w)
	}
	dir := t.TempDir()
	file, bodies := orderLines(n)
	writeFile(t, filepath.Join(dir, "orders.ndjson"), file)
	out := filepath.Join(dir, "answers.ndjson")
	start := time.Now()
	cli := exec.Command(shaperBin(t), "export", "--config", cfg, "--vendor", vendor, "--id", vendor, "--file", filepath.Join(dir, "orders.ndjson"), "--wait", "--out", out)
	cliOut, err := cli.CombinedOutput()
	elapsed := time.Since(start)
	if err != nil {
		t.Fatalf("export: %v\n%s", err, cliOut)
	}
	run := exportRun{elapsed: elapsed, cliRSS: maxRSS(cli)}
	for _, w := range procs {
		_ = w.Process.Signal(syscall.SIGTERM)
		_ = w.Wait()
		run.workerRSS = max(run.workerRSS, maxRSS(w))
	}
	b, err := os.ReadFile(out)
	if err != nil {
		t.Fatal(err)
	}
	run.lines = readExportLines(t, b)
	if len(run.lines) != n {
		t.Fatalf("%s has %d lines, want %d\n%s", out, len(run.lines), n, cliOut)
	}
	for i, l := range run.lines {
		id := fmt.Sprintf("%s:%d", vendor, i+1)
		want := vendorsim.Answer("POST", "/orders", id, bodies[i], 4096)
		switch {
		case l.ID != id:
			t.Fatalf("line %d is call %s, want %s: the file is not in the export's order", i+1, l.ID, id)
		case l.State != queue.CallDone || l.Status != 200 || l.Attempts != 1:
			t.Errorf("line %d: %s, HTTP %d, %d attempts", i+1, l.State, l.Status, l.Attempts)
		case !bytes.Equal(l.Answer.Body, want) || l.Answer.Cut || l.Answer.Bytes != int64(len(want)):
			run.tooBig++
			if run.tooBig <= 3 {
				t.Errorf("line %d: the answer (%d bytes, cut %v) is not what the vendor sent (%d bytes):\n got %.200s\nwant %.200s", i+1, len(l.Answer.Body), l.Answer.Cut, len(want), l.Answer.Body, want)
			}
		}
	}
	s := vend.Summarize()
	run.maxPerWindow, run.calls, run.repeatedKeys = s.MaxPerWindow, len(vend.Requests()), s.KeysRepeated
	if s.RateLimited != 0 || s.MaxPerWindow > 100 || s.KeysRepeated != 0 || run.calls != n {
		t.Errorf("at the vendor: %d calls (want %d), %d 429s, most %d in a window (limit 100), %d keys more than once", run.calls, n, s.RateLimited, s.MaxPerWindow, s.KeysRepeated)
	}
	return run
}

// maxRSS is a finished process's peak resident memory, KiB.
func maxRSS(c *exec.Cmd) int64 {
	if c.ProcessState == nil {
		return 0
	}
	if ru, ok := c.ProcessState.SysUsage().(*syscall.Rusage); ok {
		return ru.Maxrss
	}
	return 0
}

// TestExportAnswersInOrder: the first bar of issue 42 at 300 calls and two
// workers (make bench-export runs it at 2,000 calls and three workers):
// every answer whole, in the file's order, in a file written as the
// export runs; no window over the limit; the CLI's and the workers'
// memory bounded.
func TestExportAnswersInOrder(t *testing.T) {
	t.Parallel()
	run := runExportBar(t, 300, 2)
	t.Logf("300 calls in %s; peak RSS: CLI %d MiB, worker %d MiB; most %d calls in a vendor window", run.elapsed.Round(time.Millisecond), run.cliRSS>>10, run.workerRSS>>10, run.maxPerWindow)
	if run.cliRSS > 150<<10 || run.workerRSS > 150<<10 {
		t.Errorf("peak RSS: CLI %d MiB, worker %d MiB; want both under 150 MiB", run.cliRSS>>10, run.workerRSS>>10)
	}
}

// TestExportPullSurvivesAKill: the second bar of issue 42. One call line
// pulls 50 pages of 100 items behind a cursor (and behind a Link
// header) at 20/s; its worker is SIGKILLed mid-pull and a new one takes
// over: every page reads back once, in order, 5,000 items, and the
// vendor saw a page twice only if it was in flight at the kill (sent, its
// end not yet recorded).
func TestExportPullSurvivesAKill(t *testing.T) {
	for _, tc := range []struct{ style, next string }{
		{"cursor", `{"cursor":"/meta/next_cursor","param":"cursor"}`},
		{"link", `{"link":"next"}`},
	} {
		t.Run(tc.style, func(t *testing.T) {
			t.Parallel()
			addr := redistest.Addr(t)
			vend := &vendorsim.Mock{Rate: 20, Window: time.Second, Phase: time.Duration(rand.Int64N(int64(time.Second))),
				Paging: vendorsim.Paging{Pages: 50, Items: 100, Style: tc.style, Prefix: "/contacts"}}
			srv := httptest.NewServer(vend)
			defer srv.Close()
			vendor := "pull-" + redistest.Prefix(t)[5:]
			cfg := writeConfig(t, addr, vendor, srv.URL, 20)
			victim, vout := startWorker(t, cfg)
			line := fmt.Sprintf(`{"id":"sync-%s","path":"/contacts?limit=100","next":%s}`+"\n", tc.style, tc.next)
			if out, err := runShaper(t, line, "export", "--config", cfg, "--vendor", vendor, "--id", vendor, "--file", "-"); err != nil {
				t.Fatalf("export: %v\n%s", err, out)
			}
			killAt := 10 + rand.IntN(20)
			waitUntil(t, time.Minute, fmt.Sprintf("page %d", killAt), func() bool { return len(vend.Requests()) >= killAt })
			if err := victim.Process.Kill(); err != nil {
				t.Fatal(err)
			}
			_ = victim.Wait()
			killedAt := len(vend.Requests())
			// The pages in flight at the kill: sent, and their end not
			// recorded (asked, answered or being stored). Only these may
			// reach the vendor twice.
			inFlight := map[string]bool{}
			rdb := redistest.Client(t)
			for _, r := range vend.Requests() {
				state, _ := rdb.HGet(context.Background(), "asynq:{"+queue.QueueName(vendor)+"}:t:"+r.Key, "state").Result()
				if state != "completed" {
					inFlight[r.Key] = true
				}
			}
			expireLeases(t, queue.QueueName(vendor))
			startWorker(t, cfg)
			ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
			defer cancel()
			cmd := exec.CommandContext(ctx, shaperBin(t), "export", "results", vendor, "--config", cfg, "--follow")
			b, err := cmd.Output()
			if err != nil {
				t.Fatalf("export results --follow: %v\n%s\nthe killed worker:\n%s", err, b, vout.String())
			}
			lines := readExportLines(t, b)
			items := 0
			for i, l := range lines {
				want := "sync-" + tc.style
				if i > 0 {
					want += fmt.Sprintf(":p%d", i+1)
				}
				if l.ID != want || l.Page != i+1 || l.State != queue.CallDone || l.Answer.NextError != "" {
					t.Errorf("line %d: %s page %d %s next_error %q; want %s page %d done", i+1, l.ID, l.Page, l.State, l.Answer.NextError, want, i+1)
				}
				var page struct{ Items []struct{ ID string } }
				_ = json.Unmarshal(l.Answer.Body, &page)
				for _, it := range page.Items {
					items++
					if it.ID != fmt.Sprintf("c-%d", items) {
						t.Fatalf("line %d: item %s, want c-%d", i+1, it.ID, items)
					}
				}
			}
			s := vend.Summarize()
			t.Logf("%s: killed the worker after %d requests (%d in flight); %d pages, %d items; the vendor saw %d keys, %d more than once %v",
				tc.style, killedAt, len(inFlight), len(lines), items, s.KeysSeen, s.KeysRepeated, s.RepeatedFirst)
			if len(lines) != 50 || items != 5000 {
				t.Errorf("%d pages and %d items, want 50 and 5,000", len(lines), items)
			}
			if s.KeysSeen != 50 || s.MaxPerWindow > 20 || s.RateLimited != 0 {
				t.Errorf("at the vendor: %d keys (want 50), most %d a window (limit 20), %d 429s", s.KeysSeen, s.MaxPerWindow, s.RateLimited)
			}
			seen := map[string]int{}
			for _, r := range vend.Requests() {
				if seen[r.Key]++; seen[r.Key] == 2 && !inFlight[r.Key] {
					t.Errorf("the vendor saw page %s twice, and it was not in flight at the kill (those were %v)", r.Key, inFlight)
				}
			}
		})
	}
}

// expireLeases backdates the leases of q's active tasks (a killed
// worker's), as the minute asynq waits would: a worker started next
// recovers them at once (see TestFaultWorkerKilledLosesNothing).
func expireLeases(t *testing.T, q string) {
	t.Helper()
	ctx := context.Background()
	rdb := redistest.Client(t)
	leases := "asynq:{" + q + "}:lease"
	held, err := rdb.ZRange(ctx, leases, 0, -1).Result()
	if err != nil {
		t.Fatal(err)
	}
	zs := make([]redis.Z, len(held))
	for i, id := range held {
		zs[i] = redis.Z{Score: float64(time.Now().Add(-time.Minute).Unix()), Member: id}
	}
	if len(zs) > 0 {
		if err := rdb.ZAddXX(ctx, leases, zs...).Err(); err != nil {
			t.Fatal(err)
		}
	}
}

// TestExportFailedAndRetried: the third bar of issue 42. 30 of 500 calls
// are answered 422: the export finishes with 30 failed, `export results
// --failed` lists exactly those with their status and error, and once the
// vendor is fixed `export retry` completes the export, each of the 30
// reaching the vendor once more with its own Idempotency-Key.
func TestExportFailedAndRetried(t *testing.T) {
	t.Parallel()
	addr := redistest.Addr(t)
	const n, bad = 500, 30
	export := "retry-" + redistest.Prefix(t)[5:]
	failing := map[string]bool{}
	for _, i := range rand.Perm(n)[:bad] {
		failing[fmt.Sprintf("%s:%d", export, i+1)] = true
	}
	var fixed atomic.Bool
	var mu sync.Mutex
	seen := map[string][]int{} // key -> statuses sent
	vend := &vendorsim.Mock{Rate: 100, Window: time.Second, Phase: time.Duration(rand.Int64N(int64(time.Second)))}
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		key := r.Header.Get("Idempotency-Key")
		status := http.StatusOK
		if failing[key] && !fixed.Load() {
			status = http.StatusUnprocessableEntity
			w.Header().Set("Content-Type", "application/json")
			w.WriteHeader(status)
			fmt.Fprintf(w, `{"error":"validation failed","id":%q}`, key)
		} else {
			vend.ServeHTTP(w, r)
		}
		mu.Lock()
		seen[key] = append(seen[key], status)
		mu.Unlock()
	}))
	defer srv.Close()
	vendor := export
	cfg := writeConfig(t, addr, vendor, srv.URL, 100)
	startWorker(t, cfg)
	file, _ := orderLines(n)
	out, err := runShaper(t, file, "export", "--config", cfg, "--vendor", vendor, "--id", export, "--file", "-", "--wait")
	if err == nil || !strings.Contains(out, fmt.Sprintf("%d call(s) of export %s failed", bad, export)) || !strings.Contains(out, "export results "+export+" --failed") {
		t.Fatalf("export --wait with %d failures: %v\n%s", bad, err, out)
	}
	res, err := runShaper(t, "", "export", "results", export, "--config", cfg, "--failed")
	if err != nil {
		t.Fatalf("export results --failed: %v\n%s", err, res)
	}
	var listed []string
	for _, l := range readExportLines(t, []byte(res)) {
		listed = append(listed, l.ID)
		if l.State != queue.CallFailed || l.Status != 422 || !strings.Contains(l.Error, "HTTP 422") || !strings.Contains(string(l.Answer.Body), "validation failed") {
			t.Errorf("failed line %s: %s, HTTP %d, error %q, answer %s", l.ID, l.State, l.Status, l.Error, l.Answer.Body)
		}
	}
	want := slices.Collect(func(yield func(string) bool) {
		for i := range n {
			if id := fmt.Sprintf("%s:%d", export, i+1); failing[id] && !yield(id) {
				return
			}
		}
	})
	if !slices.Equal(listed, want) {
		t.Fatalf("--failed listed %d calls %v; want the %d that failed, in order: %v", len(listed), listed, len(want), want)
	}
	fixed.Store(true)
	out, err = runShaper(t, "", "export", "retry", export, "--config", cfg, "--wait")
	if err != nil || !strings.Contains(out, fmt.Sprintf("%d failed call(s) queued again", bad)) {
		t.Fatalf("export retry: %v\n%s", err, out)
	}
	st, err := runShaper(t, "", "export", "status", export, "--config", cfg, "--json")
	var e struct {
		State               string
		Done, Failed, Total int64
	}
	if err != nil || json.Unmarshal([]byte(st), &e) != nil || e.State != "finished" || e.Done != n || e.Failed != 0 || e.Total != n {
		t.Fatalf("export status after the retry: %v\n%s", err, st)
	}
	mu.Lock()
	defer mu.Unlock()
	for key, statuses := range seen {
		want := []int{200}
		if failing[key] {
			want = []int{422, 200}
		}
		if !slices.Equal(statuses, want) {
			t.Errorf("the vendor answered %s %v; want %v", key, statuses, want)
		}
	}
	if len(seen) != n {
		t.Errorf("the vendor saw %d keys, want %d", len(seen), n)
	}
}
