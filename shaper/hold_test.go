package shaper

import (
	"context"
	"slices"
	"sync"
	"testing"
	"time"

	"github.com/shaper-dev/shaper/internal/redistest"
)

// stepClock is a clock the test moves: Sleep blocks until the test moves
// the time past its end (or ctx ends), so the test decides who wakes
// when, late wakes included.
type stepClock struct {
	mu       sync.Mutex
	now      time.Time
	sleepers map[chan struct{}]time.Time
}

func newStepClock(at time.Time) *stepClock {
	return &stepClock{now: at, sleepers: map[chan struct{}]time.Time{}}
}

func (c *stepClock) Now() time.Time {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.now
}

func (c *stepClock) Sleep(ctx context.Context, d time.Duration) error {
	if d <= 0 {
		return ctx.Err()
	}
	c.mu.Lock()
	done := make(chan struct{})
	c.sleepers[done] = c.now.Add(d)
	c.mu.Unlock()
	select {
	case <-done:
		return nil
	case <-ctx.Done():
		c.mu.Lock()
		delete(c.sleepers, done)
		c.mu.Unlock()
		return ctx.Err()
	}
}

// set moves the time to t and wakes the sleepers whose end it reached.
func (c *stepClock) set(t time.Time) {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.now = t
	for done, until := range c.sleepers {
		if !until.After(t) {
			delete(c.sleepers, done)
			close(done)
		}
	}
}

// await waits until n callers sleep, each until one of the moments want
// (in any order), and no other: the callers have settled.
func (c *stepClock) await(t *testing.T, want ...time.Time) {
	t.Helper()
	deadline := time.Now().Add(10 * time.Second)
	for {
		c.mu.Lock()
		var got []time.Time
		for _, u := range c.sleepers {
			got = append(got, u)
		}
		c.mu.Unlock()
		slices.SortFunc(got, time.Time.Compare)
		if slices.Equal(got, want) {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("sleepers until %v, want %v", got, want)
		}
		time.Sleep(time.Millisecond)
	}
}

// TestHeldTicksTrade: callers of one process hold the next ticks of a
// bucket at 10/s. One that wakes too late for its tick keeps its place:
// it takes the next holder's tick, each later holder the next one's, and
// the newest asks the gate again. A high call that comes after them takes
// the first normal holder's tick. The clock is the test's: who wakes when
// is decided here, not by the machine.
func TestHeldTicksTrade(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	start := time.UnixMicro(testEpoch)
	setup := func(t *testing.T) (*Bucket, *stepClock, time.Time) {
		clk := newStepClock(start)
		r := newReplica(t, redistest.Addr(t), redistest.Prefix(t), clk)
		r.gate.testNow = func() int64 { return clk.Now().UnixMicro() }
		b, err := r.gate.Bucket("acme", Policy{Limits: []Limit{{Rate: 10, Window: time.Second}}, Guard: 10 * time.Millisecond})
		if err != nil {
			t.Fatal(err)
		}
		if b.interval != 101*time.Millisecond {
			t.Fatalf("interval %v", b.interval)
		}
		// A state made anew waits out the horizon; the first tick then
		// starts the line.
		for {
			res, err := b.reserve(ctx, Request{})
			if err != nil {
				t.Fatal(err)
			}
			if res.ok {
				clk.set(clk.Now().Add(res.wait))
				return b, clk, clk.Now()
			}
			clk.set(clk.Now().Add(res.wait))
		}
	}
	type result struct {
		who string
		at  time.Duration // after start
	}
	ask := func(b *Bucket, who string, lane Lane, out chan<- result) {
		p, err := b.Acquire(ctx, Request{Lane: lane})
		if err != nil {
			t.Error(err)
			out <- result{who: who}
			return
		}
		out <- result{who: who, at: time.UnixMicro(p.at).Sub(start)}
	}
	iv := 101 * time.Millisecond
	// holdThree has normal callers a, b and c ask in turn: each holds the
	// next tick after t0. Returns the ticks they sleep until.
	holdThree := func(t *testing.T, b *Bucket, clk *stepClock, t0 time.Time, out chan<- result) []time.Time {
		var want []time.Time
		for i, who := range []string{"a", "b", "c"} {
			go ask(b, who, Normal, out)
			want = append(want, t0.Add(time.Duration(i+1)*iv))
			clk.await(t, want...)
		}
		return want
	}

	t.Run("a late caller keeps its place", func(t *testing.T) {
		b, clk, t0 := setup(t)
		out := make(chan result, 3)
		holdThree(t, b, clk, t0, out)
		// a wakes 50 ms after its tick, later than its tolerance (7.5 ms).
		clk.set(t0.Add(iv + 50*time.Millisecond))
		clk.await(t, t0.Add(2*iv), t0.Add(3*iv), t0.Add(4*iv))
		var got []result
		for i := 2; i <= 4; i++ {
			clk.set(t0.Add(time.Duration(i) * iv))
			got = append(got, <-out)
		}
		want2 := []result{{"a", t0.Add(2 * iv).Sub(start)}, {"b", t0.Add(3 * iv).Sub(start)}, {"c", t0.Add(4 * iv).Sub(start)}}
		if !slices.Equal(got, want2) {
			t.Errorf("started %v, want %v (the late caller first, at the next tick)", got, want2)
		}
	})
	t.Run("a high call takes the first normal tick held", func(t *testing.T) {
		b, clk, t0 := setup(t)
		out := make(chan result, 4)
		want := holdThree(t, b, clk, t0, out)
		go ask(b, "high", High, out)
		want = append(want, t0.Add(4*iv))
		clk.await(t, want...)
		var got []result
		for i := 1; i <= 4; i++ {
			clk.set(t0.Add(time.Duration(i) * iv))
			got = append(got, <-out)
		}
		want2 := []result{{"high", t0.Add(iv).Sub(start)}, {"a", t0.Add(2 * iv).Sub(start)}, {"b", t0.Add(3 * iv).Sub(start)}, {"c", t0.Add(4 * iv).Sub(start)}}
		if !slices.Equal(got, want2) {
			t.Errorf("started %v, want %v (the high call at the first tick, the normal ones in their order after it)", got, want2)
		}
	})
}
