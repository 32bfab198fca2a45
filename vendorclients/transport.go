package vendorclients

import (
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"sync"
	"sync/atomic"
	"time"

	"github.com/shaper-dev/shaper/internal/gatehook"
	"github.com/shaper-dev/shaper/shaper"
)

// transport is the gate as an http.RoundTripper: every request waits for
// its vendor's tick, and what the vendor answers adapts the vendor's
// bucket for every replica. Its configuration is fixed at New; only the
// bucket changes (a config reload).
type transport struct {
	base     http.RoundTripper
	vendor   Endpoint // with defaults
	maxWait  time.Duration
	log      *slog.Logger
	observer Observer // optional

	announced *announcedRates // shared by a client and its accounts' clients
	counted   *countedQuotas  // shared by a client and its accounts' clients
	upgrade   *upgradeNotice  // shared by a client and its accounts' clients
	bucket    atomic.Pointer[shaper.Bucket]
}

// upgradeEvery is how often a client says, while it lasts, that a newer
// shaper wrote its vendor's gate state.
const upgradeEvery = time.Minute

// upgradeNotice is when a client last said that a newer shaper wrote its
// vendor's gate state (unix ns).
type upgradeNotice struct{ said atomic.Int64 }

// tell logs, at most once per upgradeEvery, that bucket's calls wait for
// this worker to be upgraded.
func (u *upgradeNotice) tell(log *slog.Logger, vendor, bucket string, now time.Time) {
	last := u.said.Load()
	if now.UnixNano()-last < int64(upgradeEvery) || !u.said.CompareAndSwap(last, now.UnixNano()) {
		return
	}
	log.Warn("a newer version of shaper wrote this vendor's gate state in Redis: this worker grants none of its calls until it is upgraded (they wait in the queue, nothing is lost); upgrade it, or stop the newer workers before rolling back (docs/operations.md)",
		"vendor", vendor, "bucket", bucket)
}

// maxAnnounced bounds the buckets whose last announced rate a client
// remembers; past it the memory starts afresh (an announcement costs one
// Redis round trip again, once per bucket).
const maxAnnounced = 4096

// announcedRates remembers the rate last announced to the gate per bucket,
// so that a vendor repeating its limit on every answer costs no round trip
// after the first.
type announcedRates struct {
	mu   sync.Mutex
	last map[string]float64
}

// changed records rate for bucket and reports whether it differs from the
// last one recorded.
func (a *announcedRates) changed(bucket string, rate float64) bool {
	a.mu.Lock()
	defer a.mu.Unlock()
	if prev, ok := a.last[bucket]; ok && prev == rate {
		return false
	}
	if a.last == nil || len(a.last) >= maxAnnounced {
		a.last = map[string]float64{}
	}
	a.last[bucket] = rate
	return true
}

// countedQuotas throttles the counts of quotas a vendor announces: at
// most one round trip per bucket and quota a second, and at once when
// the vendor says none is left.
type countedQuotas struct {
	mu   sync.Mutex
	last map[string]time.Time
}

// due reports whether a count of quota i of bucket is due now.
func (c *countedQuotas) due(bucket string, i int, urgent bool) bool {
	c.mu.Lock()
	defer c.mu.Unlock()
	key := fmt.Sprintf("%s|%d", bucket, i)
	now := time.Now()
	if !urgent && now.Sub(c.last[key]) < time.Second {
		return false
	}
	if c.last == nil || len(c.last) >= maxAnnounced {
		c.last = map[string]time.Time{}
	}
	c.last[key] = now
	return true
}

type permitKey struct{}

type requestKey struct{}

// WithRequest returns ctx carrying what a call asks of its bucket: its
// cost in units of every limit, and its lane. A client's request sent
// with it is shaped as such (MaxWait is the client's own).
func WithRequest(ctx context.Context, r shaper.Request) context.Context {
	return context.WithValue(ctx, requestKey{}, r)
}

func requestFrom(ctx context.Context) shaper.Request {
	r, _ := ctx.Value(requestKey{}).(shaper.Request)
	return r
}

// PermitFrom returns the gate permit a request was sent under, from the
// request's context as the base transport sees it (nil outside one): its
// Tick is when the call was allowed to start.
func PermitFrom(ctx context.Context) *shaper.Permit {
	p, _ := ctx.Value(permitKey{}).(*shaper.Permit)
	return p
}

// RoundTrip implements http.RoundTripper.
func (t *transport) RoundTrip(req *http.Request) (*http.Response, error) {
	resp, _, err := t.do(req)
	return resp, err
}

