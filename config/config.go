// Package config loads shaper's TOML config with viper into typed structs
// and validates it. Every error names the file, the line, the key, the
// value and what to do, and wraps ErrInvalid and its cause; all problems
// are reported at once. Watch reloads the file while a worker runs and
// applies only a valid one. The package has no process-wide side effects:
// what asks for a reload (SIGHUP) is its caller's business. The other
// packages take the plain structs and never see viper.
package config

import (
	"bytes"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"regexp"
	"slices"
	"sort"
	"strings"
	"time"

	"github.com/pelletier/go-toml/v2"
	"github.com/spf13/viper"

	"github.com/shaper-dev/shaper/shaper"
)

// Defaults of the vendor keys that only the config defines. The other
// defaults belong to the package that uses the value: guard is
// shaper.DefaultGuard, burst is shaper.DefaultBurst, timeout and max_retry_after are
// vendorclients.DefaultTimeout and DefaultMaxRetryAfter, the [worker] keys
// are queue's Default* constants, and absent adapt_* keys leave
// Vendor.Adapt's fields zero, which selects shaper.Adapt's defaults.
const (
	DefaultWindow     = time.Second
	DefaultQueueLimit = 100000
)

// Config is a validated config file.
type Config struct {
	// Path is the file the config was read from.
	Path   string
	Redis  Redis
	Worker Worker
	// Callbacks is the [callbacks] table (off when absent).
	Callbacks Callbacks
	// Tracing is the [tracing] table (off when absent).
	Tracing Tracing
	Vendors []Vendor // sorted by name
}

// Worker is the [worker] table; an absent key has queue's default
// (queue.DefaultMaxWait, DefaultShutdownTimeout, DefaultRetention,
// DefaultMaxRetry).
type Worker struct {
	// MaxWait is the longest a task holds a worker goroutine waiting for
	// its tick; longer waits (pauses) send it back to the queue.
	MaxWait         time.Duration
	ShutdownTimeout time.Duration // calls in flight get this long to finish
	Retention       time.Duration // finished calls (and their results) are kept this long
	MaxRetry        int           // retries of failed calls; waits and 429s never count
}

// Redis says how to reach Redis.
type Redis struct {
	// Addr is empty for the embedded in-process Redis, else host:port, a
	// comma-separated list (Sentinel or Cluster), or a redis:// or
	// rediss:// URL.
	Addr     string
	Username string
	Password string
	DB       int
	TLS      bool
	// TLSCAFile is a PEM file of the CAs that sign the server's
	// certificate (default: the system's); TLSCertFile and TLSKeyFile a
	// client certificate, for a Redis that requires one
	// (tls-auth-clients). Any of them implies TLS.
	TLSCAFile   string
	TLSCertFile string
	TLSKeyFile  string
	MasterName  string // Sentinel master; Addr lists the sentinels
	Cluster     bool   // Addr lists cluster nodes
	// WaitReplicas, when above 0, makes every enqueue wait until that many
	// replicas hold it (Redis WAIT), for at most WaitTimeout (default 1s);
	// fewer is an error that says the calls are queued on the master only.
	WaitReplicas int
	WaitTimeout  time.Duration
}

// Embedded reports whether the config asks for the in-process Redis.
func (r Redis) Embedded() bool { return r.Addr == "" }

