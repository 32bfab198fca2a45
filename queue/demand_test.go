package queue

import (
	"context"
	"fmt"
	"net/http"
	"runtime"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/hibiken/asynq"

	"github.com/shaper-dev/shaper/shaper"
)

// TestServersFollowWork: a worker with many vendors serves none of them
// while their queues are empty (no server, no goroutine per vendor),
// serves a vendor once a call is queued for it (queued before the worker
// started, by a client's signal, or by anything else, found by a sweep),
// and stops serving it once its queue has stayed empty. Not parallel: it
// counts the process's goroutines.
func TestServersFollowWork(t *testing.T) {
	e := newEnv(t)
	var got atomic.Int64
	h := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) { got.Add(1) })
	const vendors = 40
	names := make([]string, vendors)
	for i := range names {
		names[i] = e.vendor(fmt.Sprintf("demand%02d", i), shaper.Policy{Limits: []shaper.Limit{{Rate: 50, Window: time.Second}}}, 0, h)
	}
	c := e.newClient()
	enqueueN(t, c, names[3], 2) // before any worker runs: the first sweep finds it

	base := ownGoroutines()
	var w *Worker
	e.startWorker(func(x *Worker) { w, x.idleStop, x.sweepEvery = x, time.Second, 2*time.Second })
	waitFor(t, 10*time.Second, "the call queued before the worker started", func() bool { return got.Load() == 2 })

	waitFor(t, 15*time.Second, "the worker to stop serving the drained vendor", func() bool { return w.Serving() == 0 })
	if extra := ownGoroutines() - base; extra >= vendors {
		t.Errorf("%d goroutines over the baseline with %d idle vendors: idle vendors should cost none", extra, vendors)
	}

	// A signalled enqueue: picked up within a poll or two.
	for _, v := range []string{names[10], names[20]} {
		if _, err := c.Enqueue(context.Background(), Call{Vendor: v, Method: "GET", Path: "/x"}); err != nil {
			t.Fatal(err)
		}
	}
	waitFor(t, 10*time.Second, "the signalled calls", func() bool { return got.Load() == 4 })
	if n := w.Serving(); n > 2 {
		t.Errorf("serving %d vendors after calls for 2 of them", n)
	}

	// A task put in a vendor's queue by other means (no signal): a sweep
	// finds it.
	aq := asynq.NewClientFromRedisClient(e.rdb())
	if _, err := aq.Enqueue(asynq.NewTask(TypeCall, []byte(`{"vendor":"`+names[30]+`","method":"GET","path":"/y"}`)), asynq.Queue(QueueName(names[30]))); err != nil {
		t.Fatal(err)
	}
	waitFor(t, 10*time.Second, "the unsignalled call", func() bool { return got.Load() == 5 })
	waitFor(t, 20*time.Second, "the worker to stop serving every vendor", func() bool { return w.Serving() == 0 })
}

// ownGoroutines counts the process's goroutines but those of an embedded
// Redis serving the tests in this process (one per connection), which a
// real Redis would run elsewhere.
func ownGoroutines() int {
	buf := make([]byte, 1<<20)
	for {
		n := runtime.Stack(buf, true)
		if n < len(buf) {
			buf = buf[:n]
			break
		}
		buf = make([]byte, 2*len(buf))
	}
	count := 0
	for _, g := range strings.Split(string(buf), "\n\n") {
		if strings.HasPrefix(g, "goroutine ") && !strings.Contains(g, "alicebob/miniredis") && !strings.Contains(g, "internal/embedded.") {
			count++
		}
	}
	return count
}
