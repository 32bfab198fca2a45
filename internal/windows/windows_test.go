package windows

import (
	"testing"
	"time"
	"unsafe"
)

func at(ms ...int) []time.Time {
	base := time.Unix(1_700_000_000, 0)
	out := make([]time.Time, len(ms))
	for i, m := range ms {
		out[i] = base.Add(time.Duration(m) * time.Millisecond)
	}
	return out
}

func TestMaxSliding(t *testing.T) {
	tests := []struct {
		name string
		ts   []time.Time
		w    time.Duration
		want int
	}{
		{"empty", nil, time.Second, 0},
		{"one", at(5), time.Second, 1},
		{"even spacing exactly w/n", at(0, 100, 200, 300, 400, 500, 600, 700, 800, 900, 1000), time.Second, 10},
		{"half-open: event at t+w not counted", at(0, 1000), time.Second, 1},
		{"cluster in the middle", at(0, 900, 950, 1000, 1050, 2500), 200 * time.Millisecond, 4},
		{"unsorted input", at(1050, 0, 950, 900, 2500, 1000), 200 * time.Millisecond, 4},
		{"same instant", at(7, 7, 7), time.Millisecond, 3},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			if got := MaxSliding(tt.ts, tt.w); got != tt.want {
				t.Errorf("MaxSliding = %d, want %d", got, tt.want)
			}
		})
	}
}

func TestMaxFixed(t *testing.T) {
	// at() is aligned to a whole second, so phase 0 windows are [0,100) ...
	ts := at(10, 20, 30, 40, 110)
	tests := []struct {
		phase time.Duration
		want  int
	}{
		{0, 4},                      // [0,100)={10,20,30,40}
		{25 * time.Millisecond, 3},  // [-75,25)={10,20} [25,125)={30,40,110}
		{35 * time.Millisecond, 3},  // [-65,35)={10,20,30} [35,135)={40,110}
		{45 * time.Millisecond, 4},  // [-55,45)={10,20,30,40}
		{115 * time.Millisecond, 4}, // [15,115)={20,30,40,110}
	}
	for _, tt := range tests {
		if got := MaxFixed(ts, 100*time.Millisecond, tt.phase); got != tt.want {
			t.Errorf("MaxFixed(phase %s) = %d, want %d", tt.phase, got, tt.want)
		}
	}
	if got := MaxSliding(ts, 100*time.Millisecond); got != 4 {
		t.Errorf("MaxSliding = %d, want 4", got)
	}
}

func TestRateAndGaps(t *testing.T) {
	ts := at(0, 10, 20, 40)
	if got := Rate(ts); got < 74.9 || got > 75.1 {
		t.Errorf("Rate = %v, want 75", got)
	}
	g := Gaps(ts)
	if len(g) != 3 || g[0] != 10*time.Millisecond || g[2] != 20*time.Millisecond {
		t.Errorf("Gaps = %v", g)
	}
	if p := Percentile(g, 50); p != 10*time.Millisecond {
		t.Errorf("p50 = %v", p)
	}
}

// steppedMonotonic returns t with its monotonic clock reading moved by d
// and its wall clock left: what time.Now returns after the host's wall
// clock was stepped by -d against its monotonic clock (time.Time offers
// no way to build one; its layout is wall, ext (the monotonic reading
// when wall's top bit is set), loc).
func steppedMonotonic(t *testing.T, at time.Time, d time.Duration) time.Time {
	p := (*struct {
		wall uint64
		ext  int64
		loc  *time.Location
	})(unsafe.Pointer(&at))
	if p.wall&(1<<63) == 0 {
		t.Fatal("time.Now has no monotonic reading")
	}
	p.ext += int64(d)
	return at
}

// TestMaxSlidingCountsTheWallClock: two calls a minute apart on the wall
// clock, the clock vendors and Redis TIME count, whose monotonic
// readings are 52 s apart (the host's wall clock was stepped 8 s ahead
// between them) are never in one sliding window of 55 s.
func TestMaxSlidingCountsTheWallClock(t *testing.T) {
	a := time.Now()
	b := steppedMonotonic(t, a.Add(time.Minute), -8*time.Second)
	if b.Sub(a) != 52*time.Second || b.UnixNano()-a.UnixNano() != int64(time.Minute) {
		t.Fatalf("the stepped time is %s after by its monotonic reading, %s by its wall clock", b.Sub(a), time.Duration(b.UnixNano()-a.UnixNano()))
	}
	if n := MaxSliding([]time.Time{a, b}, 55*time.Second); n != 1 {
		t.Errorf("%d calls a wall-clock minute apart in a sliding window of 55 s, want 1", n)
	}
}
