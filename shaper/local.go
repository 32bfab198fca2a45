package shaper

import (
	"cmp"
	"context"
	"math"
	"slices"
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
	batch       []*asker      // callers waiting to ask in the next batch, in arrival order
	batching    bool          // a batch is on its way to Redis (its runner hands on)
	holding     []*holder     // callers holding a granted tick, in the order of their ticks (see hold.go)
	lineUntil   time.Time     // local time until which callers with an Order go through the line (line.go)
	lineChecked time.Time     // when a caller last looked for the line in Redis (line.go)
	settleUntil time.Time     // callers admitted from the line wait until then after a drop (line.go)
}

// enter registers a caller of bucket and returns the bucket's local state.
func (g *Gate) enter(bucket string) *local {
	g.mu.Lock()
	defer g.mu.Unlock()
	l, ok := g.active[bucket]
	if !ok {
		// Its callers may have taken a run of calls together: any that
		// go through the line find their places first (line.go).
		l = &local{asking: make(chan struct{}, maxAsking), settleUntil: g.clock.Now().Add(lineSettle)}
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
		l.dropHolders(func(h *holder) bool { return h.g.tick.Before(until) })
		g.lineAfterDrop(l, bucket, g.clock.Now(), until)
		if g.testNotedPause != nil {
			g.testNotedPause(bucket, until)
		}
	}
}

// dropHolders takes the ticks of the holders for which drop is true
// away, at once: they give them up and ask again together, in the line
// (line.go), rather than each at its tick, behind the calls that asked
// meanwhile. g.mu is held.
func (l *local) dropHolders(drop func(*holder) bool) {
	l.holding = slices.DeleteFunc(l.holding, func(h *holder) bool {
		if !h.ok || !drop(h) {
			return false
		}
		h.ok, h.dropped = false, true
		h.wake()
		return true
	})
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
		l.dropHolders(func(h *holder) bool { return h.g.sent.Before(at) })
		g.lineAfterDrop(l, bucket, at, at)
	}
	if g.testNotedRespace != nil {
		g.testNotedRespace(bucket, at)
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

// activeIn returns the buckets of group that have callers waiting in this
// process (their names in the group): after a change of their policy
// these are the ones with ticks reserved at the old spacing here. The
// list is as long as the work in flight, not as the group's buckets.
func (g *Gate) activeIn(group string) []string {
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

// maxBatch bounds the calls one batch asks for (see askBatched).
const maxBatch = 32

// holdTogether is the longest wait behind a high call that a batch waits
// out together (see runBatch); past it, its callers wait on their own,
// batchStagger apart.
const holdTogether = 250 * time.Millisecond

// asker is a caller waiting in a bucket's batch.
type asker struct {
	b    *Bucket
	req  Request
	done chan batchReply
}

// batchReply is a batch's answer to one caller; with lead set, no answer
// yet: the caller runs the next batch.
type batchReply struct {
	r          reservation
	sent, recv time.Time
	err        error
	lead       bool
}

// askBatched asks for the tick of one call of the common shape (see
// Bucket.batchable) together with the other callers of its bucket in this
// process: while a batch is on its way to Redis, callers line up, and the
// first of them asks for up to maxBatch of them in one round trip when it
// returns (a group commit). Ticks go to the callers in arrival order, as
// if each had asked alone. It returns the reservation and when the round
// trip that made it was sent and answered.
func (g *Gate) askBatched(ctx context.Context, l *local, b *Bucket, req Request) (reservation, time.Time, time.Time, error) {
	a := &asker{b: b, req: req, done: make(chan batchReply, 1)}
	g.mu.Lock()
	l.batch = append(l.batch, a)
	lead := !l.batching
	l.batching = true
	g.mu.Unlock()
	for {
		if lead {
			g.runBatch(ctx, l)
		}
		rep := <-a.done
		if rep.lead {
			lead = true
			continue
		}
		return rep.r, rep.sent, rep.recv, rep.err
	}
}

// orderOf is r's place in a batch: its Order, or last when it has none.
func orderOf(r Request) int64 {
	if r.Order > 0 {
		return r.Order
	}
	return math.MaxInt64
}

// runBatch asks for the first callers in line that share a bucket handle
// (at most maxBatch), answers each, and hands the next batch to the first
// caller left in line.
func (g *Gate) runBatch(ctx context.Context, l *local) {
	g.mu.Lock()
	b := l.batch[0].b
	n := 1
	for n < len(l.batch) && n < maxBatch && l.batch[n].b == b {
		n++
	}
	take := l.batch[:n:n]
	l.batch = append([]*asker(nil), l.batch[n:]...)
	g.mu.Unlock()
	// Callers that know their place in the queue ask in that order: the
	// batch's ticks are granted in it (G3).
	slices.SortStableFunc(take, func(a, b *asker) int { return cmp.Compare(orderOf(a.req), orderOf(b.req)) })
	reqs := make([]Request, n)
	for i, a := range take {
		reqs[i] = a.req
	}
	// The batch serves callers other than this one: its end is not theirs.
	ctx = context.WithoutCancel(ctx)
	var rs []reservation
	var err error
	var sent, recv time.Time
	for {
		sent = g.clock.Now()
		rs, err = b.reserveMany(ctx, reqs)
		recv = g.clock.Now()
		// Told to step aside together for a high call: wait together and
		// ask again in the same order, rather than come back in a race
		// that shuffles the lane (callers that come meanwhile line up
		// behind).
		if err != nil || rs[0].ok || rs[0].reason != behindHigh || rs[0].wait > holdTogether {
			break
		}
		if err = g.clock.Sleep(ctx, rs[0].wait); err != nil {
			break
		}
	}
	for i, a := range take {
		rep := batchReply{sent: sent, recv: recv, err: err}
		if err == nil {
			rep.r = rs[i]
		}
		a.done <- rep
	}
	g.mu.Lock()
	defer g.mu.Unlock()
	if len(l.batch) > 0 {
		l.batch[0].done <- batchReply{lead: true}
	} else {
		l.batching = false
	}
}
