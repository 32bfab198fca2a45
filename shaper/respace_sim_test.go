package shaper

import (
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"
)

// heardByAll runs what (a config edit, a 429) on simulated replicas and
// hands every message it published on the bucket's pause and respace
// channels to every replica's gate, through Watch's own handler (hear),
// at the simulated moment it ran: the gates of a deployment Watch, and a
// replica whose own Respace finds the line already restarted by another
// (it returns without dropping anything) drops the ticks the restart cut
// away only when it hears the first one's respace. A marker published
// after what ends the messages to hand on: Redis hands a subscriber the
// messages in the order they were published.
func heardByAll(t *testing.T, rs []*replica, what func()) {
	t.Helper()
	ctx := context.Background()
	g := rs[0].gate
	sub := rs[0].rdb.Subscribe(ctx, pauseChannel(g.prefix), respaceChannel(g.prefix))
	defer sub.Close()
	for range 2 { // the subscriptions' confirmations
		if _, err := sub.ReceiveTimeout(ctx, 10*time.Second); err != nil {
			t.Errorf("subscribe: %v", err)
			return
		}
	}
	what()
	marker := fmt.Sprintf("heard|%d", time.Now().UnixNano())
	if err := rs[0].rdb.Publish(ctx, respaceChannel(g.prefix), marker).Err(); err != nil {
		t.Errorf("publish the marker: %v", err)
		return
	}
	for {
		m, err := sub.ReceiveTimeout(ctx, 10*time.Second)
		if err != nil {
			t.Errorf("the messages of %s: %v", g.clock.Now().Format("15:04:05.000"), err)
			return
		}
		msg, ok := m.(*redis.Message)
		if !ok {
			continue
		}
		if msg.Payload == marker {
			return
		}
		for _, r := range rs {
			r.gate.hear(msg.Channel, msg.Payload)
		}
	}
}

// simEdit is a config edit every replica of simulateBacklog applies at
// once: the handle of the bucket's new policy, rate calls a second (10
// ms guard), respaced on each; the respace reaches every replica
// (heardByAll).
func simEdit(t *testing.T, rate int) func([]*replica, []*Bucket) {
	p := Policy{Limits: []Limit{{Rate: rate, Window: time.Second}}, Guard: 10 * time.Millisecond}
	return func(rs []*replica, _ []*Bucket) {
		heardByAll(t, rs, func() {
			for _, r := range rs {
				nb, err := r.gate.Bucket("line", p)
				if err != nil {
					t.Error(err)
					return
				}
				if err := nb.Control().Respace(context.Background()); err != nil {
					t.Error(err)
				}
			}
		})
	}
}

// simPause is a 429 with Retry-After: 1 heard by the first replica of
// simulateBacklog; the others hear of its pause by its message
// (heardByAll).
func simPause(t *testing.T) func([]*replica, []*Bucket) {
	return func(rs []*replica, bs []*Bucket) {
		heardByAll(t, rs, func() {
			if _, err := bs[0].Control().Pause(context.Background(), time.Second, "rate_limited"); err != nil {
				t.Error(err)
			}
		})
	}
}

