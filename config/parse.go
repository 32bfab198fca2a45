package config

// The parser: typed readers of viper values, and one method per table
// ([redis], [worker], [vendors.*] and their limits). Every problem is
// recorded with its source line and parsing goes on, so that one run
// reports them all.

import (
	"errors"
	"fmt"
	"math"
	"net"
	"net/http"
	"net/url"
	"regexp"
	"slices"
	"sort"
	"strconv"
	"strings"
	"time"

	"github.com/spf13/viper"

	"github.com/shaper-dev/shaper/queue"
	"github.com/shaper-dev/shaper/shaper"
	"github.com/shaper-dev/shaper/vendorclients"
)

var (
	redisKeys  = []string{"addr", "username", "password", "db", "tls", "master_name", "cluster", "wait_replicas", "wait_timeout", "tls_ca_file", "tls_cert_file", "tls_key_file"}
	vendorKeys = []string{"base_url", "rate", "window", "burst", "guard", "queue_limit", "max_in_flight", "limits", "timeout", "concurrency",
		"headers", "user_agent", "max_retry_after", "adapt_decrease", "adapt_increase", "adapt_quiet", "strict_spacing", "warmup", "warmup_from",
		"per_account", "account_overrides", "total", "max_answer", "keep_headers"}
	workerKeys = []string{"max_wait", "shutdown_timeout", "retention", "max_retry"}
	limitKeys  = []string{"rate", "window", "spread"}
	topKeys    = []string{"redis", "worker", "callbacks", "tracing", "vendors"}
)

// parser collects every problem of one file.
type parser struct {
	path string
	text string
	v    *viper.Viper
	errs []error
}

// config walks the tables of the raw parse and reads each with viper.
func (p *parser) config(raw map[string]any) *Config {
	cfg := &Config{Path: p.path}
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
	cfg.Callbacks = p.callbacks(raw)
	cfg.Tracing = p.tracing(raw)
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
	return cfg
}

// errorf records a problem with key (table.key), located in the file.
// format may wrap an error with %w: the recorded error keeps its chain.
func (p *parser) errorf(table, key, format string, args ...any) {
	name := table
	if key != "" {
		name += "." + key
	}
	p.errorAt(locate(p.text, table, key), name, format, args...)
}

// errorAt records a problem with what name names, at line (0: unknown).
func (p *parser) errorAt(line int, name, format string, args ...any) {
	loc := p.path
	if line > 0 {
		loc = fmt.Sprintf("%s:%d", p.path, line)
	}
	p.errs = append(p.errs, fmt.Errorf("%s: %w: %s: %w", loc, ErrInvalid, name, fmt.Errorf(format, args...)))
}

