// Package config loads shaper's TOML config with viper into typed structs
// and validates it. Every error names the file, the line, the key, the
// value and what to do; all problems are reported at once. The other
// packages take the plain structs and never see viper.
package config

import (
	"bytes"
	"errors"
	"fmt"
	"net"
	"net/url"
	"os"
	"regexp"
	"slices"
	"sort"
	"strings"
	"time"

	"github.com/pelletier/go-toml/v2"
	"github.com/spf13/viper"

	"github.com/shaper-dev/shaper/shaper"
)

// Defaults of the vendor keys.
const (
	DefaultWindow     = time.Second
	DefaultBurst      = 1
	DefaultGuard      = shaper.DefaultGuard
	DefaultQueueLimit = 100000
)

// Config is a validated config file.
type Config struct {
	// Path is the file the config was read from.
	Path    string
	Redis   Redis
	Worker  Worker
	Vendors []Vendor // sorted by name
}

// Worker is the [worker] table.
type Worker struct {
	// MaxWait is the longest a task holds a worker goroutine waiting for
	// its tick; longer waits (pauses) send it back to the queue.
	MaxWait         time.Duration
	ShutdownTimeout time.Duration // calls in flight get this long to finish
	Retention       time.Duration // finished calls (and their results) are kept this long
	MaxRetry        int           // retries of failed calls; waits and 429s never count
}

// Worker defaults.
const (
	DefaultMaxWait         = 5 * time.Second
	DefaultShutdownTimeout = 10 * time.Second
	DefaultRetention       = 24 * time.Hour
	DefaultMaxRetry        = 25
	DefaultTimeout         = 30 * time.Second
	DefaultMaxRetryAfter   = time.Hour
)

// Redis says how to reach Redis.
type Redis struct {
	// Addr is empty for the embedded in-process Redis, else host:port, a
	// comma-separated list (Sentinel or Cluster), or a redis:// or
	// rediss:// URL.
	Addr       string
	Username   string
	Password   string
	DB         int
	TLS        bool
	MasterName string // Sentinel master; Addr lists the sentinels
	Cluster    bool   // Addr lists cluster nodes
}

// Embedded reports whether the config asks for the in-process Redis.
func (r Redis) Embedded() bool { return r.Addr == "" }

// Vendor is one vendor's table.
type Vendor struct {
	Name        string
	BaseURL     string
	Rate        int
	Window      time.Duration
	Burst       int
	Guard       time.Duration
	QueueLimit  int // 0: unbounded
	MaxInFlight int // 0: no cap
	Limits      []shaper.Limit
	Timeout     time.Duration // one call, from its tick
	Concurrency int           // worker budget per process; 0: sized from the rate
	// Headers are set on every call; values may name environment
	// variables as ${NAME} (secrets), expanded by ExpandHeaders.
	Headers       map[string]string
	UserAgent     string
	MaxRetryAfter time.Duration // cap on a vendor-asked pause
	Adapt         shaper.Adapt  // learning from 429s without an announced limit
}

var envRef = regexp.MustCompile(`\$\{([A-Za-z_][A-Za-z0-9_]*)\}`)

// ExpandHeaders returns the vendor's headers with ${NAME} replaced by the
// environment; a variable that is not set is an error naming it (never
// its would-be value).
func (v Vendor) ExpandHeaders() (map[string]string, error) {
	out := make(map[string]string, len(v.Headers))
	var missing []string
	for k, val := range v.Headers {
		out[k] = envRef.ReplaceAllStringFunc(val, func(ref string) string {
			name := envRef.FindStringSubmatch(ref)[1]
			x, ok := os.LookupEnv(name)
			if !ok {
				missing = append(missing, name)
			}
			return x
		})
	}
	if len(missing) > 0 {
		sort.Strings(missing)
		return nil, fmt.Errorf("config: vendors.%s.headers: environment variable(s) %s not set; export them before starting the worker", v.Name, strings.Join(missing, ", "))
	}
	return out, nil
}

