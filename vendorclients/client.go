package vendorclients

import (
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"net/url"
	"path"
	"strings"
	"time"

	"github.com/shaper-dev/shaper/shaper"
)

// Observer is told what happens to calls, for metrics. Its methods must be
// cheap and safe for concurrent use.
type Observer interface {
	// Started: a call started at its tick after waiting wait for it.
	Started(vendor string, wait time.Duration)
	// RateLimited: the vendor answered 429 (or 503 with Retry-After).
	RateLimited(vendor string)
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

// Client calls one vendor through its gate. It is safe for concurrent
// use.
type Client struct {
	vendor    Endpoint
	base      *url.URL
	transport *transport
}

// New returns a client of vendor v shaped by bucket.
func New(v Endpoint, bucket *shaper.Bucket, opts Options) (*Client, error) {
	base, err := parseBase(v.BaseURL)
	if err != nil {
		return nil, fmt.Errorf("vendorclients: vendor %s: %w", v.Name, err)
	}
	v = v.withDefaults()
	if opts.Base == nil {
		opts.Base = http.DefaultTransport
	}
	if opts.Logger == nil {
		opts.Logger = slog.Default()
	}
	t := &transport{base: opts.Base, vendor: v, maxWait: opts.MaxWait, log: opts.Logger, observer: opts.Observer, announced: &announcedRates{}, counted: &countedQuotas{}, upgrade: &upgradeNotice{}}
	t.bucket.Store(bucket)
	return &Client{vendor: v, base: base, transport: t}, nil
}

func parseBase(s string) (*url.URL, error) {
	base, err := url.Parse(s)
	if err != nil || (base.Scheme != "http" && base.Scheme != "https") || base.Host == "" {
		return nil, fmt.Errorf("base_url %q is not an absolute http(s) URL", s)
	}
	return base, nil
}

// ForAccount returns a client of one account of the vendor: its base_url
// with {account} replaced (see AccountBaseURL), its requests shaped by
// bucket (the account's). It shares the client's options and base
// transport, and costs a few small allocations: make one per call.
func (c *Client) ForAccount(account string, bucket *shaper.Bucket) (*Client, error) {
	raw, err := AccountBaseURL(c.vendor.BaseURL, account)
	if err != nil {
		return nil, err
	}
	base, err := parseBase(raw)
	if err != nil {
		return nil, fmt.Errorf("vendorclients: vendor %s, account %s: %w", c.vendor.Name, account, err)
	}
	t := &transport{base: c.transport.base, vendor: c.vendor, maxWait: c.transport.maxWait, log: c.transport.log,
		observer: c.transport.observer, announced: c.transport.announced, counted: c.transport.counted, upgrade: c.transport.upgrade}
	t.bucket.Store(bucket)
	return &Client{vendor: c.vendor, base: base, transport: t}, nil
}

// Vendor returns the client's vendor, with defaults applied.
func (c *Client) Vendor() Endpoint { return c.vendor }

// SetBucket shapes the client's next requests by b (a new policy after a
// config reload); requests already waiting keep theirs.
func (c *Client) SetBucket(b *shaper.Bucket) { c.transport.bucket.Store(b) }

// Bucket returns the bucket the client's requests pass.
func (c *Client) Bucket() *shaper.Bucket { return c.transport.bucket.Load() }

// HTTPClient returns an *http.Client whose every request waits for the
// vendor's tick and adapts to what the vendor answers, for code (a vendor
// SDK) that takes one. Rate-limited answers come back as responses; it
// never follows redirects (they could leave the vendor's base_url).
func (c *Client) HTTPClient() *http.Client {
	return &http.Client{Transport: c.transport, CheckRedirect: func(*http.Request, []*http.Request) error {
		return http.ErrUseLastResponse
	}}
}

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

// Do sends req through the vendor's gate. A rate-limited answer comes back
// as a *RateLimitedError with the body closed; a wait beyond MaxWait as a
// *WaitError; other statuses as a response, whose body the caller closes.
// Redirects are not followed.
func (c *Client) Do(req *http.Request) (*http.Response, error) {
	resp, pause, err := c.transport.do(req)
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
		return nil, &RateLimitedError{Vendor: c.vendor.Name, Status: resp.StatusCode, RetryAfter: pause}
	}
	return resp, nil
}

func isRateLimited(resp *http.Response) bool {
	return resp.StatusCode == http.StatusTooManyRequests ||
		(resp.StatusCode == http.StatusServiceUnavailable && resp.Header.Get("Retry-After") != "")
}
