// Package embedded runs the in-process Redis (miniredis) that shaper uses
// when no Redis is configured: the demo, a worker without redis.addr, and
// the tests on a machine without redis-server.
//
// miniredis counts time to live only when told to (FastForward): left
// alone, no key would ever expire, so a bucket's state, asynq's leases and
// a queue's pause would outlive their time. A Server moves its keys' time
// on with the wall clock, every Tick.
package embedded

import (
	"sync"
	"time"

	"github.com/alicebob/miniredis/v2"
)

// Tick is how often a Server moves its keys' time to live on: a key
// expires at most this late.
const Tick = 10 * time.Millisecond

// Server is a running in-process Redis whose keys expire in real time.
type Server struct {
	*miniredis.Miniredis
	stop chan struct{}
	done chan struct{}
	once sync.Once
}

// Start runs an in-process Redis on addr ("127.0.0.1:0" for a free
// port). Close stops it.
func Start(addr string) (*Server, error) {
	m := miniredis.NewMiniRedis()
	if err := m.StartAddr(addr); err != nil {
		return nil, err
	}
	s := &Server{Miniredis: m, stop: make(chan struct{}), done: make(chan struct{})}
	go s.expire()
	return s, nil
}

// expire moves the keys' time on by the wall time that passed, until
// Close.
func (s *Server) expire() {
	defer close(s.done)
	t := time.NewTicker(Tick)
	defer t.Stop()
	last := time.Now()
	for {
		select {
		case <-s.stop:
			return
		case now := <-t.C:
			s.FastForward(now.Sub(last))
			last = now
		}
	}
}

// Close stops the expiry and the server. It may be called more than once.
func (s *Server) Close() {
	s.once.Do(func() {
		close(s.stop)
		<-s.done
		s.Miniredis.Close()
	})
}
