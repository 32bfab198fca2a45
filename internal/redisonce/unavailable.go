package redisonce

import (
	"context"
	"errors"
	"io"
	"net"
	"strings"

	"github.com/redis/go-redis/v9"
)

// ErrUnavailable says Redis could not be reached or could not answer for
// now; package shaper exports it as shaper.ErrUnavailable, which wraps
// the gate's errors of that kind (see there).
var ErrUnavailable = errors.New("shaper: Redis unavailable")

// Unavailable reports whether err says Redis is unavailable for now: a
// connection refused or reset, a timeout, a server that is loading its
// data, read-only (a demoted master during a failover), without a
// master, or busy; or any error wrapped with ErrUnavailable. Callers
// wait and ask again; nothing about the command itself is wrong. Other
// Redis errors (a missing permission, a wrong key type) are not: asking
// again would not help. A canceled context is not.
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
