package queue

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"net/http"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"
)

// TestAnswerAndEndOutliveAnOutage: Redis goes away as a call of an export
// is answered. The worker waits for it, then stores the answer and
// records the end: the export finishes, with the answer, and the vendor
// saw the call once (asynq records the end too, so the call does not run
// again after its lease).
func TestAnswerAndEndOutliveAnOutage(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	proxy := startCutProxy(t, e.addr)
	var once sync.Once
	var requests atomic.Int64
	v := e.vendor("outage", policy(50), 0, http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		requests.Add(1)
		once.Do(func() {
			proxy.Cut() // Redis goes away as the vendor answers
			time.AfterFunc(3*time.Second, proxy.Restore)
		})
		fmt.Fprintf(w, `{"waybill":"WB-%s"}`, r.Header.Get("Idempotency-Key"))
	}))
	c := e.newClient()
	ctx := context.Background()
	if _, err := c.StartExportFrom(ctx, "out", v, CallsOf([]Call{{ID: "o-1", Path: "/orders", Method: "POST", Body: json.RawMessage(`{"n":1}`)}})); err != nil {
		t.Fatal(err)
	}
	cutOff := redis.NewClient(&redis.Options{Addr: proxy.Addr(), PoolSize: 50, MaxRetries: -1})
	t.Cleanup(func() { _ = cutOff.Close() })
	e.startWorkerOn(cutOff, nil)
	var ex Export
	waitFor(t, time.Minute, "the export to finish after the outage", func() bool {
		ex, _ = c.ExportStatus(ctx, "out")
		return ex.Finished()
	})
	if ex.Done != 1 {
		t.Errorf("export after the outage: %+v; want 1 done", ex)
	}
	var buf bytes.Buffer
	if _, err := c.ExportResults(ctx, "out", ResultsQuery{Follow: true}, &buf); err != nil {
		t.Fatal(err)
	}
	var l ResultLine
	if err := json.Unmarshal(bytes.TrimSpace(buf.Bytes()), &l); err != nil || l.State != CallDone || !bytes.Contains(l.Answer, []byte(`"WB-o-1"`)) {
		t.Errorf("results after the outage: %s (%v); want o-1 done with its answer", buf.Bytes(), err)
	}
	// asynq recorded the end: nothing runs the call again after its lease.
	time.Sleep(2 * time.Second)
	if n := requests.Load(); n != 1 {
		t.Errorf("the vendor saw the call %d times, want once", n)
	}
}
