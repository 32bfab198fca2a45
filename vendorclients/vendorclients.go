// Package vendorclients is the HTTP side of shaper: a client per vendor
// whose every request passes the vendor's gate (the gate is an
// http.RoundTripper, so any code calling a vendor through it is shaped per
// call), paths that cannot leave the vendor's base_url, and 429 /
// Retry-After handling that pauses the vendor for every replica.
package vendorclients

import (
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"math"
	"net/http"
	"net/url"
	"path"
	"strconv"
	"strings"
	"sync/atomic"
	"time"

	"github.com/shaper-dev/shaper/shaper"
)

// Defaults.
const (
	DefaultTimeout       = 30 * time.Second
	DefaultMaxRetryAfter = time.Hour
	// DefaultPause is how long a 429 without a usable Retry-After pauses
	// the vendor.
	DefaultPause = time.Second
)

// Vendor is what a client needs to know of a vendor.
type Vendor struct {
	Name    string
	BaseURL string
	// Timeout bounds one call, from the moment it may start. Default 30s.
	Timeout time.Duration
	// MaxRetryAfter caps the pause a Retry-After can ask for. Default 1h.
	MaxRetryAfter time.Duration
	// Headers are set on every request (auth, API versions). Their values
	// may be secrets: they never appear in logs, errors or task results.
	Headers map[string]string
	// UserAgent; default "shaper".
	UserAgent string
}

// RateLimitedError is a 429 (or a 503 with Retry-After) from a vendor. The
// vendor has already been paused for every replica when it is returned.
type RateLimitedError struct {
	Vendor     string
	Status     int
	RetryAfter time.Duration // the pause in force; 0 if none was set
}

func (e *RateLimitedError) Error() string {
	return fmt.Sprintf("vendorclients: %s answered %d: paused for %s", e.Vendor, e.Status, e.RetryAfter)
}

// WaitError says the vendor's next tick is further away than the caller
// agreed to wait (a long pause): try again after Wait. It is not a failure.
type WaitError struct {
	Vendor string
	Wait   time.Duration
}

func (e *WaitError) Error() string {
	return fmt.Sprintf("vendorclients: %s: next release in %s", e.Vendor, e.Wait.Round(time.Millisecond))
}

// ErrBadPath is wrapped by CheckPath's errors.
var ErrBadPath = errors.New("bad path")

// CheckPath accepts a path relative to a vendor's base_url: it starts with
// "/", names no scheme or host, and no segment is "." or ".." (also when
// percent-encoded). A query is allowed.
func CheckPath(p string) error {
	if p == "" || p[0] != '/' {
		return fmt.Errorf("vendorclients: %w: %q must start with \"/\" (it is joined to the vendor's base_url)", ErrBadPath, p)
	}
	if strings.HasPrefix(p, "//") {
		return fmt.Errorf("vendorclients: %w: %q names a host; give a path on the vendor's base_url", ErrBadPath, p)
	}
	u, err := url.Parse(p)
	if err != nil {
		return fmt.Errorf("vendorclients: %w: %q: %v", ErrBadPath, p, err)
	}
	if u.Scheme != "" || u.Host != "" || u.User != nil {
		return fmt.Errorf("vendorclients: %w: %q names a scheme or host; give a path on the vendor's base_url", ErrBadPath, p)
	}
	for _, seg := range strings.Split(u.Path, "/") {
		if seg == "." || seg == ".." {
			return fmt.Errorf("vendorclients: %w: %q has a %q segment that could leave the vendor's base_url", ErrBadPath, p, seg)
		}
	}
	if strings.ContainsAny(p, "\\\x00\r\n") {
		return fmt.Errorf("vendorclients: %w: %q has a backslash or control character", ErrBadPath, p)
	}
	return nil
}

// Client calls one vendor through its gate.
type Client struct {
	vendor    Vendor
	base      *url.URL
	http      *http.Client
	transport *Transport
}

// SetBucket shapes the client's next requests by b (a new policy after a
// config reload); requests already waiting keep theirs.
func (c *Client) SetBucket(b *shaper.Bucket) { c.transport.SetBucket(b) }

// Bucket returns the bucket the client's requests pass.
func (c *Client) Bucket() *shaper.Bucket { return c.transport.Bucket() }

