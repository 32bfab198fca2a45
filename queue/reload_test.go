package queue

import (
	"testing"
	"time"

	"github.com/shaper-dev/shaper/internal/vendorsim"
)

// TestReloadWhileCallsRun applies rate edits while a vendor's server
// starts and its calls run, and every call still completes. Run it with
// -race: a reload used to write the vendor's policy fields in place
// (commitLocked) while the vendor's goroutines read them (the supervisor
// as it starts, sizing its logs from forwardEvery), with nothing ordering
// the two.
func TestReloadWhileCallsRun(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	vend := &vendorsim.Mock{Rate: 50, Window: time.Second}
	name := e.vendor("reload", policy(50), 0, vend)
	c := e.newClient()
	const n = 60
	enqueueN(t, c, name, n)
	var w *Worker
	e.startWorker(func(x *Worker) { w = x })
	waitFor(t, 10*time.Second, "the vendor's server", func() bool { return w.Serving() == 1 })
	// At once: the supervisor the server started has just begun.
	for i := range 10 {
		edited := e.vendors[0]
		edited.Policy = policy(40 + 10*(i%2))
		edited.PerAccount = false
		if _, err := w.Apply([]Vendor{edited}); err != nil {
			t.Fatal(err)
		}
		time.Sleep(50 * time.Millisecond)
	}
	waitFor(t, 30*time.Second, "every call", func() bool { return vend.Summarize().DistinctKeys == n })
}
