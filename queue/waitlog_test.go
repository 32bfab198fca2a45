package queue

import (
	"log/slog"
	"strings"
	"testing"
	"time"

	"github.com/shaper-dev/shaper/internal/logtest"
	"github.com/shaper-dev/shaper/shaper"
)

// TestWaitLogSaysAStateOnce drives a vendor's waitLog the way its
// supervisor does, on simulated time: a minute of a backlog whose queue
// is paused and unpaused every half second (what logged "vendor
// backlogged" and "unpaused" 69 and 121 times a minute), then no pause:
// one line when the backlog begins, none while it lasts, one when the
// calls sent back have come back; then a pause the vendor asked for that
// turns into a backlog: one line for each.
func TestWaitLogSaysAStateOnce(t *testing.T) {
	logs := &logtest.Buffer{}
	l := &waitLog{log: slog.New(slog.NewTextHandler(logs, nil)), maxWait: 5 * time.Second, back: 2 * time.Second}
	count := func(s string) int { return strings.Count(logs.String(), s) }
	now := time.Now()
	step := func() { now = now.Add(supervisorEvery) }
	for range 40 { // a minute: paused, seen near (unpaused), running
		l.paused(now, shaper.Stats{NextTick: 5200 * time.Millisecond})
		step()
		l.paused(now, shaper.Stats{NextTick: 4900 * time.Millisecond})
		step()
		l.running(now)
	}
	if n, m := count("vendor backlogged"), count("no longer backlogged"); n != 1 || m != 0 {
		t.Fatalf("a minute of pauses and unpauses logged %d backlogs and %d ends, want 1 and 0:\n%s", n, m, logs)
	}
	// The last calls sent back had a wait of 4.9 s: they are back within
	// 4.9 s + back of the last pause seen, and the state ends then.
	lastSeen := now.Add(-supervisorEvery)
	for range 30 {
		step()
		l.running(now)
		ended := count("no longer backlogged") == 1
		if want := !now.Before(lastSeen.Add(4900*time.Millisecond + l.back)); ended != want {
			t.Fatalf("%s after the last pause: ended %v, want %v:\n%s", now.Sub(lastSeen), ended, want, logs)
		}
	}
	if n := count("no longer backlogged"); n != 1 {
		t.Fatalf("the end logged %d times, want once:\n%s", n, logs)
	}
	// A pause the vendor asked for, then the backlog it leaves.
	for range 10 {
		step()
		l.paused(now, shaper.Stats{NextTick: 30 * time.Second, PausedFor: 30 * time.Second, PauseReason: "429, Retry-After 30"})
	}
	for range 10 {
		step()
		l.paused(now, shaper.Stats{NextTick: 6 * time.Second})
	}
	if n, m := count("vendor paused beyond max_wait"), count("vendor backlogged"); n != 1 || m != 2 {
		t.Errorf("a pause then a backlog logged %d pauses and %d backlogs in all, want 1 and 2:\n%s", n, m, logs)
	}
	if !strings.Contains(logs.String(), `reason="429, Retry-After 30"`) {
		t.Errorf("the pause's line lacks its reason:\n%s", logs)
	}
}
