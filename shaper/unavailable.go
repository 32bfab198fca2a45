package shaper

import (
	"context"

	"github.com/shaper-dev/shaper/internal/redisonce"
)

// ErrUnavailable is wrapped by the gate's errors when Redis could not be
// reached or could not answer for now: a connection refused or reset, a
// timeout, a server that is loading its data, read-only (a demoted master
// during a failover), without a master, or busy. Callers wait and ask
// again; nothing about the call itself is wrong. Other Redis errors (a
// missing permission, a wrong key type) are not ErrUnavailable: asking
// again would not help.
var ErrUnavailable = redisonce.ErrUnavailable

// unavailable wraps err with ErrUnavailable when it says Redis is
// unavailable for now (redisonce.Unavailable). ctx's own end is not.
func unavailable(ctx context.Context, err error) error {
	if err == nil || ctx.Err() != nil || !redisonce.Unavailable(err) {
		return err
	}
	return &unavailableError{err}
}

type unavailableError struct{ err error }

func (e *unavailableError) Error() string { return e.err.Error() }
func (e *unavailableError) Unwrap() []error {
	return []error{ErrUnavailable, e.err}
}
