package shaper

import (
	"fmt"
	"time"
)

// Group is a set of buckets that share a Redis Cluster hash tag and, if it
// has one, a total limit over all of them (a vendor, whose accounts each
// have a bucket). While the total binds, the buckets with waiting callers
// share it max-min fairly: a bucket whose own rate is below its share
// gets its rate, and the rest is divided evenly among the others.
type Group struct {
	gate  *Gate
	name  string
	total *totalTick
	rec   *record // what its buckets' meters measure, together
}

// Name returns the group's name.
func (grp *Group) Name() string { return grp.name }

// totalTick is a group's total limit as the reserve script takes it.
type totalTick struct {
	interval time.Duration
	burst    int
	span     time.Duration // primary window + guard
	rate     float64       // calls per primary window, after guard
	window   time.Duration
	policy   Policy // the total's policy, with defaults
	limits   string // limitSpec of policy
}

// Group returns the handle of group name; total, when not nil, is a limit
// over all of its buckets together (only its Limits, Burst and Guard
// matter).
func (g *Gate) Group(name string, total *Policy) (*Group, error) {
	if err := checkName("group", name); err != nil {
		return nil, err
	}
	grp := &Group{gate: g, name: name, rec: &record{}}
	if total != nil {
		if err := total.Validate(); err != nil {
			return nil, fmt.Errorf("shaper: group %q: total: %w", name, err)
		}
		t := total.withDefaults()
		iv, burst := t.Tick()
		grp.total = &totalTick{interval: iv, burst: burst, span: t.Limits[0].Window + t.Guard,
			rate: EffectiveRate(iv, burst, t.Limits[0].Window), window: t.Limits[0].Window, policy: t, limits: limitSpec(t)}
	}
	return grp, nil
}

// Bucket returns the handle of bucket name of the group, shaped by p and by
// the group's total.
func (grp *Group) Bucket(name string, p Policy) (*Bucket, error) {
	if err := checkName("bucket", name); err != nil {
		return nil, err
	}
	return grp.bucket(name, p)
}

func (grp *Group) bucket(name string, p Policy) (*Bucket, error) {
	full := grp.name
	if name != "" {
		full += "/" + name
	}
	if err := p.Validate(); err != nil {
		return nil, fmt.Errorf("shaper: bucket %q: %w", full, err)
	}
	p = p.withDefaults()
	iv, burst := p.Tick()
	var keep time.Duration
	for _, l := range p.Limits {
		keep = max(keep, l.Window)
	}
	if grp.total != nil {
		for _, l := range grp.total.policy.Limits {
			keep = max(keep, l.Window)
		}
	}
	keep = max(keep+p.Guard, minKeep)
	b := &Bucket{gate: grp.gate, name: full, group: grp.name, member: name, policy: p, interval: iv, burst: burst, keep: keep, meter: newMeter(grp.rec),
		total: grp.total, limits: limitSpec(p), keys: keysOf(grp.gate.prefix, grp.name, name), made: grp.gate.handles.Add(1),
		core:    len(p.Limits) == 1 && grp.total == nil && p.MaxInFlight == 0 && p.Warmup == 0,
		counted: (len(p.Limits) > 1 || grp.total != nil) && p.MaxInFlight == 0 && p.Warmup == 0}
	b.gen.Store(grp.gate.edits.Load())
	return b, nil
}

// minKeep is the least a bucket's state outlives its last tick. A window
// of a few milliseconds would otherwise let the state expire between two
// calls that a busy host or Redis serves that far apart, and the next
// call would find it lost (a reset waits out the horizon).
const minKeep = 250 * time.Millisecond
