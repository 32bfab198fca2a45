package queue

import (
	"fmt"
	"maps"

	"github.com/shaper-dev/shaper/shaper"
)

// plan is a checked change of the vendor list, made before anything
// changes.
type plan struct {
	added   []*vendorRuntime
	changed map[string]*shaper.Bucket
	shapes  map[string]*accountShape // per-account vendors' new shapes
	respace []*shaper.Bucket         // buckets whose tick changed
	// reshaped are per-account vendors' shapes before and after, whose
	// accounts with calls in flight here are respaced when their tick
	// changed.
	reshaped [][2]*accountShape
	vendors  []Vendor
	notes    []string
}

// Apply brings the worker to a new vendor list (a config reload): a
// changed rate, window, burst, guard or limit applies to the next grant,
// with no burst (the next tick is the last one plus the new interval);
// added vendors are served once their queues have work; removed ones stop
// taking calls (their queued calls stay in Redis). Changes to base_url,
// headers, timeouts and concurrency take effect when the worker restarts;
// Apply says so in its notes. Apply checks everything before it changes
// anything: on error nothing changed. It returns ErrStopped once Run has
// returned.
func (w *Worker) Apply(vendors []Vendor) (notes []string, err error) {
	w.applyMu.Lock()
	defer w.applyMu.Unlock()
	p := &plan{changed: map[string]*shaper.Bucket{}, shapes: map[string]*accountShape{}, vendors: vendors}
	w.mu.Lock()
	current := maps.Clone(w.vendors)
	w.mu.Unlock()
	for _, v := range vendors {
		rt, ok := current[v.Name]
		if !ok {
			nrt, err := w.newRuntime(v)
			if err != nil {
				return nil, err
			}
			p.added = append(p.added, nrt)
			p.notes = append(p.notes, fmt.Sprintf("vendor %s added", v.Name))
			continue
		}
		b, err := vendorBucket(w.gate, v)
		if err != nil {
			return nil, err
		}
		p.changed[v.Name] = b
		sh, err := w.shapeOf(v)
		if err != nil {
			return nil, err
		}
		p.shapes[v.Name] = sh
		if old := rt.shape.Load(); old != nil && sh != nil {
			p.reshaped = append(p.reshaped, [2]*accountShape{old, sh})
		}
		cur := rt.applied.Load()
		if v.PerAccount != cur.PerAccount {
			p.notes = append(p.notes, fmt.Sprintf("vendor %s: per_account changed: calls already queued keep their account (or none) and are refused by the new shape", v.Name))
		}
		oldIv, oldBurst := rt.bucket().Policy().Tick()
		newIv, newBurst := b.Policy().Tick()
		if oldIv != newIv || oldBurst != newBurst {
			p.notes = append(p.notes, fmt.Sprintf("vendor %s: tick %d every %s -> %d every %s", v.Name, oldBurst, oldIv, newBurst, newIv))
			p.respace = append(p.respace, b)
		}
		if v.BaseURL != cur.BaseURL || v.Timeout != cur.Timeout || v.Concurrency != cur.Concurrency ||
			v.UserAgent != cur.UserAgent || !maps.Equal(v.Headers, cur.Headers) {
			p.notes = append(p.notes, fmt.Sprintf("vendor %s: base_url, headers, user_agent, timeout and concurrency changes apply when the worker restarts", v.Name))
		}
	}
	w.mu.Lock()
	state := w.state
	if state == notStarted {
		defer w.mu.Unlock()
		_, err := w.commitLocked(p) // not running: nothing to stop
		return p.notes, err
	}
	w.mu.Unlock()
	if state == stopped {
		return nil, ErrStopped
	}
	req := applyRequest{plan: p, reply: make(chan error, 1)}
	select {
	case w.applyc <- req:
	case <-w.stopped:
		return nil, ErrStopped
	}
	if err := <-req.reply; err != nil {
		return nil, err
	}
	return p.notes, nil
}

// commit carries out a plan on the running worker, from Run's goroutine,
// and returns the removed vendors, for Run to stop. Added vendors are
// served once their queues have work, like the others.
func (w *Worker) commit(p *plan) ([]*vendorRuntime, error) {
	w.mu.Lock()
	defer w.mu.Unlock()
	return w.commitLocked(p)
}

// commitLocked carries out p; w.mu is held. It returns the removed
// vendors.
func (w *Worker) commitLocked(p *plan) ([]*vendorRuntime, error) {
	keep := map[string]bool{}
	for _, v := range p.vendors {
		keep[v.Name] = true
		if b, ok := p.changed[v.Name]; ok {
			rt := w.vendors[v.Name]
			rt.client.SetBucket(b) // the whole policy: limits, in-flight cap, adaptation
			rt.shape.Store(p.shapes[v.Name])
			// A new snapshot, never a write to the one the vendor's
			// goroutines read (the supervisor, a server starting).
			nv := *rt.applied.Load()
			nv.Policy, nv.PerAccount, nv.Overrides, nv.Total = v.Policy, v.PerAccount, v.Overrides, v.Total
			nv.MaxAnswer, nv.KeepHeaders = v.MaxAnswer, v.KeepHeaders
			rt.applied.Store(&nv)
		}
	}
	for _, rt := range p.added {
		w.vendors[rt.vendor.Name] = rt
	}
	var removed []*vendorRuntime
	for name, rt := range w.vendors {
		if !keep[name] {
			delete(w.vendors, name)
			removed = append(removed, rt)
			p.notes = append(p.notes, fmt.Sprintf("vendor %s removed: its worker stops; queued calls stay in Redis", name))
		}
	}
	return removed, nil
}
