package shaper

import "time"

// gateHooks are a Gate's hooks for tests, embedded in it: tests set them
// on a gate they made (g.testNow = ...); production leaves them all nil,
// and the code that calls them does nothing more then.
type gateHooks struct {
	testNow          func() int64                         // Redis time (µs) for the scripts; nil: Redis TIME
	testWatchedUp    func()                               // called when Watch's subscription is confirmed
	testScript       func(kind string)                    // called with each reserve script run ("core", "counted" or "full")
	testNotedPause   func(bucket string, until time.Time) // called, under mu, when a pause is noted for waiting callers
	testNotedRespace func(bucket string, at time.Time)    // called, under mu, when a respace is heard of and its held ticks dropped
}

// testRun tells a test which reserve script runs (see testScript).
func (h *gateHooks) testRun(kind string) {
	if h.testScript != nil {
		h.testScript(kind)
	}
}