// Observer is told what happens to calls, for metrics. Its methods must be
// cheap and safe for concurrent use.
type Observer interface {
	// Released: a call got its tick after waiting wait for it.
	Released(vendor string, wait time.Duration)
	// Throttled: the vendor answered 429 (or 503 with Retry-After).
	Throttled(vendor string)
}

// Options configure a Client.
type Options struct {
	Observer Observer // optional
	// MaxWait is the longest a request waits for its tick; beyond it the
	// request fails at once with a *WaitError. 0: no bound.
	MaxWait time.Duration
	// Base is the transport the shaped requests go out on; default
	// http.DefaultTransport.
	Base   http.RoundTripper
	Logger *slog.Logger
}

// New returns a client of vendor v shaped by bucket.
func New(v Vendor, bucket *shaper.Bucket, opts Options) (*Client, error) {
	base, err := parseBase(v.BaseURL)
	if err != nil {
		return nil, fmt.Errorf("vendorclients: vendor %s: %w", v.Name, err)
	}
	if v.Timeout <= 0 {
		v.Timeout = DefaultTimeout
	}
	if v.MaxRetryAfter <= 0 {
		v.MaxRetryAfter = DefaultMaxRetryAfter
	}
	if opts.Base == nil {
		opts.Base = http.DefaultTransport
	}
	if opts.Logger == nil {
		opts.Logger = slog.Default()
	}
	if v.UserAgent == "" {
		v.UserAgent = "shaper"
	}
	t := &Transport{Base: opts.Base, Vendor: v.Name, MaxWait: opts.MaxWait,
		MaxRetryAfter: v.MaxRetryAfter, Timeout: v.Timeout, Logger: opts.Logger,
		Headers: v.Headers, UserAgent: v.UserAgent, Observer: opts.Observer}
	t.SetBucket(bucket)
	hc := &http.Client{Transport: t, CheckRedirect: func(*http.Request, []*http.Request) error {
		return http.ErrUseLastResponse // never follow a vendor off its base_url
	}}
	return &Client{vendor: v, base: base, http: hc, transport: t}, nil
}

func parseBase(s string) (*url.URL, error) {
	base, err := url.Parse(s)
	if err != nil || (base.Scheme != "http" && base.Scheme != "https") || base.Host == "" {
		return nil, fmt.Errorf("base_url %q is not an absolute http(s) URL", s)
	}
	return base, nil
}

// Vendor returns the client's vendor.
func (c *Client) Vendor() Vendor { return c.vendor }

// URL joins the vendor's base_url and p, after CheckPath.
func (c *Client) URL(p string) (*url.URL, error) {
	if err := CheckPath(p); err != nil {
		return nil, err
	}
	rel, _ := url.Parse(p)
	u := *c.base
	u.Path = strings.TrimSuffix(c.base.Path, "/") + path.Clean("/"+rel.Path)
	if strings.HasSuffix(rel.Path, "/") && !strings.HasSuffix(u.Path, "/") {
		u.Path += "/"
	}
	u.RawPath = ""
	u.RawQuery = rel.RawQuery
	return &u, nil
}

// NewRequest builds a request for path p on the vendor.
func (c *Client) NewRequest(ctx context.Context, method, p string, body io.Reader) (*http.Request, error) {
	u, err := c.URL(p)
	if err != nil {
		return nil, err
	}
	return http.NewRequestWithContext(ctx, method, u.String(), body)
}

// Do sends req through the vendor's gate. A 429 (or 503 with Retry-After)
// comes back as a *RateLimitedError with the body closed; a wait beyond
// MaxWait as a *WaitError; other statuses as a response.
func (c *Client) Do(req *http.Request) (*http.Response, error) {
	resp, err := c.http.Do(req)
	if err != nil {
		var we *WaitError
		if errors.As(err, &we) {
			return nil, we
		}
		return nil, err
	}
	if isRateLimited(resp) {
		_, _ = io.Copy(io.Discard, io.LimitReader(resp.Body, 64<<10))
		resp.Body.Close()
		rl := &RateLimitedError{Vendor: c.vendor.Name, Status: resp.StatusCode}
		if d, ok := resp.Request.Context().Value(pauseKey{}).(*time.Duration); ok && d != nil {
			rl.RetryAfter = *d
		}
		return nil, rl
	}
	return resp, nil
}

type pauseKey struct{}

type permitKey struct{}

