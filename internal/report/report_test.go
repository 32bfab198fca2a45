package report

import (
	"math"
	"testing"
	"time"
)

// TestFairShare: an account's least share of a total is an even split,
// or its own rate when that is lower.
func TestFairShare(t *testing.T) {
	for _, tc := range []struct {
		own, total float64
		n          int64
		want       float64
	}{
		{own: 19.61, total: 39.22, n: 3, want: 39.22 / 3},
		{own: 1.96, total: 39.22, n: 3, want: 1.96}, // its own rate is below the split
		{own: 19.61, total: 39.22, n: 0, want: 19.61},
		{own: 50, total: 39.22, n: 1, want: 39.22},
	} {
		if got := FairShare(tc.own, tc.total, tc.n); math.Abs(got-tc.want) > 1e-9 {
			t.Errorf("FairShare(%v, %v, %d) = %v, want %v", tc.own, tc.total, tc.n, got, tc.want)
		}
	}
}

func TestPerWindow(t *testing.T) {
	for _, tc := range []struct {
		rate float64
		w    time.Duration
		want string
	}{
		{19.6078, time.Second, "19.61/s"},
		{600, time.Minute, "600/1m"},
		{5000, 24 * time.Hour, "5000/24h"},
	} {
		if got := PerWindow(tc.rate, tc.w); got != tc.want {
			t.Errorf("PerWindow(%v, %v) = %q, want %q", tc.rate, tc.w, got, tc.want)
		}
	}
}
