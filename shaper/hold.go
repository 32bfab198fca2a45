package shaper

import (
	"context"
	"slices"
	"time"
)

// A process's callers of one bucket that hold a granted tick and sleep
// until it hold interchangeable ticks: any of them may start at any of
// those ticks, and every limit holds the same (a tick carries its lease
// and its units: only callers of the same cost trade). Two moves use it,
// both inside the process, with no round trip to Redis:
//
//   - A caller that wakes too late for its tick gives it up, takes the
//     next holder's tick, and each later holder the next one's; the last
//     holder, the process's newest caller, asks the gate again. The late
//     caller keeps its place in its lane; the newest loses one, behind the
//     calls granted since it asked (without this the late caller went
//     behind every tick up to the horizon).
//   - A high call takes the tick of the earliest normal holder that comes
//     before its own, each of those normal holders the next one's, and the
//     last of them the high call's: behind a backlog, a high call waits
//     for the next tick the process holds, not for every tick up to the
//     horizon (the other replicas' granted ticks still go first).
//
// The gate's record of who holds a call (Request.Holder) keeps the tick
// each was granted: a traded tick is never earlier than the record says
// for the caller that gave it on, so a record errs toward "may have
// started" (G6 unharmed: such a call waits for asynq's lease instead of
// coming back at once).

// held is one granted tick as a caller holds it.
type held struct {
	r        reservation
	sent     time.Time // when the round trip that granted it was sent
	earliest time.Time // the tick at the earliest (sent + wait)
	tick     time.Time // the tick at the latest (answered + wait): sleep until then
}

// holder is a caller sleeping until its tick.
type holder struct {
	lane Lane
	cost int
	// Guarded by Gate.mu.
	g  held
	ok bool // g is a tick (false: it was handed on, or dropped; ask again)
	// dropped: g was taken away by a pause or a respace (dropHolders),
	// and the caller gives it up.
	dropped bool
	moved   func() // wakes the caller from its sleep: g or ok changed
}

// fenceTrip is how long a Request.Fence may take and still count as
// making no round trip (a check in memory, microseconds, like the code
// around it); one that takes longer has its time counted as lateness.
const fenceTrip = time.Millisecond

// tradeLead is how close to its tick a holder may be and still have its
// tick taken: a holder about to wake keeps it.
const tradeLead = time.Millisecond

// peers returns l's holders that may trade ticks with h, in the order of
// their ticks: the same cost and lane, holding a tick more than tradeLead
// after now. (Any handle of the bucket: a per-account vendor makes one per
// call. A tick carries what its grant decided, its tolerance and when it
// was asked, so a respace drops it whoever holds it.) g.mu is held.
func (l *local) peers(h *holder, lane Lane, now time.Time) []*holder {
	var out []*holder
	for _, p := range l.holding {
		if p != h && p.ok && p.cost == h.cost && p.lane == lane && p.g.tick.Sub(now) > tradeLead {
			out = append(out, p)
		}
	}
	return out
}

// sortHolding keeps l.holding in the order of the holders' ticks. g.mu
// is held.
func (l *local) sortHolding() {
	slices.SortStableFunc(l.holding, func(a, b *holder) int { return a.g.tick.Compare(b.g.tick) })
}

func (p *holder) wake() {
	if p.moved != nil {
		p.moved()
	}
}

// drop takes h out of the line and gives up the tick it holds, if any
// (its caller ends).
func (b *Bucket) drop(ctx context.Context, l *local, h *holder) {
	b.gate.mu.Lock()
	g, ok := h.g, h.ok
	l.unhold(h)
	b.gate.mu.Unlock()
	if ok {
		_ = b.giveUp(context.WithoutCancel(ctx), g.r.lease, "", g.r.tick, h.cost, g.r.tag)
	}
}

// handOn gives h, whose tick is past, the next peer's tick, each later
// peer the next one's, and takes the last peer's away (it asks again).
// Returns false, with h out of the line, when no peer holds a later
// tick. g.mu is held.
func (l *local) handOn(h *holder, now time.Time) bool {
	ps := l.peers(h, h.lane, now)
	if len(ps) == 0 {
		l.unhold(h)
		return false
	}
	h.g = ps[0].g
	for i := 0; i+1 < len(ps); i++ {
		ps[i].g = ps[i+1].g
		ps[i].wake()
	}
	last := ps[len(ps)-1]
	last.ok = false
	last.wake()
	l.unhold(last)
	l.sortHolding()
	return true
}

// jumpAhead gives the high call h the tick of the earliest normal peer
// before its own, each of those peers the next one's, and the last of
// them h's. g.mu is held.
func (l *local) jumpAhead(h *holder, now time.Time) {
	var ps []*holder
	for _, p := range l.peers(h, Normal, now) {
		if p.g.tick.Before(h.g.tick) {
			ps = append(ps, p)
		}
	}
	if len(ps) == 0 {
		return
	}
	mine := h.g
	h.g = ps[0].g
	for i := 0; i+1 < len(ps); i++ {
		ps[i].g = ps[i+1].g
		ps[i].wake()
	}
	ps[len(ps)-1].g = mine
	ps[len(ps)-1].wake()
	l.sortHolding()
}

// unhold takes h out of the line. g.mu is held.
func (l *local) unhold(h *holder) {
	if i := slices.Index(l.holding, h); i >= 0 {
		l.holding = slices.Delete(l.holding, i, i+1)
	}
}