// Vendor is one vendor's table, as the file writes it: the primary limit
// as rate and window, header values with their ${NAME} references not yet
// expanded (secrets are read only by workers, at start). Vendor.Queue
// turns it into the one shape the other packages take, queue.Vendor.
//
// With PerAccount, every call names its account and Rate, Window, Burst,
// Guard, Limits and MaxInFlight apply to each account on its own;
// Overrides give some accounts their own values, and Total, when set,
// limits all of the vendor's accounts together. BaseURL may then contain
// {account}, as a whole label of the host name left of the domain
// (https://{account}.api.example) or anywhere in the path
// (https://api.example/stores/{account}); never in the scheme, user
// info, port, query or fragment. It is substituted per call: in the path
// with url.PathEscape of the account, in the host only for account names
// made of a-z, 0-9 and '-' (checked at call time; the config checks the
// override names). The config checks that the URL with {account}
// replaced is an absolute http(s) URL.
type Vendor struct {
	Name    string
	BaseURL string
	Rate    int
	Window  time.Duration
	Burst   int
	Guard   time.Duration
	// GuardMeasured: guard = "measured", or no guard set (the default);
	// Guard holds shaper.DefaultGuard, the guard until the worker has
	// measured one.
	GuardMeasured bool
	QueueLimit    int // 0: unbounded
	MaxInFlight   int // 0: no cap
	Limits        []shaper.Limit
	Timeout       time.Duration // one call, from its tick
	Concurrency   int           // worker budget per process; 0: sized from the rate
	// Headers are set on every call; values may name environment
	// variables as ${NAME} (secrets), expanded by ExpandHeaders.
	Headers       map[string]string
	UserAgent     string
	MaxRetryAfter time.Duration // cap on a vendor-asked pause
	// Adapt tunes learning from 429s without an announced limit; a field
	// whose key is absent stays zero, which selects shaper's default.
	Adapt shaper.Adapt
	// StrictSpacing says the vendor refuses calls closer together than
	// its spacing (strict_spacing; see shaper.Policy.StrictSpacing).
	StrictSpacing bool
	// Warmup ramps the rate from WarmupFrom (calls per window; 0: a
	// quarter of Rate) to Rate after the vendor was idle for longer than
	// its window (warmup, warmup_from); 0: no warm-up.
	Warmup     time.Duration
	WarmupFrom float64
	// PerAccount gives each account a bucket of its own (per_account).
	PerAccount bool
	// Overrides are the account_overrides items, in file order, one per
	// account.
	Overrides []Override
	// Total is the [vendors.NAME.total] table: a limit over all of the
	// vendor's accounts together; nil when absent. TotalLimits are its
	// limits key: more limits over all accounts (a longer one is a quota).
	Total       *shaper.Limit
	TotalLimits []shaper.Limit
	// MaxAnswer is max_answer, in bytes: how much of an answer's body a
	// call keeps with its result; 0 when absent (queue.DefaultMaxAnswer),
	// queue.NoAnswerBody for max_answer = 0. At most queue.MaxMaxAnswer.
	MaxAnswer int64
	// KeepHeaders is keep_headers: the answer headers kept with each
	// result, as written; nil when absent.
	KeepHeaders []string
}

// Override is one item of account_overrides, resolved: the account's
// values of the per-account keys, the item's where it sets them and the
// vendor's elsewhere. An item's limits replace the vendor's limits.
type Override struct {
	Account string
	Rate    int
	Window  time.Duration
	Burst   int
	Guard   time.Duration
	// GuardMeasured: guard = "measured"; the guard follows measurement.
	GuardMeasured bool
	Limits        []shaper.Limit
	MaxInFlight   int
}

// overrideOf returns the vendor's per-account values, the start of an
// override before its item's keys are read.
func overrideOf(v Vendor, account string) Override {
	return Override{Account: account, Rate: v.Rate, Window: v.Window, Burst: v.Burst, Guard: v.Guard,
		GuardMeasured: v.GuardMeasured, Limits: v.Limits, MaxInFlight: v.MaxInFlight}
}

// apply returns v with o's per-account values.
func (o Override) apply(v Vendor) Vendor {
	v.Rate, v.Window, v.Burst, v.Guard, v.Limits, v.MaxInFlight = o.Rate, o.Window, o.Burst, o.Guard, o.Limits, o.MaxInFlight
	v.GuardMeasured = o.GuardMeasured
	return v
}

var envRef = regexp.MustCompile(`\$\{([A-Za-z_][A-Za-z0-9_]*)\}`)

// expandEnv replaces each ${NAME} in s with the variable's value, adding
// the names of variables that are not set to *missing.
func expandEnv(s string, missing *[]string) string {
	return envRef.ReplaceAllStringFunc(s, func(ref string) string {
		name := envRef.FindStringSubmatch(ref)[1]
		x, ok := os.LookupEnv(name)
		if !ok {
			*missing = append(*missing, name)
		}
		return x
	})
}

// ExpandHeaders returns the vendor's headers with ${NAME} replaced by the
// environment; a variable that is not set is an error naming it (never
// its would-be value).
func (v Vendor) ExpandHeaders() (map[string]string, error) {
	out := make(map[string]string, len(v.Headers))
	var missing []string
	for k, val := range v.Headers {
		out[k] = expandEnv(val, &missing)
	}
	if len(missing) > 0 {
		sort.Strings(missing)
		return nil, fmt.Errorf("config: vendors.%s.headers: environment variable(s) %s not set; export them before starting the worker", v.Name, strings.Join(missing, ", "))
	}
	return out, nil
}

// Policy returns the gate policy of the vendor; with PerAccount, the
// policy of each account that has no override.
func (v Vendor) Policy() shaper.Policy {
	p := shaper.Policy{
		Limits:        append([]shaper.Limit{{Rate: v.Rate, Window: v.Window}}, v.Limits...),
		Burst:         v.Burst,
		Guard:         v.Guard,
		NoGuard:       v.Guard == 0,
		MaxInFlight:   v.MaxInFlight,
		Adapt:         v.Adapt,
		StrictSpacing: v.StrictSpacing,
		Warmup:        v.Warmup,
		WarmupFrom:    v.WarmupFrom,
	}
	if v.GuardMeasured {
		// guard = "measured": the guard follows what the worker
		// measures, from shaper.DefaultGuard (shaper.Policy.MeasureGuard).
		p.Guard, p.NoGuard, p.MeasureGuard = 0, false, true
	}
	return p
}

