// Package vendorclients is the HTTP side of shaper: a client per vendor
// whose every request passes the vendor's gate (per call, not per job),
// paths that cannot leave the vendor's base_url, and what vendors say back
// — 429, Retry-After, rate-limit headers — turned into pauses and rates
// shared by every replica.
//
// A rate-limited answer is a 429, or a 503 with Retry-After. It pauses the
// vendor until Retry-After (seconds or HTTP-date; else the announced
// reset; else DefaultPause), capped at MaxRetryAfter; without an announced
// limit it also lowers the vendor's effective rate.
package vendorclients

import "time"

// Defaults.
const (
	DefaultTimeout       = 30 * time.Second
	DefaultMaxRetryAfter = time.Hour
	// DefaultPause is how long a rate-limited answer without a usable
	// Retry-After pauses the vendor.
	DefaultPause     = time.Second
	DefaultUserAgent = "shaper"
)

// Endpoint is what a client needs to know of a vendor.
type Endpoint struct {
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

func (v Endpoint) withDefaults() Endpoint {
	if v.Timeout <= 0 {
		v.Timeout = DefaultTimeout
	}
	if v.MaxRetryAfter <= 0 {
		v.MaxRetryAfter = DefaultMaxRetryAfter
	}
	if v.UserAgent == "" {
		v.UserAgent = DefaultUserAgent
	}
	return v
}