// holdTick sleeps until the tick g was granted, or one traded for it, and
// returns the permit to start at it; nil (and no error) when the caller
// must ask the gate again: it woke too late and no later tick was held
// here, its tick went to a caller before it, or a pause or a respace
// dropped it.
func (b *Bucket) holdTick(ctx context.Context, l *local, req Request, g held) (*Permit, error) {
	gate := b.gate
	clock := gate.clock
	h := &holder{lane: req.Lane, cost: req.Cost, g: g, ok: true}
	gate.mu.Lock()
	if l.respacedAt.After(g.sent) {
		// A respace was heard while the grant was on its way: drop it
		// now, with the others (dropHolders), not at its tick.
		gate.mu.Unlock()
		if err := b.giveUp(ctx, g.r.lease, gaveUpDropped, g.r.tick, req.Cost, g.r.tag); err != nil {
			return nil, err
		}
		return nil, nil
	}
	l.holding = append(l.holding, h)
	l.sortHolding()
	if req.Lane == High {
		l.jumpAhead(h, clock.Now())
	}
	gate.mu.Unlock()
	for {
		gate.mu.Lock()
		cur, ok, dropped := h.g, h.ok, h.dropped
		sleep, cancel := context.WithCancel(ctx)
		h.moved = cancel
		gate.mu.Unlock()
		if !ok {
			cancel()
			if dropped { // granted before a pause began, or a respace
				if err := b.giveUp(ctx, cur.r.lease, gaveUpDropped, cur.r.tick, req.Cost, cur.r.tag); err != nil {
					return nil, err
				}
			}
			return nil, nil // handed on or dropped: ask again
		}
		err := clock.Sleep(sleep, cur.tick.Sub(clock.Now()))
		cancel()
		if ctx.Err() != nil {
			b.drop(ctx, l, h)
			return nil, ctx.Err()
		}
		now := clock.Now()
		gate.mu.Lock()
		if err != nil || !h.ok || h.g != cur {
			gate.mu.Unlock()
			continue // woken: its tick changed
		}
		late := now.Sub(cur.earliest)
		b.observeLate(late)
		_, _, _, tolerance := b.spacing()
		if cur.r.tolerance > 0 {
			tolerance = min(tolerance, cur.r.tolerance)
		}
		if late > tolerance {
			again := l.handOn(h, now)
			gate.mu.Unlock()
			if err := b.giveUp(ctx, cur.r.lease, gaveUpLate, cur.r.tick, req.Cost, cur.r.tag); err != nil {
				if again {
					b.drop(ctx, l, h) // the tick it was handed
				}
				return nil, err
			}
			if again {
				continue
			}
			return nil, nil
		}
		l.unhold(h)
		gate.mu.Unlock()
		if gate.pausedAt(l, now) || gate.respacedSince(l, cur.sent) {
			// Granted before a pause began (the vendor just said stop), or
			// at a spacing that has since changed: ask again.
			if err := b.giveUp(ctx, cur.r.lease, gaveUpDropped, cur.r.tick, req.Cost, cur.r.tag); err != nil {
				return nil, err
			}
			return nil, nil
		}
		if gap := b.startGap(cur.r); gap > 0 {
			// Spaced by actual starts: wait for the start before this one
			// to be gap behind, within what is left of the tolerance.
			wait, ok, err := b.stampStart(ctx, gap, tolerance-max(late, 0))
			if err == nil && !ok {
				err = b.giveUp(ctx, cur.r.lease, gaveUpLate, cur.r.tick, req.Cost, cur.r.tag)
				if err == nil {
					return nil, nil
				}
			}
			if err != nil {
				return nil, err
			}
			if err := clock.Sleep(ctx, wait); err != nil {
				_ = b.giveUp(context.WithoutCancel(ctx), cur.r.lease, "", cur.r.tick, req.Cost, cur.r.tag)
				return nil, err
			}
			late += wait
			now = clock.Now()
		}
		if req.Fence != nil {
			// The job runner's last word on whether it may still start
			// the call; a round trip it makes uses up tolerance like any.
			if err := req.Fence(ctx, time.UnixMicro(cur.r.tick)); err != nil {
				_ = b.giveUp(context.WithoutCancel(ctx), cur.r.lease, gaveUpDropped, cur.r.tick, req.Cost, cur.r.tag)
				return nil, err
			}
			if after := clock.Now(); after.Sub(now) > fenceTrip {
				late += after.Sub(now)
				now = after
				if late > tolerance {
					if err := b.giveUp(ctx, cur.r.lease, gaveUpLate, cur.r.tick, req.Cost, cur.r.tag); err != nil {
						return nil, err
					}
					return nil, nil
				}
			}
		}
		return &Permit{Tick: cur.tick, Late: max(late, 0), bucket: b, lease: cur.r.lease, at: cur.r.tick, tag: cur.r.tag, granted: now}, nil
	}
}

// startGap is the least gap between the start of a call granted r and
// the start before it, for a bucket spaced by actual starts (see
// startLua): a vendor that enforces spacing, said in the policy or
// learned (a margin lesson in force: r.gap); 0 for any other.
func (b *Bucket) startGap(r reservation) time.Duration {
	if r.gap > 0 || !b.policy.StrictSpacing {
		return r.gap
	}
	iv, burst, _, _ := b.spacing()
	if burst != 1 {
		return 0
	}
	bare, _ := tickFor(b.policy.spaced(), 1, 0, 0)
	return startGap(iv, bare)
}