// TestEditedRateHoldsG1OnSimulatedTime: three replicas hold a backlog
// of 450 calls to a bucket whose rate is edited 100 -> 60 at 1.5 s,
// paused by a 429 (Retry-After: 1) at 3 s and edited back to 100 at
// 4.5 s, on simulated time. At 4.5 s the second replica's callers hold
// the head of the backlog, ticks up to a line horizon ahead at the 60/s
// spacing (16.8 ms), and the first replica's respace restarts the line;
// the second's own Respace finds it restarted and drops nothing. Those
// ticks go only when the second replica hears the first's respace:
// before the simulation handed the respace on (it handed on the pause
// only), they went out among the new line's ticks at 10.1 ms, 107 ticks
// in one second.
func TestEditedRateHoldsG1OnSimulatedTime(t *testing.T) {
	var restarts []time.Duration // when each edit's line restarted, simulated
	start := time.UnixMicro(testEpoch)
	edit := func(rate int) func([]*replica, []*Bucket) {
		e := simEdit(t, rate)
		return func(rs []*replica, bs []*Bucket) {
			restarts = append(restarts, rs[0].gate.clock.Now().Sub(start)+respaceSlack)
			e(rs, bs)
		}
	}
	run := simulateBacklog(t, 3, 450, 0, 41, map[time.Duration]func([]*replica, []*Bucket){
		1500 * time.Millisecond: edit(60), 3 * time.Second: simPause(t), 4500 * time.Millisecond: edit(100)})
	if len(run.starts) != run.n {
		t.Fatalf("%d of %d calls started", len(run.starts), run.n)
	}
	if len(restarts) != 2 {
		t.Fatalf("%d edits ran, want 2", len(restarts))
	}
	// most is the most ticks in a second that starts at or after from,
	// counting the ticks before to.
	most := func(from, to time.Duration) int {
		m, j := 0, 0
		for i, x := range run.ticks {
			if x < testEpoch+from.Microseconds() {
				continue
			}
			j = max(j, i)
			for j < len(run.ticks) && run.ticks[j]-x < time.Second.Microseconds() && run.ticks[j] < testEpoch+to.Microseconds() {
				j++
			}
			m = max(m, j-i)
		}
		return m
	}
	all, lowered, raised := run.mostInWindow(time.Second), most(restarts[0], restarts[1]), most(restarts[1], time.Hour)
	t.Logf("most ticks in a second: %d in all, %d from the restart at 60/s to the one at 100/s (through the pause), %d after", all, lowered, raised)
	if all > 100 {
		t.Errorf("%d ticks in one second, limit 100 (G1)", all)
	}
	if lowered > 60 {
		t.Errorf("%d ticks in one second at 60/s, from its restart (G1)", lowered)
	}
}

// TestRaisedRateReachesTheLine: a backlog of 400 calls waits in the line
// of a 50/s bucket, on one replica and on three, and the rate is raised
// to 100/s at 1 s. The callers admitted from the line after the raise
// entered it under the old policy; they ask under the new one (the
// handle the respace made current), so the second after the restart
// holds more ticks than the old spacing (20.2 ms) allows, and at most
// 100. When they asked under the handle they entered with, they spaced
// by the wider of the two ticks (see widest), the old one, until the
// line that waited at the raise was through: 51 ticks in that second.
// With the fix, 99 on an idle machine; beside two busy processes 88-99
// at three replicas, where a simulated replica's goroutines are not all
// asleep when the simulated clock moves (the simulation's two clocks):
// the bound is the old spacing's, not the new rate's.
func TestRaisedRateReachesTheLine(t *testing.T) {
	for _, replicas := range []int{1, 3} {
		t.Run(fmt.Sprintf("%d replicas", replicas), func(t *testing.T) {
			const raise = time.Second
			run := simulateBacklogAt(t, 50, replicas, 400, 0, 41, map[time.Duration]func([]*replica, []*Bucket){raise: simEdit(t, 100)})
			if len(run.starts) != run.n {
				t.Fatalf("%d of %d calls started", len(run.starts), run.n)
			}
			// The second after the line restarted, and the settling of
			// the callers its respace dropped (lineSettle).
			from := testEpoch + (raise + respaceSlack + lineSettle).Microseconds()
			n := 0
			for _, x := range run.ticks {
				if x >= from && x < from+time.Second.Microseconds() {
					n++
				}
			}
			t.Logf("%d ticks in the second from %s after the raise", n, respaceSlack+lineSettle)
			if n <= 60 || n > 100 {
				t.Errorf("%d ticks in the second after the raise from 50/s to 100/s took effect, want more than the old spacing allows (51) by a clear margin (over 60) and at most 100", n)
			}
		})
	}
}
