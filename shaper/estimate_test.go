package shaper

import "testing"

func TestEstimateWindowLimit(t *testing.T) {
	const w = 1_000_000
	// 10 calls 50 ms apart from 0, the 11th refused: a window that began
	// at or before the first call allowed 10; one that began mid-way (at
	// most half-way, since the window before it held no more) allowed 5.
	var ok []int64
	for i := range 10 {
		ok = append(ok, int64(i)*50_000)
	}
	lo, hi, found := estimateWindowLimit(ok, []int64{500_000}, 500_000, w, true)
	if !found || lo != 5 || hi != 10 {
		t.Errorf("cold start: limit in [%d, %d] (found %v), want [5, 10]", lo, hi, found)
	}
}
