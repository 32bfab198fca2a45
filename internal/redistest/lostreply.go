package redistest

import (
	"bytes"
	"io"
	"net"
	"sync"
	"testing"
)

// LostReply is a TCP proxy to a Redis that passes everything through but
// the reply to one command: armed with a marker, the first command whose
// bytes hold it reaches Redis, which runs it, and its reply never reaches
// the client, which sees its connection closed (EOF) or, stalled, no
// reply at all (its read timeout). That is what a client's retry after a
// lost reply is tested with.
type LostReply struct {
	ln     net.Listener
	target string
	wg     sync.WaitGroup

	mu     sync.Mutex
	marker []byte // "" when disarmed
	stall  bool
	lost   int
	conns  map[net.Conn]bool
	closed bool
}

// StartLostReply starts a LostReply proxy to target, stopped when the
// test ends.
func StartLostReply(tb testing.TB, target string) *LostReply {
	tb.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		tb.Fatal(err)
	}
	p := &LostReply{ln: ln, target: target, conns: map[net.Conn]bool{}}
	p.wg.Go(p.serve)
	tb.Cleanup(p.close)
	return p
}

// Addr is the proxy's address, for a client.
func (p *LostReply) Addr() string { return p.ln.Addr().String() }

// Arm makes the proxy lose the reply to the next command whose bytes
// hold marker (a script's hash, a function's name): it closes that
// client connection, or with stall keeps it open and silent.
func (p *LostReply) Arm(marker string, stall bool) {
	p.mu.Lock()
	p.marker, p.stall = []byte(marker), stall
	p.mu.Unlock()
}

// Lost says how many replies the proxy lost.
func (p *LostReply) Lost() int {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.lost
}

func (p *LostReply) serve() {
	for {
		c, err := p.ln.Accept()
		if err != nil {
			return
		}
		s, err := net.Dial("tcp", p.target)
		if err != nil {
			_ = c.Close()
			continue
		}
		if !p.track(c, s) {
			return
		}
		p.wg.Go(func() { p.pipe(c, s) })
	}
}

// track records a pair of connections, or closes them if the proxy is
// stopping.
func (p *LostReply) track(c, s net.Conn) bool {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.closed {
		_ = c.Close()
		_ = s.Close()
		return false
	}
	p.conns[c], p.conns[s] = true, true
	return true
}

// pipe relays client c to server s, losing a reply when armed.
func (p *LostReply) pipe(c, s net.Conn) {
	defer func() { _ = c.Close(); _ = s.Close() }()
	var mu sync.Mutex
	lose, stall := false, false
	var replies sync.WaitGroup
	replies.Go(func() {
		buf := make([]byte, 64<<10)
		for {
			n, err := s.Read(buf)
			if n > 0 {
				mu.Lock()
				l, st := lose, stall
				mu.Unlock()
				switch {
				case l && st:
					// The reply goes nowhere; the client waits.
				case l:
					_ = c.Close()
					return
				default:
					if _, err := c.Write(buf[:n]); err != nil {
						return
					}
				}
			}
			if err != nil {
				_ = c.Close()
				return
			}
		}
	})
	buf := make([]byte, 64<<10)
	for {
		n, err := c.Read(buf)
		if n > 0 {
			p.mu.Lock()
			if len(p.marker) > 0 && bytes.Contains(buf[:n], p.marker) {
				p.marker = nil
				p.lost++
				mu.Lock()
				lose, stall = true, p.stall
				mu.Unlock()
			}
			p.mu.Unlock()
			if _, err := s.Write(buf[:n]); err != nil {
				break
			}
		}
		if err != nil {
			if err != io.EOF {
				_ = c.Close()
			}
			break
		}
	}
	_ = s.Close()
	replies.Wait()
}

func (p *LostReply) close() {
	_ = p.ln.Close()
	p.mu.Lock()
	p.closed = true
	for c := range p.conns {
		_ = c.Close()
	}
	p.mu.Unlock()
	p.wg.Wait()
}