// Policy returns the gate policy of the vendor.
func (v Vendor) Policy() shaper.Policy {
	p := shaper.Policy{
		Limits:      append([]shaper.Limit{{Rate: v.Rate, Window: v.Window}}, v.Limits...),
		Burst:       v.Burst,
		Guard:       v.Guard,
		NoGuard:     v.Guard == 0,
		MaxInFlight: v.MaxInFlight,
		Adapt:       v.Adapt,
	}
	return p
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

// vendorName is what viper keeps intact: it lower-cases keys and splits
// them on dots.
var vendorName = regexp.MustCompile(`^[a-z0-9_-]+$`)

var (
	redisKeys  = []string{"addr", "username", "password", "db", "tls", "master_name", "cluster"}
	vendorKeys = []string{"base_url", "rate", "window", "burst", "guard", "queue_limit", "max_in_flight", "limits", "timeout", "concurrency",
		"headers", "user_agent", "max_retry_after", "adapt_decrease", "adapt_increase", "adapt_quiet"}
	workerKeys = []string{"max_wait", "shutdown_timeout", "retention", "max_retry"}
	limitKeys  = []string{"rate", "window"}
	topKeys    = []string{"redis", "worker", "vendors"}
)

// Load reads and validates the config file at path. SHAPER_REDIS_ADDR,
// SHAPER_REDIS_USERNAME and SHAPER_REDIS_PASSWORD override the file.
func Load(path string) (*Config, error) {
	data, err := os.ReadFile(path)
	if err != nil {
		return nil, fmt.Errorf("config: %w", err)
	}
	return Parse(path, data)
}

// Parse validates config text; path is only used in messages.
func Parse(path string, data []byte) (*Config, error) {
	// The raw parse sees table names as written (viper would lower-case
	// and split them) and gives syntax errors with their line.
	var raw map[string]any
	if err := toml.Unmarshal(data, &raw); err != nil {
		var de *toml.DecodeError
		if errors.As(err, &de) {
			line, col := de.Position()
			return nil, fmt.Errorf("%s:%d:%d: %w: TOML syntax: %s", path, line, col, ErrInvalid, de.Error())
		}
		return nil, fmt.Errorf("%s: %w: %v", path, ErrInvalid, err)
	}
	v := viper.New()
	v.SetConfigType("toml")
	v.SetEnvPrefix("SHAPER")
	v.SetEnvKeyReplacer(strings.NewReplacer(".", "_"))
	for _, k := range []string{"redis.addr", "redis.username", "redis.password"} {
		_ = v.BindEnv(k)
	}
	if err := v.ReadConfig(bytes.NewReader(data)); err != nil {
		return nil, fmt.Errorf("%s: %w: %v", path, ErrInvalid, err)
	}
	p := &parser{path: path, text: string(data), v: v}
	cfg := &Config{Path: path}
	p.unknownKeys("", raw, topKeys)
	if r, ok := raw["redis"].(map[string]any); ok {
		p.unknownKeys("redis", r, redisKeys)
	} else if _, present := raw["redis"]; present {
		p.errorf("redis", "", "[redis] must be a table")
	}
	cfg.Redis = p.redis()
	if wt, ok := raw["worker"].(map[string]any); ok {
		p.unknownKeys("worker", wt, workerKeys)
	} else if _, present := raw["worker"]; present {
		p.errorf("worker", "", "[worker] must be a table")
	}
	cfg.Worker = p.worker()
	vendors, _ := raw["vendors"].(map[string]any)
	if _, present := raw["vendors"]; present && vendors == nil {
		p.errorf("vendors", "", "vendors must be tables like [vendors.acme]")
	}
	names := make([]string, 0, len(vendors))
	for name := range vendors {
		names = append(names, name)
	}
	sort.Strings(names)
	for _, name := range names {
		if !vendorName.MatchString(name) {
			p.errorf("vendors."+quoteKey(name), "", "vendor name %q must match ^[a-z0-9_-]+$ (lower-case letters, digits, '_' and '-'): viper lower-cases names and splits them on dots; rename it, e.g. [vendors.%s]", name, suggestName(name))
			continue
		}
		tbl, ok := vendors[name].(map[string]any)
		if !ok {
			p.errorf("vendors."+name, "", "vendors.%s must be a table: [vendors.%s]", name, name)
			continue
		}
		p.unknownKeys("vendors."+name, tbl, vendorKeys)
		if vd, ok := p.vendor(name, tbl); ok {
			cfg.Vendors = append(cfg.Vendors, vd)
		}
	}
	if len(p.errs) > 0 {
		return nil, errors.Join(p.errs...)
	}
	return cfg, nil
}

// parser collects every problem of one file.
type parser struct {
	path string
	text string
	v    *viper.Viper
	errs []error
}

// errorf records a problem with key (table.key), located in the file.
func (p *parser) errorf(table, key, format string, args ...any) {
	loc := p.path
	if line := locate(p.text, table, key); line > 0 {
		loc = fmt.Sprintf("%s:%d", p.path, line)
	}
	name := table
	if key != "" {
		name += "." + key
	}
	p.errs = append(p.errs, fmt.Errorf("%s: %w: %s: %s", loc, ErrInvalid, name, fmt.Sprintf(format, args...)))
}

func (p *parser) unknownKeys(table string, tbl map[string]any, known []string) {
	keys := make([]string, 0, len(tbl))
	for k := range tbl {
		keys = append(keys, k)
	}
	sort.Strings(keys)
	for _, k := range keys {
		if slices.Contains(known, k) {
			continue
		}
		hint := "known keys: " + strings.Join(known, ", ")
		if s := closest(k, known); s != "" {
			hint = fmt.Sprintf("did you mean %q? (%s)", s, hint)
		}
		if table == "" {
			p.errorf(k, "", "unknown key; %s", hint)
		} else {
			p.errorf(table, k, "unknown key; %s", hint)
		}
	}
}

func (p *parser) redis() Redis {
	r := Redis{
		Addr:       strings.TrimSpace(p.str("redis", "addr")),
		Username:   p.str("redis", "username"),
		Password:   p.str("redis", "password"),
		MasterName: p.str("redis", "master_name"),
	}
	r.DB, _ = p.integer("redis", "db", 0, 0)
	r.TLS = p.boolean("redis", "tls")
	r.Cluster = p.boolean("redis", "cluster")
	if r.Addr != "" {
		if err := checkAddr(r.Addr); err != nil {
			p.errorf("redis", "addr", "%q: %v", r.Addr, err)
		}
	}
	if r.Cluster && r.MasterName != "" {
		p.errorf("redis", "cluster", "set either cluster = true or master_name (Sentinel), not both")
	}
	if (r.Cluster || r.MasterName != "") && r.Addr == "" {
		p.errorf("redis", "addr", "Cluster and Sentinel need addr to list their nodes")
	}
	return r
}

func (p *parser) worker() Worker {
	w := Worker{
		MaxWait:         p.duration("worker", "max_wait", DefaultMaxWait),
		ShutdownTimeout: p.duration("worker", "shutdown_timeout", DefaultShutdownTimeout),
		Retention:       p.duration("worker", "retention", DefaultRetention),
	}
	w.MaxRetry, _ = p.integer("worker", "max_retry", 1, DefaultMaxRetry)
	for key, d := range map[string]time.Duration{"max_wait": w.MaxWait, "shutdown_timeout": w.ShutdownTimeout, "retention": w.Retention} {
		if d <= 0 {
			p.errorf("worker", key, "%s: must be positive", d)
		}
	}
	return w
}

func checkAddr(addr string) error {
	if strings.HasPrefix(addr, "redis://") || strings.HasPrefix(addr, "rediss://") {
		if _, err := url.Parse(addr); err != nil {
			return fmt.Errorf("not a valid URL: %v", err)
		}
		return nil
	}
	for _, a := range strings.Split(addr, ",") {
		a = strings.TrimSpace(a)
		if _, port, err := net.SplitHostPort(a); err != nil || port == "" {
			return fmt.Errorf("want host:port (e.g. 127.0.0.1:6379), a comma-separated list of them, or a redis:// URL; leave it empty for the embedded Redis")
		}
	}
	return nil
}

func (p *parser) vendor(name string, tbl map[string]any) (Vendor, bool) {
	before := len(p.errs)
	t := "vendors." + name
	vd := Vendor{Name: name}
	vd.BaseURL = p.str(t, "base_url")
	if _, present := tbl["base_url"]; !present {
		p.errorf(t, "", "base_url is required, e.g. base_url = \"https://api.%s.example\"", name)
	} else if u, err := url.Parse(vd.BaseURL); err != nil || (u.Scheme != "http" && u.Scheme != "https") || u.Host == "" {
		p.errorf(t, "base_url", "%q: want an absolute http:// or https:// URL", vd.BaseURL)
	} else if u.RawQuery != "" || u.Fragment != "" {
		p.errorf(t, "base_url", "%q: a base URL has no query or fragment; put them in each call's path", vd.BaseURL)
	}
	var ok bool
	if _, present := tbl["rate"]; !present {
		p.errorf(t, "", "rate is required: the calls the vendor allows per window, e.g. rate = 100")
	} else if vd.Rate, ok = p.integer(t, "rate", 1, 0); !ok {
		vd.Rate = 0
	}
	vd.Window = p.duration(t, "window", DefaultWindow)
	if vd.Window <= 0 {
		p.errorf(t, "window", "%s: a window must be positive, e.g. window = \"1s\"", vd.Window)
	}
	vd.Burst, _ = p.integer(t, "burst", 1, DefaultBurst)
	vd.Guard = p.duration(t, "guard", DefaultGuard)
	if vd.Guard < 0 {
		p.errorf(t, "guard", "%s must not be negative; 0 turns the jitter margin off", vd.Guard)
	} else if vd.Window > 0 && vd.Guard >= vd.Window {
		p.errorf(t, "guard", "%s must be shorter than the window %s (it is a margin for network jitter, typically a few ms)", vd.Guard, vd.Window)
	}
	vd.QueueLimit, _ = p.integer(t, "queue_limit", 0, DefaultQueueLimit)
	vd.MaxInFlight, _ = p.integer(t, "max_in_flight", 0, 0)
	vd.Concurrency, _ = p.integer(t, "concurrency", 0, 0)
	vd.Timeout = p.duration(t, "timeout", DefaultTimeout)
	if vd.Timeout <= 0 {
		p.errorf(t, "timeout", "%s: must be positive, e.g. timeout = \"30s\"", vd.Timeout)
	}
	if vd.Rate > 0 && vd.Burst > vd.Rate {
		p.errorf(t, "burst", "%d > rate %d: releasing %d calls on one tick would overrun the vendor's fixed window; set burst <= %d (1 spreads calls evenly)", vd.Burst, vd.Rate, vd.Burst, vd.Rate)
	}
	vd.Limits = p.limits(t, tbl["limits"], vd)
	vd.UserAgent = p.str(t, "user_agent")
	vd.MaxRetryAfter = p.duration(t, "max_retry_after", DefaultMaxRetryAfter)
	if vd.MaxRetryAfter <= 0 {
		p.errorf(t, "max_retry_after", "%s: must be positive, e.g. \"1h\"", vd.MaxRetryAfter)
	}
	vd.Adapt.Decrease = p.fraction(t, "adapt_decrease", 0.7)
	vd.Adapt.Increase = p.fraction(t, "adapt_increase", 0.05)
	vd.Adapt.Quiet = p.duration(t, "adapt_quiet", 10*time.Second)
	if vd.Adapt.Quiet <= 0 {
		p.errorf(t, "adapt_quiet", "%s: must be positive", vd.Adapt.Quiet)
	}
	if raw, present := tbl["headers"]; present {
		hm, ok := raw.(map[string]any)
		if !ok {
			p.errorf(t, "headers", "must be a table, e.g. headers = { Authorization = \"Bearer ${ACME_TOKEN}\" }")
		}
		vd.Headers = map[string]string{}
		for k, val := range hm {
			sv, ok := val.(string)
			if !ok || strings.ContainsAny(sv, "\r\n") || k == "" || strings.ContainsAny(k, " :\r\n") {
				p.errorf(t, "headers", "%q: header names are tokens and values quoted strings on one line", k)
				continue
			}
			if strings.EqualFold(k, "Idempotency-Key") {
				p.errorf(t, "headers", "Idempotency-Key is set by shaper from each call's id")
				continue
			}
			vd.Headers[k] = sv
		}
	}
	if len(p.errs) > before {
		return Vendor{}, false
	}
	if err := vd.Policy().Validate(); err != nil { // belt and braces: the gate's own check
		p.errorf(t, "", "%v", err)
		return Vendor{}, false
	}
	return vd, true
}

func (p *parser) limits(t string, raw any, vd Vendor) []shaper.Limit {
	if raw == nil {
		return nil
	}
	list, ok := raw.([]any)
	if !ok {
		p.errorf(t, "limits", "must be an array of tables, e.g. limits = [ { rate = 5000, window = \"24h\" } ]")
		return nil
	}
	var out []shaper.Limit
	for i, item := range list {
		m, ok := item.(map[string]any)
		if !ok {
			p.errorf(t, "limits", "item %d must be a table { rate = N, window = \"D\" }", i+1)
			continue
		}
		for k := range m {
			if !slices.Contains(limitKeys, k) {
				p.errorf(t, "limits", "item %d: unknown key %q; a limit has rate and window", i+1, k)
			}
		}
		rate, rok := m["rate"].(int64)
		ws, wok := m["window"].(string)
		if !rok || rate < 1 {
			p.errorf(t, "limits", "item %d: rate = %v: want an integer >= 1", i+1, m["rate"])
			continue
		}
		w, err := time.ParseDuration(ws)
		if !wok || err != nil || w <= 0 {
			p.errorf(t, "limits", "item %d: window = %v: want a positive duration string such as \"1m\" or \"24h\"", i+1, m["window"])
			continue
		}
		if vd.Burst > int(rate) {
			p.errorf(t, "burst", "%d > %d per %s (limits item %d): releasing %d calls at once would overrun that window; set burst <= %d", vd.Burst, rate, w, i+1, vd.Burst, rate)
		}
		if vd.Guard >= w {
			p.errorf(t, "guard", "%s must be shorter than every window, and limits item %d has %s", vd.Guard, i+1, w)
		}
		out = append(out, shaper.Limit{Rate: int(rate), Window: w})
	}
	return out
}

func (p *parser) str(table, key string) string {
	full := table + "." + key
	if !p.v.IsSet(full) {
		return ""
	}
	s, ok := p.v.Get(full).(string)
	if !ok {
		p.errorf(table, key, "%v: want a quoted string", p.v.Get(full))
	}
	return s
}

func (p *parser) boolean(table, key string) bool {
	full := table + "." + key
	if !p.v.IsSet(full) {
		return false
	}
	b, ok := p.v.Get(full).(bool)
	if !ok {
		p.errorf(table, key, "%v: want true or false", p.v.Get(full))
	}
	return b
}

// integer reads an integer >= lo, or def when the key is absent.
func (p *parser) integer(table, key string, lo, def int) (int, bool) {
	full := table + "." + key
	if !p.v.IsSet(full) {
		return def, true
	}
	var n int64
	switch x := p.v.Get(full).(type) {
	case int64:
		n = x
	case int:
		n = int64(x)
	default:
		p.errorf(table, key, "%v: want a whole number", x)
		return def, false
	}
	if n < int64(lo) {
		p.errorf(table, key, "%d: must be at least %d", n, lo)
		return def, false
	}
	return int(n), true
}

// fraction reads a number in (0, 1), or def when absent.
func (p *parser) fraction(table, key string, def float64) float64 {
	full := table + "." + key
	if !p.v.IsSet(full) {
		return def
	}
	var f float64
	switch x := p.v.Get(full).(type) {
	case float64:
		f = x
	case int64:
		f = float64(x)
	default:
		p.errorf(table, key, "%v: want a number between 0 and 1", x)
		return def
	}
	if !(f > 0 && f < 1) {
		p.errorf(table, key, "%v: want a number between 0 and 1 (exclusive)", f)
		return def
	}
	return f
}

func (p *parser) duration(table, key string, def time.Duration) time.Duration {
	full := table + "." + key
	if !p.v.IsSet(full) {
		return def
	}
	s, ok := p.v.Get(full).(string)
	if !ok {
		p.errorf(table, key, "%v: want a duration string such as \"1s\", \"250ms\" or \"1m\"", p.v.Get(full))
		return def
	}
	d, err := time.ParseDuration(s)
	if err != nil {
		p.errorf(table, key, "%q: want a duration such as \"1s\", \"250ms\" or \"1m\"", s)
		return def
	}
	return d
}

// locate returns the 1-based line of key in [table], or of the table
// header when key is empty, or 0 when it cannot tell.
func locate(text, table, key string) int {
	lines := strings.Split(text, "\n")
	header := -1
	if table != "" && !strings.Contains(table, ".") && key == "" {
		// A top-level key or table.
		re := regexp.MustCompile(`^\s*(\[\s*` + regexp.QuoteMeta(table) + `\s*[\].]|` + regexp.QuoteMeta(table) + `\s*=)`)
		for i, l := range lines {
			if re.MatchString(l) {
				return i + 1
			}
		}
		return 0
	}
	parts := strings.SplitN(table, ".", 2)
	var re *regexp.Regexp
	if len(parts) == 2 {
		name := strings.Trim(parts[1], `"`)
		re = regexp.MustCompile(`^\s*\[\s*` + regexp.QuoteMeta(parts[0]) + `\s*\.\s*("` + regexp.QuoteMeta(name) + `"|'` + regexp.QuoteMeta(name) + `'|` + regexp.QuoteMeta(name) + `)\s*\]`)
	} else {
		re = regexp.MustCompile(`^\s*\[\s*` + regexp.QuoteMeta(table) + `\s*\]`)
	}
	for i, l := range lines {
		if re.MatchString(l) {
			header = i
			break
		}
	}
	if header < 0 {
		return 0
	}
	if key == "" {
		return header + 1
	}
	keyRe := regexp.MustCompile(`^\s*"?` + regexp.QuoteMeta(key) + `"?\s*=`)
	for i := header + 1; i < len(lines); i++ {
		if strings.HasPrefix(strings.TrimSpace(lines[i]), "[") {
			break
		}
		if keyRe.MatchString(lines[i]) {
			return i + 1
		}
	}
	return header + 1
}

func quoteKey(name string) string {
	if vendorName.MatchString(name) {
		return name
	}
	return `"` + name + `"`
}

// suggestName turns a name viper would mangle into one it keeps.
func suggestName(name string) string {
	s := strings.ToLower(name)
	s = regexp.MustCompile(`[^a-z0-9_-]+`).ReplaceAllString(s, "-")
	s = strings.Trim(s, "-")
	if s == "" {
		s = "vendor"
	}
	return s
}

// closest returns the known key within edit distance 2 of k, if any.
func closest(k string, known []string) string {
	best, bestD := "", 3
	for _, c := range known {
		if d := editDistance(k, c); d < bestD {
			best, bestD = c, d
		}
	}
	return best
}

func editDistance(a, b string) int {
	prev := make([]int, len(b)+1)
	for j := range prev {
		prev[j] = j
	}
	for i := 1; i <= len(a); i++ {
		cur := make([]int, len(b)+1)
		cur[0] = i
		for j := 1; j <= len(b); j++ {
			cost := 1
			if a[i-1] == b[j-1] {
				cost = 0
			}
			cur[j] = min(prev[j]+1, cur[j-1]+1, prev[j-1]+cost)
		}
		prev = cur
	}
	return prev[len(b)]
}
