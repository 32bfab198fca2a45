package shaper

import (
	"context"
	"errors"
	"io"
	"net"
	"strings"

	"github.com/redis/go-redis/v9"
)

// ErrUnavailable is wrapped by the gate's errors when Redis could not be
// reached or could not answer for now: a connection refused or reset, a
// timeout, a server that is loading its data, read-only (a demoted master
// during a failover), without a master, or busy. Callers wait and ask
// again; nothing about the call itself is wrong. Other Redis errors (a
// missing permission, a wrong key type) are not ErrUnavailable: asking
// again would not help.
var ErrUnavailable = errors.New("shaper: Redis unavailable")

// unavailable wraps err with ErrUnavailable when it says Redis is
// unavailable for now (see ErrUnavailable). ctx's own end is not.
func unavailable(ctx context.Context, err error) error {
	if err == nil || ctx.Err() != nil || !Unavailable(err) {
		return err
	}
	return &unavailableError{err}
}

// Unavailable reports whether err says Redis is unavailable for now (see
// ErrUnavailable), whether or not it was wrapped with it.
func Unavailable(err error) bool {
	if err == nil || errors.Is(err, context.Canceled) {
		return false
	}
	if errors.Is(err, ErrUnavailable) {
		return true
	}
	var ne net.Error
	if errors.As(err, &ne) || errors.Is(err, io.EOF) || errors.Is(err, io.ErrUnexpectedEOF) ||
		errors.Is(err, redis.ErrPoolTimeout) || errors.Is(err, redis.ErrClosed) || errors.Is(err, context.DeadlineExceeded) {
		return true
	}
	var re redis.Error
	if errors.As(err, &re) {
		for _, p := range []string{"LOADING", "READONLY", "MASTERDOWN", "CLUSTERDOWN", "TRYAGAIN", "BUSY", "UNBLOCKED"} {
			if strings.HasPrefix(re.Error(), p) {
				return true
			}
		}
		return false
	}
	msg := err.Error()
	return strings.Contains(msg, "connection refused") || strings.Contains(msg, "connection reset") ||
		strings.Contains(msg, "all sentinels specified in configuration are unreachable") || strings.Contains(msg, "broken pipe")
}

type unavailableError struct{ err error }

func (e *unavailableError) Error() string { return e.err.Error() }
func (e *unavailableError) Unwrap() []error {
	return []error{ErrUnavailable, e.err}
}
