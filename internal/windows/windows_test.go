package windows

import (
	"testing"
	"time"
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
