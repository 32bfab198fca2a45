package shaper

import (
	"context"
	"errors"
	"fmt"
	mrand "math/rand/v2"
	"time"
)

// Permit is the right to start one call now.
type Permit struct {
	// Tick is the local time of the granted tick; Late is how long after
	// it the permit was handed out (at most the policy's Tolerance).
	Tick time.Time
	Late time.Duration

	bucket  *Bucket
	lease   string
	at      int64     // the tick in Redis time (µs)
	tag     string    // the tag the tick was recorded with (reservation.tag)
	granted time.Time // local time it was handed out, checked against pauses
}

// Release frees the permit's in-flight slot when the bucket has a
// MaxInFlight cap; call it when the call has finished. Without a cap it
// does nothing. A permit never released frees its slot after LeaseTTL.
// Releasing twice is harmless.
func (p *Permit) Release(ctx context.Context) error {
	if p == nil || p.lease == "" {
		return nil
	}
	lease := p.lease
	p.lease = ""
	return p.bucket.giveUp(ctx, lease, "", 0, 1, "")
}

// Lane is a call's priority within its bucket: a high call goes ahead of
// every normal call that has not started yet. Every limit holds for both
// lanes together, and high calls can starve normal ones.
type Lane int

const (
	Normal Lane = iota
	High
)

func (l Lane) String() string {
	if l == High {
		return "high"
	}
	return "normal"
}

// Request is what one call asks of its bucket.
type Request struct {
	// Cost is the units the call uses of every limit of its bucket and of
	// its group's total: 1 (the default, also for 0) up to the smallest
	// rate among them (Acquire refuses any other).
	Cost int
	Lane Lane
	// MaxWait bounds the wait (0: no bound): a deferral longer than it
	// is returned by Acquire as a *Wait error, without a permit.
	MaxWait time.Duration
	// Backlogged, when set, keeps the call's place in a backlog: a wait
	// beyond MaxWait that is only the calls ahead of it (they asked first
	// and took the ticks up to the horizon; no pause or spent limit holds
	// the call) is waited out rather than returned, and Backlogged is told
	// of it once, from the caller's goroutine, so that a job runner can
	// stop taking more calls. A caller sent back to its queue would
	// come back behind every call that asked meanwhile. Such a wait is
	// bounded by the calls waiting ahead (a job runner's concurrency over
	// its replicas) at the bucket's rate.
	Backlogged func(wait time.Duration)
	// Tag, when set, is recorded with the call's tick in the bucket's
	// record of tags, in the grant's round trip (for 30 s): a job
	// runner names the worker and the call, so that when the worker
	// dies another can tell its calls whose tick it did not live to see.
	// It holds no newline.
	Tag string
	// Order, when set (> 0), is the call's place in its bucket's queue:
	// its enqueue time in µs, later calls larger. While the bucket has a
	// backlog beyond the horizon, callers with an Order wait in a line in
	// Redis sorted by it, and only the first few ask for a tick, so that
	// every replica's callers are granted ticks in the order their calls
	// were queued (G3), whichever replica holds them and however late
	// each asks (see line.go). Used with Backlogged; the high lane skips
	// the line.
	Order int64
	// Horizon, when set and shorter than the policy's, is how far ahead a
	// tick may be reserved for this call (the line's, see line.go).
	Horizon time.Duration
	// Fence, when set, is asked just before the permit is handed out,
	// with the tick in Redis time: a job runner whose other replicas may
	// have judged it dead, and given its call to another, says no, and
	// the call starts nothing (its tick is given up). Its error is
	// returned by Acquire. It runs in the caller's goroutine and may make a
	// round trip; the common call's answer costs none.
	Fence func(ctx context.Context, tick time.Time) error
	// Waited, when set, is told of each wait at the gate (see Wait),
	// from the caller's goroutine, before the wait: tracing reads what
	// held the call from it. It costs no round trip.
	Waited func(Wait)
}

// errCost is returned for a cost no limit of the bucket can admit.
var errCost = errors.New("shaper: invalid cost")

// maxCost is the largest cost a call of the bucket can have: the
// smallest rate of its limits and of its group's total.
func (b *Bucket) maxCost() int {
	m := b.policy.maxCost()
	if b.total != nil {
		m = min(m, b.total.policy.maxCost())
	}
	return m
}

// Acquire blocks until the caller may start one call, and returns a permit
// for it. It keeps the bucket's contract: a call starts within Tolerance of
// its tick or not at all; a caller that wakes later gives the tick up and
// asks again.
//
// req, optional (at most one), is what the call asks of the bucket: its
// cost and lane, a bound on the wait, and more (see Request); without
// it, a call of one unit in the normal lane that waits as long as it
// takes. A caller that must not hold a goroutine through a long wait (a
// pause of an hour, a long backlog) sets Request.MaxWait: when the gate
// defers the call for longer, Acquire returns no permit and a *Wait as
// its error, saying how long to wait before asking again and what held
// the call (errors.As). A granted tick is at most the policy's Horizon
// away and is always waited out.
//
// Other errors: ctx ended, Redis failed (ErrUnavailable when it could
// not answer for now), a cost the bucket cannot admit, or
// Request.Fence's own.
func (b *Bucket) Acquire(ctx context.Context, req ...Request) (*Permit, error) {
	switch len(req) {
	case 0:
		return b.acquire(ctx, Request{})
	case 1:
		return b.acquire(ctx, req[0])
	}
	return nil, fmt.Errorf("shaper: Acquire of %q takes one Request at most, not %d", b.name, len(req))
}

