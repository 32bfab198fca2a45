package shaper

import "time"

// maxAsking bounds the reservations one gate has in flight to Redis for
// one bucket. Callers beyond it wait their turn in the process: a crowd of
// callers would otherwise queue inside Redis, and a slow round trip uses
// up the tolerance, so every grant would be given up.
const maxAsking = 16

// local is what this process knows of a bucket while callers of it wait
// in Acquire, and only then: the last caller to leave drops it, so that
// process state follows the work, not the number of buckets ever used.
type local struct {
	callers     int
	asking      chan struct{} // slots for reservations in flight to Redis
	pausedUntil time.Time     // local end of a pause heard of while callers wait
	respacedAt  time.Time     // local time of the last respace heard of while callers wait
}

// enter registers a caller of bucket and returns the bucket's local state.
func (g *Gate) enter(bucket string) *local {
	g.mu.Lock()
	defer g.mu.Unlock()
	l, ok := g.active[bucket]
	if !ok {
		l = &local{asking: make(chan struct{}, maxAsking)}
		g.active[bucket] = l
	}
	l.callers++
	return l
}

// leave unregisters a caller; the last one drops the bucket's state.
func (g *Gate) leave(bucket string, l *local) {
	g.mu.Lock()
	defer g.mu.Unlock()
	l.callers--
	if l.callers == 0 {
		delete(g.active, bucket)
	}
}

// notePause records a pause of bucket for the callers waiting on it in
// this process. Without waiting callers there is no reserved tick to drop,
// and nothing is kept.
func (g *Gate) notePause(bucket string, until time.Time) {
	g.mu.Lock()
	defer g.mu.Unlock()
	if l, ok := g.active[bucket]; ok && until.After(l.pausedUntil) {
		l.pausedUntil = until
	}
}

// pausedAt reports whether a pause heard of covers t.
func (g *Gate) pausedAt(l *local, t time.Time) bool {
	g.mu.Lock()
	defer g.mu.Unlock()
	return t.Before(l.pausedUntil)
}

// activeBuckets is the number of buckets this process holds state for.
func (g *Gate) activeBuckets() int {
	g.mu.Lock()
	defer g.mu.Unlock()
	return len(g.active)
}

// noteRespace records that bucket's line was restarted at at: callers
// granted a tick before then drop it and ask again.
func (g *Gate) noteRespace(bucket string, at time.Time) {
	g.mu.Lock()
	defer g.mu.Unlock()
	if l, ok := g.active[bucket]; ok && at.After(l.respacedAt) {
		l.respacedAt = at
	}
}

// respacedSince reports whether a respace was heard of after t.
func (g *Gate) respacedSince(l *local, t time.Time) bool {
	g.mu.Lock()
	defer g.mu.Unlock()
	return l.respacedAt.After(t)
}