// AccountPolicy returns the gate policy of one account of a per-account
// vendor: its override's, or Policy when it has none.
func (v Vendor) AccountPolicy(account string) shaper.Policy {
	for _, o := range v.Overrides {
		if o.Account == account {
			return o.apply(v).Policy()
		}
	}
	return v.Policy()
}

// TotalPolicy returns the policy of the vendor's total, a limit over all
// of its accounts together, with the vendor's guard; nil when the vendor
// has no total.
func (v Vendor) TotalPolicy() *shaper.Policy {
	if v.Total == nil {
		return nil
	}
	return &shaper.Policy{Limits: append([]shaper.Limit{*v.Total}, v.TotalLimits...), Guard: v.Guard, NoGuard: v.Guard == 0}
}

// Vendor returns the named vendor.
func (c *Config) Vendor(name string) (Vendor, bool) {
	i := slices.IndexFunc(c.Vendors, func(v Vendor) bool { return v.Name == name })
	if i < 0 {
		return Vendor{}, false
	}
	return c.Vendors[i], true
}

// VendorNames returns the vendors' names in order.
func (c *Config) VendorNames() []string {
	names := make([]string, len(c.Vendors))
	for i, v := range c.Vendors {
		names[i] = v.Name
	}
	return names
}

// ErrInvalid is wrapped by every validation error.
var ErrInvalid = errors.New("invalid config")

// NotFoundError is Load's error for a config file that does not exist;
// it wraps the open error (errors.Is(err, fs.ErrNotExist) holds). Dir is
// the working directory a relative Path was looked for in ("" when Path
// is absolute or the directory is unknown).
type NotFoundError struct {
	Path string
	Dir  string
	Err  error
}

func (e *NotFoundError) Error() string {
	if e.Dir != "" {
		return fmt.Sprintf("config file %s not found in %s", e.Path, e.Dir)
	}
	return fmt.Sprintf("config file %s not found", e.Path)
}

func (e *NotFoundError) Unwrap() error { return e.Err }

// Load reads and validates the config file at path. SHAPER_REDIS_ADDR,
// SHAPER_REDIS_USERNAME and SHAPER_REDIS_PASSWORD override the file. A
// missing file is a *NotFoundError.
func Load(path string) (*Config, error) {
	data, err := os.ReadFile(path)
	if errors.Is(err, fs.ErrNotExist) {
		nf := &NotFoundError{Path: path, Err: err}
		if !filepath.IsAbs(path) {
			nf.Dir, _ = os.Getwd()
		}
		return nil, nf
	}
	if err != nil {
		return nil, fmt.Errorf("config: %w", err)
	}
	return Parse(path, data)
}

// Parse validates config text; path is only used in messages.
func Parse(path string, data []byte) (*Config, error) {
	// The text is parsed twice, on purpose. go-toml gives the tables as
	// written: viper lower-cases keys and splits them on dots, so only
	// this raw parse can name [vendors."api.example.com"] or
	// [vendors.Acme] as the user wrote them, find unknown keys, and give a
	// syntax error its line and column. viper then reads the values, as
	// the design requires (and applies the SHAPER_REDIS_* overrides). Both
	// read the same bytes, so they cannot see different files.
	var raw map[string]any
	if err := toml.Unmarshal(data, &raw); err != nil {
		var de *toml.DecodeError
		if errors.As(err, &de) {
			line, col := de.Position()
			return nil, fmt.Errorf("%s:%d:%d: %w: TOML syntax: %w", path, line, col, ErrInvalid, de)
		}
		return nil, fmt.Errorf("%s: %w: %w", path, ErrInvalid, err)
	}
	v := viper.New()
	v.SetConfigType("toml")
	v.SetEnvPrefix("SHAPER")
	v.SetEnvKeyReplacer(strings.NewReplacer(".", "_"))
	for _, k := range []string{"redis.addr", "redis.username", "redis.password"} {
		_ = v.BindEnv(k)
	}
	if err := v.ReadConfig(bytes.NewReader(data)); err != nil {
		return nil, fmt.Errorf("%s: %w: %w", path, ErrInvalid, err)
	}
	p := &parser{path: path, text: string(data), v: v}
	cfg := p.config(raw)
	if len(p.errs) > 0 {
		return nil, errors.Join(p.errs...)
	}
	return cfg, nil
}