// acquire is Acquire for one request.
func (b *Bucket) acquire(ctx context.Context, req Request) (*Permit, error) {
	if req.Cost == 0 {
		req.Cost = 1
	}
	if m := b.maxCost(); req.Cost < 1 || req.Cost > m {
		return nil, fmt.Errorf("%w: %d units for %q: a cost is a whole number from 1 to %d (the smallest rate among its limits)", errCost, req.Cost, b.name, m)
	}
	maxWait := req.MaxWait
	backlogged := false // told req.Backlogged
	clock := b.gate.clock
	l := b.gate.enter(b.name)
	defer b.gate.leave(b.name, l)
	// The line (line.go): for callers that know their place in the queue
	// and keep it through a backlog.
	lined := req.Order > 0 && req.Backlogged != nil && req.Lane == Normal
	member := ""
	queued := false // in the bucket's line in Redis
	if lined {
		member = b.lineMember(req)
		defer func() {
			if queued {
				_ = b.leaveLine(context.WithoutCancel(ctx), member)
			}
		}()
	}
	for {
		b = b.gate.currentOf(l, b) // a respace after a policy change
		admitted, rank := false, 0
		in, check := false, false
		if lined {
			in, check = b.inLine(l, clock.Now())
		}
		if check {
			var err error
			if in, err = b.lookForLine(ctx, l); err != nil {
				return nil, err
			}
		}
		if in {
			queued = true
			var err error
			if rank, err = b.waitInLine(ctx, l, req, member, &backlogged); err != nil {
				return nil, err
			}
			admitted = true
			b = b.gate.currentOf(l, b) // a respace while it waited
			// After a drop, the callers whose ticks were taken find their
			// place in the line before anyone asks (lineSettle).
			if wait := b.gate.settling(l, clock.Now()); wait > 0 {
				if err := clock.Sleep(ctx, wait); err != nil {
					return nil, err
				}
				continue
			}
			// The admitted ask one after the other, in the line's order,
			// not all at the moment they were let in.
			if err := clock.Sleep(ctx, time.Duration(rank)*b.interval/lineStagger); err != nil {
				return nil, err
			}
		}
		if b.policy.MeasureGuard && b.meter.takeRespace() {
			// The measured guard jumped (a jittery network seen at
			// last): the ticks granted at the narrower one go.
			if err := b.respaceLine(ctx); err != nil {
				return nil, err
			}
		}
		// A respace may have come while the caller waited in the line:
		// it asks under the newest handle, not the one it entered with.
		b = b.gate.currentOf(l, b)
		var r reservation
		var sent, recv time.Time
		var err error
		ask := req
		if h := max(lineHorizon, lineTicks*b.interval); lined && (req.Horizon == 0 || req.Horizon > h) {
			// A caller that knows its place holds its tick for no longer
			// than lineHorizon (or lineTicks of the bucket's ticks), from
			// the line or before one formed: one that wakes late and asks
			// again (or the holder that gives it its tick) goes behind at
			// most that many calls, and the first callers of a backlog,
			// who ask in whatever order their workers took them, pass
			// each other by at most as many before the line forms.
			ask.Horizon = h
		}
		if b.batchable(ask) {
			if err := ctx.Err(); err != nil {
				return nil, err
			}
			r, sent, recv, err = b.gate.askBatched(ctx, l, b, ask)
		} else {
			select {
			case l.asking <- struct{}{}:
			case <-ctx.Done():
				return nil, ctx.Err()
			}
			sent = clock.Now()
			r, err = b.reserve(ctx, ask)
			recv = clock.Now()
			<-l.asking
		}
		if err != nil {
			return nil, err
		}
		if !r.ok {
			if lined && r.reason == beyondHorizon {
				b.gate.lineUp(l, b.name, clock.Now())
				if !admitted {
					continue // into the line, at its place
				}
			}
			wait := r.wait
			if admitted && r.reason == beyondHorizon {
				// The admitted ask for the ticks that free up next in
				// the order of the line, one interval apart.
				wait += time.Duration(rank) * b.interval / time.Duration(max(b.burst, 1))
			}
			if r.reason == inFlightFull { // the others come back one tick apart already
				wait += time.Duration(mrand.Int64N(int64(min(b.interval, time.Second)) + 1))
			}
			deferred := Wait{For: wait, Binding: r.reason.binding()}
			if req.Waited != nil {
				req.Waited(deferred)
			}
			if maxWait > 0 && wait > maxWait {
				if req.Backlogged == nil || r.reason != beyondHorizon {
					return nil, &deferred
				}
				if !backlogged {
					backlogged = true
					req.Backlogged(wait)
				}
			}
			if err := clock.Sleep(ctx, wait); err != nil {
				return nil, err
			}
			continue
		}
		// Redis read its clock somewhere between sent and recv, so the tick
		// is somewhere in [sent+wait, recv+wait]. Start no earlier than the
		// latest and no later than Tolerance after the earliest: a slow
		// round trip uses up tolerance.
		if req.Waited != nil {
			req.Waited(Wait{For: r.wait, Binding: BoundBacklog, Granted: true})
		}
		if queued {
			// Granted: out of the line, so that the next may ask.
			queued = false
			if err := b.leaveLine(ctx, member); err != nil {
				_ = b.giveUp(context.WithoutCancel(ctx), r.lease, "", r.tick, req.Cost, r.tag)
				return nil, err
			}
		}
		p, err := b.holdTick(ctx, l, req, held{r: r, sent: sent, earliest: sent.Add(r.wait), tick: recv.Add(r.wait)})
		if err != nil {
			return nil, err
		}
		if p != nil {
			return p, nil
		}
		if lined {
			// Its tick was dropped (a pause, a respace) or given up late:
			// every replica's callers ask again at once, in the line.
			b.gate.lineUp(l, b.name, clock.Now())
		}
	}
}