// do sends req at its tick and returns the response and the pause in
// force after it (0 when the answer did not pause the vendor).
func (t *transport) do(req *http.Request) (*http.Response, time.Duration, error) {
	ctx := req.Context()
	bucket := t.bucket.Load()
	asked := time.Now()
	ask := requestFrom(ctx)
	ask.MaxWait = t.maxWait
	prev := ask.Waited
	ask.Waited = func(w shaper.Wait) {
		if w.Binding == shaper.BoundUpgrade && !w.Granted {
			t.upgrade.tell(t.log, t.vendor.Name, bucket.Name(), time.Now())
		}
		if prev != nil {
			prev(w)
		}
	}
	tw := t.startTickWait(ctx, &ask)
	permit, err := bucket.Acquire(ctx, ask)
	tw.end(permit, err)
	if err != nil {
		closeBody(req)
		var wait *shaper.Wait // deferred beyond MaxWait
		if errors.As(err, &wait) {
			return nil, 0, &WaitError{Vendor: t.vendor.Name, Wait: wait.For}
		}
		return nil, 0, err
	}
	if t.observer != nil {
		t.observer.Started(t.vendor.Name, time.Since(asked))
	}
	ctx, cancel := context.WithTimeout(ctx, t.vendor.Timeout)
	ctx = context.WithValue(ctx, permitKey{}, permit)
	call := t.startSend(ctx, req)
	out := req.WithContext(call.ctx)
	out.Header = req.Header.Clone()
	if out.Header == nil {
		out.Header = http.Header{}
	}
	for k, v := range t.vendor.Headers {
		if out.Header.Get(k) == "" {
			out.Header.Set(k, v)
		}
	}
	if out.Header.Get("User-Agent") == "" {
		out.Header.Set("User-Agent", t.vendor.UserAgent)
	}
	call.inject(out.Header)
	sent := time.Now()
	resp, err := t.base.RoundTrip(out)
	returned := time.Now()
	if err == nil {
		// The bucket measures the spread of round trips: the jitter a
		// refusal is judged with, and a measured guard.
		gatehook.ObserveRoundTrip(bucket, time.Since(sent))
	}
	if err != nil {
		call.end(returned, nil, 0, err)
		cancel()
		_ = permit.Release(context.WithoutCancel(ctx))
		return nil, 0, err
	}
	resp.Body = &releasingBody{ReadCloser: resp.Body, release: func() {
		cancel()
		_ = permit.Release(context.WithoutCancel(ctx))
	}}
	pause := t.adapt(context.WithoutCancel(ctx), bucket, permit, resp)
	call.end(returned, resp, pause, nil)
	return resp, pause, nil
}

// announcedLimit returns the index of the limit of p that the vendor's
// announcement h describes, and false when none does: the limit of the
// announced window; without one, the only limit of the announced rate;
// without either, the only quota whose window can hold the announced
// reset (0: none announced).
func announcedLimit(p shaper.Policy, h Hints) (int, bool) {
	found := -1
	for i, l := range p.Limits {
		var match bool
		switch {
		case h.Window > 0:
			match = l.Window == h.Window
		case h.Limit > 0:
			match = l.Rate == h.Limit
		case h.Reset > p.Limits[0].Window:
			match = p.Quota(i) && h.Reset <= l.Window
		}
		if !match {
			continue
		}
		if h.Window > 0 {
			return i, true
		}
		if found >= 0 {
			return 0, false
		}
		found = i
	}
	return found, found >= 0
}

func closeBody(req *http.Request) {
	if req.Body != nil {
		_ = req.Body.Close()
	}
}

