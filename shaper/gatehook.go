package shaper

import (
	"context"
	"math"
	"time"

	"github.com/shaper-dev/shaper/internal/gatehook"
)

// The job runner's calls (queue/, internal/report, vendorclients), which
// users of the gate have no need of: shaper's own, kept off its API
// through internal/gatehook.
func init() {
	gatehook.Tagged = func(ctx context.Context, b any, after time.Time) ([]gatehook.Tag, error) {
		return b.(*Bucket).tagged(ctx, after)
	}
	gatehook.Untag = func(ctx context.Context, b any, tags ...string) error {
		return b.(*Bucket).untag(ctx, tags...)
	}
	gatehook.Lined = func(ctx context.Context, b any) ([]string, error) {
		return b.(*Bucket).lined(ctx)
	}
	gatehook.Unline = func(ctx context.Context, b any, members ...string) error {
		return b.(*Bucket).unline(ctx, members...)
	}
	gatehook.TagsInSet = func(b any) {
		b.(*Bucket).inSetUntil.Store(math.MaxInt64)
	}
	gatehook.Plan = func(ctx context.Context, b any, n int) (time.Duration, time.Duration, error) {
		return b.(*Bucket).plan(ctx, n)
	}
	gatehook.Backlogs = func(ctx context.Context, grp any, n int) ([]gatehook.Backlog, int64, error) {
		return grp.(*Group).backlogs(ctx, n)
	}
	gatehook.ActiveIn = func(g any, group string) []string {
		return g.(*Gate).activeIn(group)
	}
	gatehook.Replica = func(g any) string {
		return g.(*Gate).replica
	}
	gatehook.Widest = func(ctx context.Context, b any) (gatehook.ReplicaTick, bool, error) {
		return b.(*Bucket).Control().widest(ctx)
	}
	gatehook.ObserveRoundTrip = func(b any, d time.Duration) {
		b.(*Bucket).observeRoundTrip(d)
	}
}