// PermitFrom returns the gate permit a request was sent under, from the
// request's context as the base transport sees it (nil outside one): its
// Tick is when the call was released.
func PermitFrom(ctx context.Context) *shaper.Permit {
	p, _ := ctx.Value(permitKey{}).(*shaper.Permit)
	return p
}

func isRateLimited(resp *http.Response) bool {
	return resp.StatusCode == http.StatusTooManyRequests ||
		(resp.StatusCode == http.StatusServiceUnavailable && resp.Header.Get("Retry-After") != "")
}

// Transport is the gate as an http.RoundTripper: every request waits for
// its vendor's tick, and a 429 pauses the vendor for every replica.
type Transport struct {
	Base          http.RoundTripper
	Vendor        string
	MaxWait       time.Duration
	MaxRetryAfter time.Duration
	Timeout       time.Duration
	Logger        *slog.Logger
	Headers       map[string]string // set on every request unless the request has them
	UserAgent     string
	Observer      Observer // optional

	announced atomic.Uint64 // math.Float64bits of the last rate announced to the gate
	bucket    atomic.Pointer[shaper.Bucket]
}

// SetBucket sets the gate bucket requests pass; it may change while
// requests run (a config reload).
func (t *Transport) SetBucket(b *shaper.Bucket) { t.bucket.Store(b) }

// Bucket returns the bucket requests pass.
func (t *Transport) Bucket() *shaper.Bucket { return t.bucket.Load() }

// RoundTrip implements http.RoundTripper.
func (t *Transport) RoundTrip(req *http.Request) (*http.Response, error) {
	ctx := req.Context()
	bucket := t.Bucket()
	asked := time.Now()
	permit, wait, err := bucket.AcquireWithin(ctx, t.MaxWait)
	if err != nil {
		return nil, err
	}
	if permit == nil {
		return nil, &WaitError{Vendor: t.Vendor, Wait: wait}
	}
	if t.Observer != nil {
		t.Observer.Released(t.Vendor, time.Since(asked))
	}
	var cancel context.CancelFunc = func() {}
	if t.Timeout > 0 {
		ctx, cancel = context.WithTimeout(ctx, t.Timeout)
	}
	var pause time.Duration
	ctx = context.WithValue(ctx, pauseKey{}, &pause)
	ctx = context.WithValue(ctx, permitKey{}, permit)
	out := req.WithContext(ctx)
	if len(t.Headers) > 0 || t.UserAgent != "" {
		out.Header = req.Header.Clone()
		for k, v := range t.Headers {
			if out.Header.Get(k) == "" {
				out.Header.Set(k, v)
			}
		}
		if t.UserAgent != "" && out.Header.Get("User-Agent") == "" {
			out.Header.Set("User-Agent", t.UserAgent)
		}
	}
	resp, err := t.Base.RoundTrip(out)
	if err != nil {
		cancel()
		_ = permit.Release(context.WithoutCancel(ctx))
		return nil, err
	}
	resp.Body = &releasingBody{ReadCloser: resp.Body, release: func() {
		cancel()
		_ = permit.Release(context.WithoutCancel(ctx))
	}}
	pause = t.adapt(context.WithoutCancel(ctx), bucket, resp)
	return resp, nil
}

