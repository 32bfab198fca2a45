package vendorclients

import (
	"errors"
	"fmt"
	"time"
)

// RateLimitedError is a rate-limited answer (429, or 503 with
// Retry-After). The vendor has already been paused for every replica when
// it is returned.
type RateLimitedError struct {
	Vendor     string
	Status     int
	RetryAfter time.Duration // the pause in force; 0 if none was set
}

func (e *RateLimitedError) Error() string {
	return fmt.Sprintf("vendorclients: %s answered %d: paused for %s", e.Vendor, e.Status, e.RetryAfter)
}

// WaitError says the vendor's next tick is further away than the caller
// agreed to wait (a pause, or a backlog): try again after Wait. It is not
// a failure.
type WaitError struct {
	Vendor string
	Wait   time.Duration
}

func (e *WaitError) Error() string {
	return fmt.Sprintf("vendorclients: %s: next tick in %s", e.Vendor, e.Wait.Round(time.Millisecond))
}

// ErrBadPath is wrapped by CheckPath's errors.
var ErrBadPath = errors.New("bad path")
