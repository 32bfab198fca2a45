package shaper

import (
	"fmt"
	"time"
)

// What held a call at its gate (Wait.Binding): the same words as a
// queued call's explanation.
const (
	BoundBacklog  = "backlog"     // the ticks before its own went to the calls that asked first (also the wait for a granted tick)
	BoundPause    = "pause"       // the bucket is paused (a 429, a vendor's reset)
	BoundQuota    = "quota"       // a spent limit: a quota, or a costly call's units
	BoundInFlight = "in_flight"   // every MaxInFlight slot is taken
	BoundHighLane = "high_lane"   // a call of the high lane waits for a tick
	BoundReset    = "state_reset" // the bucket's state was lost: its horizon is waited out
	BoundUpgrade  = "upgrade"     // a newer shaper wrote the bucket's state: this one grants nothing until it is upgraded
)

// Wait is one wait of a call at its bucket's gate, as Request.Waited
// hears of it: each time the gate defers the call (it asks again after
// For) and, at the end, the wait until its granted tick.
//
// A deferral beyond Request.MaxWait is also Acquire's error, a *Wait:
// the call got no permit and may ask again after For.
type Wait struct {
	For time.Duration
	// Binding says what held the call, one of the Bound* words. The
	// wait for a granted tick is BoundBacklog: a grant does not say
	// whether a short pause (under the horizon) put it there.
	Binding string
	Granted bool // the wait until a granted tick; else a deferral
}

// Error says how long the call was deferred and what held it.
func (w *Wait) Error() string {
	return fmt.Sprintf("shaper: the call's turn is %v away (%s), beyond its MaxWait: ask again then", w.For, w.Binding)
}

// binding is the Bound* word of a deferral's reason.
func (r deferReason) binding() string {
	switch r {
	case inFlightFull:
		return BoundInFlight
	case stateReset:
		return BoundReset
	case behindHigh:
		return BoundHighLane
	case heldByLimit:
		return BoundQuota
	case heldByPause:
		return BoundPause
	case newerLayout:
		return BoundUpgrade
	}
	return BoundBacklog
}