// knownKeyHint is the hint of an unknown key: the known key it is
// closest to, if any, and the list of them.
func knownKeyHint(k string, known []string) string {
	hint := "known keys: " + strings.Join(known, ", ")
	if s := closest(k, known); s != "" {
		hint = fmt.Sprintf("did you mean %q? (%s)", s, hint)
	}
	return hint
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
		hint := knownKeyHint(k, known)
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
	r.TLSCAFile, r.TLSCertFile, r.TLSKeyFile = p.str("redis", "tls_ca_file"), p.str("redis", "tls_cert_file"), p.str("redis", "tls_key_file")
	if (r.TLSCertFile == "") != (r.TLSKeyFile == "") {
		p.errorf("redis", "tls_cert_file", "tls_cert_file and tls_key_file go together (a client certificate and its key)")
	}
	r.Cluster = p.boolean("redis", "cluster")
	r.WaitReplicas, _ = p.integer("redis", "wait_replicas", 0, 0)
	r.WaitTimeout = p.duration("redis", "wait_timeout", queue.DefaultWaitTimeout)
	if r.Cluster && r.WaitReplicas > 0 {
		p.errorf("redis", "wait_replicas", "is not supported with cluster = true (each shard has its own replicas); leave it 0")
	}
	if r.Addr != "" {
		if err := checkAddr(r.Addr); err != nil {
			p.errorf("redis", "addr", "%q: %w", r.Addr, err)
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
		MaxWait:         p.duration("worker", "max_wait", queue.DefaultMaxWait),
		ShutdownTimeout: p.duration("worker", "shutdown_timeout", queue.DefaultShutdownTimeout),
		Retention:       p.duration("worker", "retention", queue.DefaultRetention),
	}
	w.MaxRetry, _ = p.integer("worker", "max_retry", 1, queue.DefaultMaxRetry)
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
			return fmt.Errorf("not a valid URL: %w", err)
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
	vd.PerAccount = p.boolean(t, "per_account")
	vd.BaseURL = p.str(t, "base_url")
	if _, present := tbl["base_url"]; !present {
		p.errorf(t, "", "base_url is required, e.g. base_url = \"https://api.%s.example\"", name)
	} else if err := checkBaseURL(vd.BaseURL, vd.PerAccount); err != nil {
		p.errorf(t, "base_url", "%q: %w", vd.BaseURL, err)
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
	vd.Burst, _ = p.integer(t, "burst", 1, shaper.DefaultBurst)
	// The guard follows what the worker measures unless a duration is
	// set (guard = "measured" says the default out loud).
	if g, ok := p.v.Get(t + ".guard").(string); !p.v.IsSet(t+".guard") || ok && g == "measured" {
		vd.Guard, vd.GuardMeasured = shaper.DefaultGuard, true
	} else {
		vd.Guard = p.duration(t, "guard", shaper.DefaultGuard)
	}
	if vd.Guard < 0 {
		p.errorf(t, "guard", "%s must not be negative; 0 turns the jitter margin off", vd.Guard)
	} else if vd.Window > 0 && vd.Guard >= vd.Window {
		p.errorf(t, "guard", "%s must be shorter than the window %s (it is a margin for network jitter, typically a few ms)", vd.Guard, vd.Window)
	}
	vd.QueueLimit, _ = p.integer(t, "queue_limit", 0, DefaultQueueLimit)
	vd.MaxInFlight, _ = p.integer(t, "max_in_flight", 0, 0)
	vd.Concurrency, _ = p.integer(t, "concurrency", 0, 0)
	vd.Timeout = p.duration(t, "timeout", vendorclients.DefaultTimeout)
	if vd.Timeout <= 0 {
		p.errorf(t, "timeout", "%s: must be positive, e.g. timeout = \"30s\"", vd.Timeout)
	}
	if vd.Rate > 0 && vd.Burst > vd.Rate {
		p.errorf(t, "burst", "%d > rate %d: releasing %d calls on one tick would overrun the vendor's fixed window; set burst <= %d (1 spreads calls evenly)", vd.Burst, vd.Rate, vd.Burst, vd.Rate)
	}
	vd.Limits = limits(tbl["limits"], func(n int, format string, args ...any) {
		if n == 0 {
			p.errorf(t, "limits", format, args...)
			return
		}
		p.errorAt(locateItem(p.text, t, "limits", n), fmt.Sprintf("%s.limits item %d", t, n), format, args...)
	})
	for i, l := range vd.Limits {
		if vd.Burst > l.Rate {
			p.errorf(t, "burst", "%d > %s (limits item %d): releasing %d calls at once would overrun that window; set burst <= %d", vd.Burst, l, i+1, vd.Burst, l.Rate)
		}
		if vd.Guard >= l.Window {
			p.errorf(t, "guard", "%s must be shorter than every window, and limits item %d has %s", vd.Guard, i+1, l.Window)
		}
	}
	vd.UserAgent = p.str(t, "user_agent")
	vd.MaxRetryAfter = p.duration(t, "max_retry_after", vendorclients.DefaultMaxRetryAfter)
	if vd.MaxRetryAfter <= 0 {
		p.errorf(t, "max_retry_after", "%s: must be positive, e.g. \"1h\"", vd.MaxRetryAfter)
	}
	// Absent adapt keys leave their field zero: shaper.Adapt's zero
	// fields select its defaults, defined there only.
	vd.Adapt.Decrease = p.fraction(t, "adapt_decrease", 0)
	vd.Adapt.Increase = p.fraction(t, "adapt_increase", 0)
	if vd.Adapt.Quiet = p.duration(t, "adapt_quiet", 0); p.isSet(t, "adapt_quiet") && vd.Adapt.Quiet <= 0 {
		p.errorf(t, "adapt_quiet", "%s: must be positive, e.g. \"10s\"", vd.Adapt.Quiet)
	}
	vd.StrictSpacing = p.boolean(t, "strict_spacing")
	if vd.Warmup = p.duration(t, "warmup", 0); vd.Warmup < 0 {
		p.errorf(t, "warmup", "%s must not be negative; leave it out for no warm-up, or e.g. warmup = \"30s\"", vd.Warmup)
	}
	if p.isSet(t, "warmup_from") {
		vd.WarmupFrom = p.number(t, "warmup_from")
		switch {
		case vd.Warmup <= 0:
			p.errorf(t, "warmup_from", "is set but warmup is not: set warmup (e.g. warmup = \"30s\") for a ramp from warmup_from to the rate")
		case !(vd.WarmupFrom > 0) || vd.WarmupFrom > float64(vd.Rate):
			p.errorf(t, "warmup_from", "%v: want a rate above 0 and at most rate (%d), in calls per window; default a quarter of rate", vd.WarmupFrom, vd.Rate)
		}
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
	vd.MaxAnswer = p.maxAnswer(t)
	vd.KeepHeaders = p.keepHeaders(t, tbl)
	policyErr := vd.Policy().Validate()
	if policyErr != nil && len(p.errs) == before { // belt and braces: the gate's own check
		p.errorf(t, "", "%w", policyErr)
	}
	// The per-account tables are read even when other keys of the vendor
	// are wrong, so that one run reports every problem; their policies
	// are checked only against a valid vendor policy (they inherit its
	// keys), so that one mistake is not reported once per account.
	p.accounts(t, tbl, &vd, policyErr == nil)
	if len(p.errs) > before {
		return Vendor{}, false
	}
	return vd, true
}

// maxAnswer reads max_answer of vendor table t: a whole number of
// bytes, or a string of one with a unit (parseSize). Absent is 0, which
// selects queue.DefaultMaxAnswer; max_answer = 0 keeps no body and is
// queue.NoAnswerBody.
func (p *parser) maxAnswer(t string) int64 {
	const key = "max_answer"
	if !p.isSet(t, key) {
		return 0
	}
	var n int64
	var shown string
	switch x := p.v.Get(t + "." + key).(type) {
	case int64:
		n, shown = x, strconv.FormatInt(x, 10)
	case int:
		n, shown = int64(x), strconv.Itoa(x)
	case string:
		var err error
		if n, err = parseSize(x); err != nil {
			p.errorf(t, key, "%q: %w", x, err)
			return 0
		}
		shown = strconv.Quote(x)
	default:
		p.errorf(t, key, "%v: want a whole number of bytes or a size such as \"64KiB\" or \"1MiB\"", x)
		return 0
	}
	switch {
	case n < 0:
		p.errorf(t, key, "%s must not be negative; 0 keeps no body (the status and keep_headers only)", shown)
		return 0
	case n > queue.MaxMaxAnswer:
		p.errorf(t, key, "%s is above the cap of 16MiB (%d bytes): every call a worker holds may hold its answer in memory; set at most \"16MiB\"", shown, queue.MaxMaxAnswer)
		return 0
	case n == 0:
		return queue.NoAnswerBody
	}
	return n
}

// sizeText is a size as max_answer writes it: a whole number, then a
// unit, maybe after a space.
var sizeText = regexp.MustCompile(`^(-?[0-9]+) ?([A-Za-z]*)$`)

// sizeUnits are the units of a size: bytes and powers of 1024 only, so
// that no one reads "1MB" as 10^6 bytes where shaper meant 2^20.
var sizeUnits = map[string]int64{"": 1, "B": 1, "KiB": 1 << 10, "MiB": 1 << 20}

// parseSize reads a size in bytes: "512", "512B", "64KiB", "1MiB" (a
// space may stand before the unit). A negative size is returned for the
// caller to refuse; one too large for an int64 is math.MaxInt64.
func parseSize(s string) (int64, error) {
	m := sizeText.FindStringSubmatch(s)
	if m == nil {
		return 0, errors.New("want a whole number of bytes, alone or with B, KiB or MiB, e.g. \"512\", \"64KiB\" or \"1MiB\"")
	}
	unit, ok := sizeUnits[m[2]]
	if !ok {
		return 0, fmt.Errorf("unit %q: want B, KiB (1024 bytes) or MiB (1024 KiB), written so (KB and MB are not taken: 1000 or 1024 bytes?)", m[2])
	}
	// The pattern leaves ParseInt only a number out of range to fail
	// on, and then n is the nearest int64: out of range below too.
	n, _ := strconv.ParseInt(m[1], 10, 64)
	switch {
	case n > math.MaxInt64/unit:
		return math.MaxInt64, nil
	case n < math.MinInt64/unit:
		return math.MinInt64, nil
	}
	return n * unit, nil
}

// keepHeaders reads keep_headers of vendor table t: the names of the
// answer headers kept with each result, HTTP tokens, each once.
func (p *parser) keepHeaders(t string, tbl map[string]any) []string {
	const key = "keep_headers"
	raw, present := tbl[key]
	if !present {
		return nil
	}
	list, ok := raw.([]any)
	if !ok {
		p.errorf(t, key, "%s: want an array of header names, e.g. keep_headers = [\"X-Request-Id\", \"Link\"]", rawString(raw))
		return nil
	}
	var out []string
	seen := map[string]int{}
	for i, x := range list {
		name, ok := x.(string)
		if !ok || !headerName(name) {
			p.errorf(t, key, "item %d = %s: want a header name: a quoted, non-empty token without spaces, colons or control characters, e.g. \"X-Request-Id\"", i+1, rawString(x))
			continue
		}
		canon := http.CanonicalHeaderKey(name)
		if first, dup := seen[canon]; dup {
			p.errorf(t, key, "item %d = %q: already item %d (header names are case-insensitive); list it once", i+1, name, first)
			continue
		}
		seen[canon] = i + 1
		out = append(out, name)
	}
	return out
}

// headerName reports whether s is a header field name: a token of RFC
// 9110 (letters, digits and !#$%&'*+-.^_`|~).
func headerName(s string) bool {
	if s == "" {
		return false
	}
	for _, c := range []byte(s) {
		ok := 'a' <= c && c <= 'z' || 'A' <= c && c <= 'Z' || '0' <= c && c <= '9' || strings.IndexByte("!#$%&'*+-.^_`|~", c) >= 0
		if !ok {
			return false
		}
	}
	return true
}

// limits reads a limits array (of a vendor or of an override); fail
// records a problem with item n, from 1, or with the array itself (n 0).
func limits(raw any, fail func(n int, format string, args ...any)) []shaper.Limit {
	if raw == nil {
		return nil
	}
	list, ok := raw.([]any)
	if !ok {
		fail(0, "must be an array of tables, e.g. limits = [ { rate = 5000, window = \"24h\" } ]")
		return nil
	}
	var out []shaper.Limit
	for i, item := range list {
		m, ok := item.(map[string]any)
		if !ok {
			fail(i+1, "must be a table { rate = N, window = \"D\" }")
			continue
		}
		keys := make([]string, 0, len(m))
		for k := range m {
			keys = append(keys, k)
		}
		sort.Strings(keys)
		for _, k := range keys {
			if !slices.Contains(limitKeys, k) {
				fail(i+1, "unknown key %q; a limit has rate, window and spread", k)
			}
		}
		rate, rok := m["rate"].(int64)
		ws, wok := m["window"].(string)
		if !rok || rate < 1 {
			fail(i+1, "rate = %s: want an integer >= 1", rawString(m["rate"]))
			continue
		}
		w, err := time.ParseDuration(ws)
		if !wok || err != nil || w <= 0 {
			fail(i+1, "window = %s: want a positive duration string such as \"1m\" or \"24h\"", rawString(m["window"]))
			continue
		}
		spread := false
		if raw, present := m["spread"]; present {
			b, ok := raw.(bool)
			if !ok {
				fail(i+1, "spread = %s: want true (spread the rate evenly over the window) or false (a quota: calls go at the pace of the shorter limits until it is spent)", rawString(raw))
				continue
			}
			spread = b
		}
		out = append(out, shaper.Limit{Rate: int(rate), Window: w, Spread: spread})
	}
	return out
}

// rawString formats a value of the raw parse as TOML writes it: strings
// quoted, an absent value as (missing).
func rawString(x any) string {
	switch x := x.(type) {
	case nil:
		return "(missing)"
	case string:
		return fmt.Sprintf("%q", x)
	}
	return fmt.Sprint(x)
}

// isSet reports whether table.key is in the file (or the environment).
func (p *parser) isSet(table, key string) bool { return p.v.IsSet(table + "." + key) }

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

// number reads a number (integer or float) that the caller checks.
func (p *parser) number(table, key string) float64 {
	switch x := p.v.Get(table + "." + key).(type) {
	case float64:
		return x
	case int64:
		return float64(x)
	default:
		p.errorf(table, key, "%v: want a number", x)
		return 0
	}
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
