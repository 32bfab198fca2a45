// Package gatehook is the job runner's way into what package shaper keeps
// off its API: a bucket's record of tagged calls and its line, which a
// worker reads to give a dead worker's calls back; the plans that hold a
// queue's backlog in its schedule; the buckets with callers in this
// process; the process's replica id; the widest tick replicas ask under;
// and the round trips vendorclients measures. queue/, internal/report and
// vendorclients call these; a program that only shapes its own calls has
// no need of them.
//
// Package shaper owns each of them and sets it here in its init (the
// pattern of gRPC's internal package), so they are set in any program
// that has a gate to pass them. This package cannot import shaper, which
// imports it: a hook takes the gate's handles as any, of the type its doc
// names (a *shaper.Bucket, *shaper.Group or *shaper.Gate), and panics on
// any other.
package gatehook

import (
	"context"
	"time"
)

// Tag is a tag of a granted call (shaper.Request.Tag) and the call's
// tick.
type Tag struct {
	Tag  string
	Tick time.Time // Redis time
}

// Backlog is a bucket of a group with calls planned ahead: the last of
// them is due in Ahead (at the bucket's pace, about its backlog).
type Backlog struct {
	Bucket string
	Ahead  time.Duration
}

// ReplicaTick is the configured tick of a replica that asked for a tick
// of a bucket lately.
type ReplicaTick struct {
	Replica  string
	Interval time.Duration
	Burst    int
}

var (
	// Tagged returns the tags of the calls of bucket (a *shaper.Bucket)
	// granted a tick after after (Redis time), oldest tick first,
	// whichever replica granted them. A tag leaves the record 30 s after
	// its tick, or at Untag; a tag granted again keeps its latest tick.
	Tagged func(ctx context.Context, bucket any, after time.Time) ([]Tag, error)
	// Untag takes tags out of the record of bucket (a *shaper.Bucket).
	Untag func(ctx context.Context, bucket any, tags ...string) error
	// Lined returns the members (shaper.Request.Tag, where set) of the
	// calls waiting in the line of bucket (a *shaper.Bucket): calls not
	// granted a tick, which a job runner may give back when the worker
	// that holds them died. It counts those that left the line lately
	// for not coming back when due (their callers may have died).
	Lined func(ctx context.Context, bucket any) ([]string, error)
	// Unline takes members out of the line of bucket (a *shaper.Bucket).
	Unline func(ctx context.Context, bucket any, members ...string) error
	// TagsInSet keeps the record of tagged calls of bucket (a
	// *shaper.Bucket made by Gate.Bucket) in its group's sorted set of
	// tags rather than in its ticks list: the vendor-level bucket of a
	// per-account vendor, whose group's accounts record their calls in
	// that set, which recover reads through this bucket. Call it before
	// the bucket is used. Without it, that bucket's first grant takes
	// the set for a previous layout's record and turns it into its ticks
	// list, each account's next grant turns it back into the set, and the
	// bucket keeps its tags in the set for tagKeep (see shaper's retag):
	// no grant fails, but a key changes form twice.
	TagsInSet func(bucket any)
	// Plan says when n calls of bucket (a *shaper.Bucket), queued now
	// behind those planned before, can expect their ticks: the first
	// after first, then one every pace (the bucket's effective rate, or
	// its fair share of its group's total). A queue uses it to hold a
	// backlog in its schedule; the calls still Acquire their ticks,
	// which is what keeps the limits.
	Plan func(ctx context.Context, bucket any, n int) (first, pace time.Duration, err error)
	// Backlogs returns the n buckets of group (a *shaper.Group) whose
	// planned calls reach furthest ahead, longest first, and how many of
	// its buckets have calls planned ahead: the accounts with a backlog,
	// read in one round trip.
	Backlogs func(ctx context.Context, group any, n int) ([]Backlog, int64, error)
	// ActiveIn returns the buckets of group that have callers waiting in
	// gate (a *shaper.Gate), by their names in the group: after a change
	// of their policy these are the ones with ticks reserved at the old
	// spacing in this process. The list is as long as the work in
	// flight, not as the group's buckets.
	ActiveIn func(gate any, group string) []string
	// Replica returns the replica id of gate (a *shaper.Gate):
	// shaper.Config.Replica, or the one it made. A job runner may name
	// its worker by it.
	Replica func(gate any) string
	// Widest returns the most conservative tick a replica asked for a
	// tick of bucket (a *shaper.Bucket) under in the last 5 s, which
	// every replica spaces by while replicas disagree on the config (a
	// rolling edit); ok is false when none is live.
	Widest func(ctx context.Context, bucket any) (t ReplicaTick, ok bool, err error)
	// ObserveRoundTrip tells bucket (a *shaper.Bucket) how long one call
	// to the vendor took, from its start to its answer: the spread of
	// round trips is the network jitter a refusal is judged with
	// (shaper.Control.Refused), and a bucket whose guard follows
	// measurement (shaper.Policy.MeasureGuard) widens or narrows its
	// margin by it. vendorclients calls it for every answer.
	ObserveRoundTrip func(bucket any, d time.Duration)
)
