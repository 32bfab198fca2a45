package ui

import (
	"time"

	"github.com/shaper-dev/shaper/internal/report"
)

// sample is one vendor's state at one sampling: its counters (their
// differences make the chart) and its gauges.
type sample struct {
	at       time.Time // Redis time of the read
	granted  int64     // ticks granted since the gate's state was created
	limited  int64     // rate-limited answers (429s) since then
	rate     float64   // effective rate, calls per second
	limit    float64   // the configured rate, calls per second
	queued   int64
	inFlight int64
}

// pause is one pause on the timeline. Seen is the first sampling that
// saw it: it began at most one sampling period before.
type pause struct {
	Seen   time.Time `json:"seen"`
	Until  time.Time `json:"until"`
	Reason string    `json:"reason"`
}

// history is what the page shows of one vendor over time: the latest
// keep samples (a ring) and the latest keepPauses pauses. Its size is
// bounded whatever the vendor's traffic.
type history struct {
	samples []sample // oldest first once full: samples[next:] then samples[:next]
	next    int
	full    bool
	keep    int

	pauses     []pause // oldest first
	keepPauses int
	lastUntil  time.Time // the latest pause's end, as last read
}

func newHistory(keep, keepPauses int) *history {
	return &history{samples: make([]sample, 0, keep), keep: keep, keepPauses: keepPauses}
}

// add records v, read at its RedisTime.
func (h *history) add(v report.VendorState) {
	rate, limit := chartRates(v)
	s := sample{at: v.RedisTime, granted: v.GrantedTotal, limited: v.RateLimitedTotal,
		rate: rate, limit: limit, queued: v.Queued, inFlight: v.InFlight}
	if len(h.samples) < h.keep {
		h.samples = append(h.samples, s)
	} else {
		h.samples[h.next] = s
		h.next = (h.next + 1) % h.keep
		h.full = true
	}
	h.notePause(v)
}

// notePause puts the vendor's latest pause on the timeline: a new end is
// a new pause, or the extension of the last one while it lasts.
func (h *history) notePause(v report.VendorState) {
	if v.LastPauseUntil == "" {
		return
	}
	until, err := time.Parse(time.RFC3339Nano, v.LastPauseUntil)
	if err != nil || until.Equal(h.lastUntil) {
		return
	}
	first := h.lastUntil.IsZero()
	h.lastUntil = until
	if first && !until.After(v.RedisTime) {
		return // ended before the page started: not seen, not shown
	}
	if n := len(h.pauses); n > 0 && h.pauses[n-1].Until.After(v.RedisTime.Add(-time.Second)) {
		h.pauses[n-1].Until, h.pauses[n-1].Reason = until, v.LastPauseReason // extended
		return
	}
	if len(h.pauses) == h.keepPauses {
		h.pauses = append(h.pauses[:0], h.pauses[1:]...)
	}
	h.pauses = append(h.pauses, pause{Seen: v.RedisTime, Until: until, Reason: v.LastPauseReason})
}

// ordered returns the samples oldest first.
func (h *history) ordered() []sample {
	if !h.full {
		return h.samples
	}
	out := make([]sample, 0, h.keep)
	out = append(out, h.samples[h.next:]...)
	return append(out, h.samples[:h.next]...)
}

// Series is a vendor's chart: for each interval between two samplings,
// its end (T, Unix ms), the calls started per second in it (Started,
// from the granted ticks), the 429s in it (Limited), and, at its end,
// the effective rate and the configured limit (calls per second), the
// queue and the calls in flight.
type Series struct {
	T        []int64   `json:"t"`
	Started  []float64 `json:"started"`
	Limited  []int64   `json:"limited"`
	Rate     []float64 `json:"rate"`
	Limit    []float64 `json:"limit"`
	Queued   []int64   `json:"queued"`
	InFlight []int64   `json:"in_flight"`
}

// series makes the chart of samples (oldest first). An interval where a
// counter went down (the gate's state was lost and created again) counts
// nothing.
func series(samples []sample) Series {
	var s Series
	for i := 1; i < len(samples); i++ {
		a, b := samples[i-1], samples[i]
		dt := b.at.Sub(a.at).Seconds()
		if dt <= 0 {
			continue
		}
		s.T = append(s.T, b.at.UnixMilli())
		s.Started = append(s.Started, report.Round2(float64(max(b.granted-a.granted, 0))/dt))
		s.Limited = append(s.Limited, max(b.limited-a.limited, 0))
		s.Rate = append(s.Rate, report.Round2(b.rate))
		s.Limit = append(s.Limit, report.Round2(b.limit))
		s.Queued = append(s.Queued, b.queued)
		s.InFlight = append(s.InFlight, b.inFlight)
	}
	return s
}

// startedRate is the calls started per second over the last span of
// samples (oldest first): the granted ticks between the latest sample
// and the oldest one at most span before it, over the time between
// them. It is 0 with fewer than two samples or after a counter reset.
func startedRate(samples []sample, span time.Duration) float64 {
	if len(samples) < 2 {
		return 0
	}
	last := samples[len(samples)-1]
	first := samples[len(samples)-2]
	for i := len(samples) - 2; i >= 0 && last.at.Sub(samples[i].at) <= span; i-- {
		first = samples[i]
	}
	dt := last.at.Sub(first.at).Seconds()
	if dt <= 0 || last.granted < first.granted {
		return 0
	}
	return float64(last.granted-first.granted) / dt
}

// chartRates are the effective rate and the limit the chart draws against
// the calls v started, in calls per second: the vendor's, or for a
// per-account vendor (whose calls the chart counts over all accounts)
// its total's, or none (0) when it has no total.
func chartRates(v report.VendorState) (rate, limit float64) {
	if v.AccountsWithBacklog == nil {
		w := windowOf(v).Seconds()
		return v.EffectiveRate / w, float64(v.ConfigRate) / w
	}
	if t := v.Total; t != nil {
		if w, err := time.ParseDuration(t.Window); err == nil && w > 0 {
			return t.EffectiveRate / w.Seconds(), float64(t.Rate) / w.Seconds()
		}
	}
	return 0, 0
}

// windowOf is v's primary window (1 s if it cannot be read).
func windowOf(v report.VendorState) time.Duration {
	if w, err := time.ParseDuration(v.Window); err == nil && w > 0 {
		return w
	}
	return time.Second
}
