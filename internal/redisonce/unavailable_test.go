package redisonce_test

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"syscall"
	"testing"

	"github.com/redis/go-redis/v9"

	"github.com/shaper-dev/shaper/internal/redisonce"
)

// TestUnavailable: the errors that say Redis cannot answer for now (a
// call waits and asks again, without using a retry) and the ones that say
// something is wrong that asking again would not mend.
func TestUnavailable(t *testing.T) {
	redisErr := func(msg string) error { return redisError(msg) }
	for _, tc := range []struct {
		err  error
		want bool
	}{
		{&net.OpError{Op: "dial", Net: "tcp", Err: syscall.ECONNREFUSED}, true},
		{fmt.Errorf("read: %w", syscall.ECONNRESET), true},
		{io.EOF, true},
		{context.DeadlineExceeded, true},
		{redis.ErrPoolTimeout, true},
		{redis.ErrClosed, true},
		{redisErr("LOADING Redis is loading the dataset in memory"), true},
		{redisErr("READONLY You can't write against a read only replica."), true},
		{redisErr("MASTERDOWN Link with MASTER is down and replica-serve-stale-data is set to 'no'."), true},
		{redisErr("BUSY Redis is busy running a script."), true},
		{redisErr("CLUSTERDOWN The cluster is down"), true},
		{errors.New("redis: all sentinels specified in configuration are unreachable"), true},
		{fmt.Errorf("shaper: reserve: %w", redisonce.ErrUnavailable), true},
		{context.Canceled, false},
		{redisErr("NOPERM User shaper has no permissions to run the 'flushall' command"), false},
		{redisErr("WRONGTYPE Operation against a key holding the wrong kind of value"), false},
		{redisErr("ERR unknown command 'info'"), false},
		{errors.New("shaper: bad policy"), false},
		{nil, false},
	} {
		if got := redisonce.Unavailable(tc.err); got != tc.want {
			t.Errorf("Unavailable(%v) = %v, want %v", tc.err, got, tc.want)
		}
	}
}

// redisError is an error as Redis replies it (go-redis's redis.Error).
type redisError string

func (e redisError) Error() string { return string(e) }
func (redisError) RedisError()     {}