// adapt feeds what the response says about the vendor's limits back into
// the gate, for every replica: an announced limit lowers the effective
// rate; "0 remaining" pauses until the reset; a rate-limited answer pauses
// until Retry-After, and one without an announced limit is judged by the
// gate's learning model (shaper.Control.Refused: a pause, a lower rate,
// or a wider margin). It returns the pause in force (0 when none was set).
func (t *transport) adapt(ctx context.Context, bucket *shaper.Bucket, permit *shaper.Permit, resp *http.Response) time.Duration {
	ctl := bucket.Control()
	vendor := t.vendor.Name
	h := ParseHints(resp.Header, time.Now())
	if v := resp.Header.Get("Retry-After"); v != "" && !h.HasRetryAfter {
		t.log.Warn("vendorclients: ignoring an unparsable or negative Retry-After", "vendor", vendor, "retry_after", v)
	}
	primary := bucket.Policy().Limits[0]
	quota, isQuota := announcedLimit(bucket.Policy(), h)
	isQuota = isQuota && bucket.Policy().Quota(quota)
	if isQuota && h.Remaining >= 0 && t.counted.due(bucket.Name(), quota, h.Remaining == 0) {
		// The vendor's count of a quota: counted if above the gate's own
		// (another app with the same credential used some).
		l := bucket.Policy().Limits[quota]
		if added, err := ctl.CountUsed(ctx, quota, l.Rate-h.Remaining); err != nil {
			t.log.Error("vendorclients: could not count a quota's use the vendor announced", "vendor", vendor, "err", err)
		} else if added > 0 {
			t.log.Info("vendorclients: the vendor counts more of a quota used than the gate did; counting it", "vendor", vendor,
				"quota", l.String(), "remaining", h.Remaining, "added", added)
		}
	}
	if h.Limit > 0 && !isQuota {
		window := h.Window
		if window <= 0 {
			window = primary.Window // X-RateLimit-Limit does not say: assume the configured window
		}
		rate := float64(h.Limit) * float64(primary.Window) / float64(window)
		if t.announced.changed(bucket.Name(), rate) {
			reason := fmt.Sprintf("vendor announces %s (%s headers)", shaper.Limit{Rate: h.Limit, Window: window}, h.Style)
			if err := ctl.Announce(ctx, rate, reason); err != nil {
				t.log.Error("vendorclients: could not apply an announced limit", "vendor", vendor, "err", err)
			} else if rate < float64(primary.Rate) {
				t.log.Info("vendorclients: effective rate lowered to the vendor's announced limit", "vendor", vendor, "rate", rate, "per", primary.Window, "reason", reason)
			}
		}
	}
	limited := isRateLimited(resp)
	if limited && t.observer != nil {
		t.observer.RateLimited(vendor)
	}
	d, reason := pauseFor(resp, h, limited)
	if d > t.vendor.MaxRetryAfter {
		t.log.Warn("vendorclients: capping a pause the vendor asked for", "vendor", vendor, "asked", d, "cap", t.vendor.MaxRetryAfter)
		d = t.vendor.MaxRetryAfter
	}
	if limited && h.Limit == 0 {
		// Refused without an announced limit: the gate judges it and
		// applies the judgement (pause, rate, margin) in one place.
		dec, err := ctl.Refused(ctx, permit, shaper.Answer{Reason: fmt.Sprintf("HTTP %d with no announced limit", resp.StatusCode),
			Pause: d, PauseReason: reason, RetryAfter: h.HasRetryAfter})
		if err != nil {
			t.log.Error("vendorclients: could not pause the vendor or learn from its rate-limited answer; other replicas may call it until it answers 429 again", "vendor", vendor, "err", err)
			return 0
		}
		switch dec.Lesson {
		case shaper.LessonRate:
			t.log.Info("vendorclients: rate-limited without an announced limit; effective rate lowered", "vendor", vendor, "rate", dec.Rate, "per", primary.Window, "reason", dec.Reason)
		case shaper.LessonMargin:
			t.log.Info("vendorclients: rate-limited at the full spacing; margin widened", "vendor", vendor, "guard", dec.Guard, "reason", dec.Reason)
		}
		if dec.Pause > 0 {
			t.log.Info("vendorclients: vendor paused for every replica", "vendor", vendor, "pause", dec.Pause.Round(time.Millisecond), "reason", reason)
		}
		return dec.Pause
	}
	if limited {
		if err := ctl.CountRateLimited(ctx); err != nil {
			t.log.Error("vendorclients: could not count a rate-limited answer", "vendor", vendor, "err", err)
		}
	}
	if d <= 0 {
		return 0
	}
	pause, err := ctl.Pause(ctx, d, reason)
	if err != nil {
		t.log.Error("vendorclients: could not pause the vendor; other replicas may call it until it answers 429 again", "vendor", vendor, "err", err)
		return 0
	}
	t.log.Info("vendorclients: vendor paused for every replica", "vendor", vendor, "pause", pause.Round(time.Millisecond), "reason", reason)
	return pause
}

// pauseFor says how long a response asks the vendor to be paused, and
// why: a rate-limited answer until Retry-After, else the announced reset,
// else DefaultPause; "0 remaining" until the earliest moment the reset can
// fall.
func pauseFor(resp *http.Response, h Hints, limited bool) (time.Duration, string) {
	switch {
	case limited && h.HasRetryAfter:
		return h.RetryAfter, fmt.Sprintf("HTTP %d, Retry-After: %s", resp.StatusCode, resp.Header.Get("Retry-After"))
	case limited && h.Reset >= 0 && h.Remaining <= 0:
		return h.Reset, fmt.Sprintf("HTTP %d, limit resets in %s", resp.StatusCode, h.Reset.Round(time.Millisecond))
	case limited:
		return DefaultPause, fmt.Sprintf("HTTP %d without Retry-After", resp.StatusCode)
	case h.Remaining == 0 && h.Reset > 0:
		// A reset given in whole seconds is rounded up: the window may end
		// up to a second earlier. Pause until the earliest moment it can
		// end; a call that still comes too early gets a 429 and a full
		// pause. (Shaping at an announced limit already spaces the calls.)
		d := h.Reset
		if d%time.Second == 0 {
			d -= time.Second
		}
		return d, fmt.Sprintf("vendor says 0 calls remaining, resets in %s", h.Reset.Round(time.Millisecond))
	}
	return 0, ""
}

// releasingBody releases the call's permit when its body is closed.
type releasingBody struct {
	io.ReadCloser
	release func()
	done    bool
}

func (b *releasingBody) Close() error {
	err := b.ReadCloser.Close()
	if !b.done {
		b.done = true
		b.release()
	}
	return err
}