// adapt feeds what the response says about the vendor's limits back into
// the gate, for every replica: an announced limit lowers the effective
// rate; "0 remaining" pauses until the reset; a 429 (or 503 with
// Retry-After) pauses until Retry-After, and without an announced limit
// also lowers the rate multiplicatively. It returns the pause in force.
func (t *Transport) adapt(ctx context.Context, bucket *shaper.Bucket, resp *http.Response) time.Duration {
	now := time.Now()
	h := ParseHints(resp.Header, now)
	if v := resp.Header.Get("Retry-After"); v != "" && !h.HasRetryAfter {
		t.Logger.Warn("vendorclients: ignoring an unparsable or negative Retry-After", "vendor", t.Vendor, "retry_after", v)
	}
	primary := bucket.Policy().Limits[0]
	if h.Limit > 0 {
		window := h.Window
		if window <= 0 {
			window = primary.Window // X-RateLimit-Limit does not say: assume the configured window
		}
		rate := float64(h.Limit) * float64(primary.Window) / float64(window)
		if bits := math.Float64bits(rate); t.announced.Swap(bits) != bits {
			reason := fmt.Sprintf("vendor announces %d per %s (%s headers)", h.Limit, shaper.FormatDuration(window), h.Style)
			if err := bucket.Announce(ctx, rate, reason); err != nil {
				t.Logger.Error("vendorclients: could not apply an announced limit", "vendor", t.Vendor, "err", err)
			} else if rate < float64(primary.Rate) {
				t.Logger.Info("vendorclients: effective rate lowered to the vendor's announced limit", "vendor", t.Vendor, "rate", rate, "per", primary.Window, "reason", reason)
			}
		}
	}
	limited := isRateLimited(resp)
	if limited {
		if t.Observer != nil {
			t.Observer.Throttled(t.Vendor)
		}
		if err := bucket.NoteThrottled(ctx); err != nil {
			t.Logger.Error("vendorclients: could not count a 429", "vendor", t.Vendor, "err", err)
		}
	}
	var d time.Duration
	var reason string
	switch {
	case limited && h.HasRetryAfter:
		d, reason = h.RetryAfter, fmt.Sprintf("HTTP %d, Retry-After: %s", resp.StatusCode, resp.Header.Get("Retry-After"))
	case limited && h.Reset >= 0 && h.Remaining <= 0:
		d, reason = h.Reset, fmt.Sprintf("HTTP %d, limit resets in %s", resp.StatusCode, h.Reset.Round(time.Millisecond))
	case limited:
		d, reason = DefaultPause, fmt.Sprintf("HTTP %d without Retry-After", resp.StatusCode)
	case h.Remaining == 0 && h.Reset > 0:
		// A reset given in whole seconds is rounded up: the window may end
		// up to a second earlier. Pause until the earliest moment it can
		// end; a call that still comes too early gets a 429 and a full
		// pause. (Shaping at an announced limit already spaces the calls.)
		d = h.Reset
		if d%time.Second == 0 {
			d -= time.Second
		}
		reason = fmt.Sprintf("vendor says 0 calls remaining, resets in %s", h.Reset.Round(time.Millisecond))
	}
	if limited && h.Limit == 0 {
		// The rate is about to be lowered: ticks reserved at the old rate
		// reach at most a horizon ahead, so pausing at least that long
		// drops them all, and no window mixes old and new spacing.
		d = max(d, bucket.Policy().Horizon)
	}
	if d > t.MaxRetryAfter {
		t.Logger.Warn("vendorclients: capping a pause the vendor asked for", "vendor", t.Vendor, "asked", d, "cap", t.MaxRetryAfter)
		d = t.MaxRetryAfter
	}
	var pause time.Duration
	if d > 0 {
		left, err := bucket.Pause(ctx, d, reason)
		if err != nil {
			t.Logger.Error("vendorclients: could not pause the vendor", "vendor", t.Vendor, "err", err)
		}
		pause = left
		t.Logger.Info("vendorclients: vendor paused for every replica", "vendor", t.Vendor, "pause", pause.Round(time.Millisecond), "reason", reason)
	}
	if limited && h.Limit == 0 {
		rate, err := bucket.Throttled(ctx, fmt.Sprintf("HTTP %d with no announced limit", resp.StatusCode))
		if err != nil {
			t.Logger.Error("vendorclients: could not lower the rate", "vendor", t.Vendor, "err", err)
		} else {
			t.Logger.Info("vendorclients: rate-limited without an announced limit; effective rate lowered", "vendor", t.Vendor, "rate", rate, "per", primary.Window)
		}
	}
	return pause
}

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

// ParseRetryAfter parses a Retry-After value, as delay-seconds or as an
// HTTP-date (relative to now). Negative or unparsable values are not ok; a
// date in the past is 0.
func ParseRetryAfter(v string, now time.Time) (time.Duration, bool) {
	v = strings.TrimSpace(v)
	if v == "" {
		return 0, false
	}
	if n, err := strconv.ParseInt(v, 10, 64); err == nil {
		if n < 0 {
			return 0, false
		}
		if n > int64(100*365*24*time.Hour/time.Second) {
			n = int64(100 * 365 * 24 * time.Hour / time.Second)
		}
		return time.Duration(n) * time.Second, true
	}
	t, err := http.ParseTime(v)
	if err != nil {
		return 0, false
	}
	return max(t.Sub(now), 0), true
}
