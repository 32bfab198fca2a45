package shaper

import (
	"strings"
	"time"
)

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
	current     *Bucket       // the handle a respace made current (nil: none)
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

// supersede makes b the handle this process's callers of its bucket use
// from their next request on (see Control.Respace).
func (g *Gate) supersede(b *Bucket) {
	g.mu.Lock()
	defer g.mu.Unlock()
	if l, ok := g.active[b.name]; ok && (l.current == nil || b.made > l.current.made) {
		l.current = b
	}
}

// currentOf returns the handle a caller holding b uses: the one a respace
// made current when it is newer than b, else b.
func (g *Gate) currentOf(l *local, b *Bucket) *Bucket {
	g.mu.Lock()
	defer g.mu.Unlock()
	if l.current != nil && l.current.made > b.made {
		return l.current
	}
	return b
}

// ActiveIn returns the buckets of group that have callers waiting in this
// process (their names in the group): after a change of their policy
// these are the ones with ticks reserved at the old spacing here. The
// list is as long as the work in flight, not as the group's buckets.
func (g *Gate) ActiveIn(group string) []string {
	g.mu.Lock()
	defer g.mu.Unlock()
	var out []string
	for name := range g.active {
		if member, ok := strings.CutPrefix(name, group+"/"); ok {
			out = append(out, member)
		}
	}
	return out
}
