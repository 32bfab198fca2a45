package config

import (
	"errors"
	"net/url"
	"os"
	"strings"
	"testing"
	"time"

	"github.com/pelletier/go-toml/v2"

	"github.com/shaper-dev/shaper/queue"
	"github.com/shaper-dev/shaper/shaper"
	"github.com/shaper-dev/shaper/vendorclients"
)

func TestExampleConfig(t *testing.T) {
	cfg, err := Load("../config.toml")
	if err != nil {
		t.Fatalf("the documented example does not load: %v", err)
	}
	if got := cfg.VendorNames(); strings.Join(got, ",") != "acme,crm,shop" {
		t.Errorf("vendors = %v", got)
	}
	acme, _ := cfg.Vendor("acme")
	want := Vendor{Name: "acme", BaseURL: "https://api.acme.example", Rate: 100, Window: time.Second, Burst: 1,
		Guard: 20 * time.Millisecond, QueueLimit: 100000}
	if acme.Name != want.Name || acme.BaseURL != want.BaseURL || acme.Rate != want.Rate || acme.Window != want.Window ||
		acme.Burst != want.Burst || acme.Guard != want.Guard || acme.QueueLimit != want.QueueLimit || acme.MaxInFlight != 0 {
		t.Errorf("acme = %+v, want %+v", acme, want)
	}
	crm, _ := cfg.Vendor("crm")
	if len(crm.Limits) != 1 || crm.Limits[0] != (shaper.Limit{Rate: 5000, Window: 24 * time.Hour}) || crm.MaxInFlight != 4 {
		t.Errorf("crm = %+v", crm)
	}
	if cfg.Worker != (Worker{MaxWait: 5 * time.Second, ShutdownTimeout: 10 * time.Second, Retention: 24 * time.Hour, MaxRetry: 25}) {
		t.Errorf("worker = %+v", cfg.Worker)
	}
	if acme.Timeout != 30*time.Second || acme.Concurrency != 0 {
		t.Errorf("acme timeout %v concurrency %d", acme.Timeout, acme.Concurrency)
	}
	if !cfg.Redis.Embedded() {
		t.Errorf("redis.addr empty should mean embedded")
	}
	if acme.PerAccount || crm.PerAccount || acme.Overrides != nil || acme.Total != nil {
		t.Errorf("acme and crm are not per account: %+v, %+v", acme, crm)
	}
	shop, _ := cfg.Vendor("shop")
	if !shop.PerAccount || shop.BaseURL != "https://api.shop.example/stores/{account}" || shop.Rate != 2 ||
		len(shop.Overrides) != 1 || shop.Overrides[0].Account != "big-store" || shop.Overrides[0].Rate != 20 ||
		shop.Total == nil || *shop.Total != (shaper.Limit{Rate: 40, Window: time.Second}) {
		t.Errorf("shop = %+v", shop)
	}
}

func TestDefaults(t *testing.T) {
	cfg, err := Parse("c.toml", []byte("[vendors.a]\nbase_url = \"http://x\"\nrate = 7\n"))
	if err != nil {
		t.Fatal(err)
	}
	v := cfg.Vendors[0]
	if v.Window != DefaultWindow || v.Burst != 1 || v.Guard != shaper.DefaultGuard || v.QueueLimit != DefaultQueueLimit || v.MaxInFlight != 0 {
		t.Errorf("defaults = %+v", v)
	}
	// The owning packages' defaults, not copies of them.
	if v.Timeout != vendorclients.DefaultTimeout || v.MaxRetryAfter != vendorclients.DefaultMaxRetryAfter {
		t.Errorf("timeout %s, max_retry_after %s: want vendorclients' defaults", v.Timeout, v.MaxRetryAfter)
	}
	if want := (Worker{MaxWait: queue.DefaultMaxWait, ShutdownTimeout: queue.DefaultShutdownTimeout,
		Retention: queue.DefaultRetention, MaxRetry: queue.DefaultMaxRetry}); cfg.Worker != want {
		t.Errorf("worker = %+v, want queue's defaults %+v", cfg.Worker, want)
	}
	// Absent adapt keys stay zero: shaper.Adapt's zero fields select its
	// own defaults.
	if v.Adapt != (shaper.Adapt{}) {
		t.Errorf("adapt = %+v with no adapt_* key, want the zero Adapt", v.Adapt)
	}
	iv, burst := v.Policy().Tick()
	if iv != 145715*time.Microsecond || burst != 1 { // 1.02s/7 = 145714.28µs, rounded up
		t.Errorf("tick = %v x%d", iv, burst)
	}
}

func TestEnvOverridesRedis(t *testing.T) {
	t.Setenv("SHAPER_REDIS_ADDR", "10.0.0.5:6380")
	t.Setenv("SHAPER_REDIS_PASSWORD", "s3cret")
	cfg, err := Parse("c.toml", []byte("[redis]\naddr = \"\"\n"))
	if err != nil {
		t.Fatal(err)
	}
	if cfg.Redis.Addr != "10.0.0.5:6380" || cfg.Redis.Password != "s3cret" {
		t.Errorf("redis = %+v", cfg.Redis)
	}
}

func TestInvalidConfigs(t *testing.T) {
	tests := []struct {
		name string
		toml string
		want []string // substrings of the error, in any order
	}{
		{"dotted vendor name", "[vendors.\"api.example.com\"]\nbase_url = \"https://x\"\nrate = 1\n",
			[]string{"c.toml:1:", `vendor name "api.example.com" must match ^[a-z0-9_-]+$`, "[vendors.api-example-com]"}},
		{"upper-case vendor name", "[vendors.Acme]\nbase_url = \"https://x\"\nrate = 1\n",
			[]string{"c.toml:1:", `"Acme"`, "[vendors.acme]"}},
		{"burst above rate", "[vendors.acme]\nbase_url = \"https://x\"\nrate = 10\nburst = 20\n",
			[]string{"c.toml:4:", "vendors.acme.burst", "20 > rate 10", "overrun the vendor's fixed window", "burst <= 10"}},
		{"burst above an extra limit", "[vendors.acme]\nbase_url = \"https://x\"\nrate = 100\nburst = 10\nlimits = [{ rate = 5, window = \"100ms\" }]\n",
			[]string{"c.toml:4:", "10 > 5 per 100ms"}},
		{"missing rate", "[vendors.acme]\nbase_url = \"https://x\"\n", []string{"c.toml:1:", "rate is required"}},
		{"zero rate", "[vendors.acme]\nbase_url = \"https://x\"\nrate = 0\n", []string{"c.toml:3:", "vendors.acme.rate", "at least 1"}},
		{"rate as a string", "[vendors.acme]\nbase_url = \"https://x\"\nrate = \"100\"\n", []string{"c.toml:3:", "want a whole number"}},
		{"window without unit", "[vendors.acme]\nbase_url = \"https://x\"\nrate = 1\nwindow = 1\n", []string{"c.toml:4:", "vendors.acme.window", "duration string"}},
		{"bad window", "[vendors.acme]\nbase_url = \"https://x\"\nrate = 1\nwindow = \"1 sec\"\n", []string{"c.toml:4:", `"1 sec"`}},
		{"guard not shorter than window", "[vendors.acme]\nbase_url = \"https://x\"\nrate = 1\nwindow = \"10ms\"\nguard = \"10ms\"\n", []string{"c.toml:5:", "shorter than the window"}},
		{"missing base_url", "[vendors.acme]\nrate = 1\n", []string{"c.toml:1:", "base_url is required"}},
		{"relative base_url", "[vendors.acme]\nbase_url = \"api.acme.example\"\nrate = 1\n", []string{"c.toml:2:", "absolute http:// or https://"}},
		{"typo in a key", "[vendors.acme]\nbase_url = \"https://x\"\nrat = 1\n", []string{"c.toml:3:", "vendors.acme.rat", `did you mean "rate"`}},
		{"unknown table", "[vendor.acme]\nrate = 1\n", []string{"c.toml:1:", "vendor", `did you mean "vendors"`}},
		{"negative queue_limit", "[vendors.acme]\nbase_url = \"https://x\"\nrate = 1\nqueue_limit = -1\n", []string{"c.toml:4:", "at least 0"}},
		{"bad redis addr", "[redis]\naddr = \"localhost\"\n", []string{"c.toml:2:", "redis.addr", "host:port"}},
		{"bad limits", "[vendors.acme]\nbase_url = \"https://x\"\nrate = 1\nlimits = [{ rate = 5 }]\n", []string{"c.toml:4:", "item 1", "window"}},
		{"worker max_wait zero", "[worker]\nmax_wait = \"0s\"\n", []string{"c.toml:2:", "worker.max_wait", "must be positive"}},
		{"worker max_retry zero", "[worker]\nmax_retry = 0\n", []string{"c.toml:2:", "worker.max_retry", "at least 1"}},
		{"worker unknown key", "[worker]\nmax_wiat = \"1s\"\n", []string{"c.toml:2:", `did you mean "max_wait"`}},
		{"warmup negative", "[vendors.acme]\nbase_url = \"https://x\"\nrate = 100\nwarmup = \"-1s\"\n", []string{"c.toml:4:", "vendors.acme.warmup", "must not be negative"}},
		{"warmup_from without warmup", "[vendors.acme]\nbase_url = \"https://x\"\nrate = 100\nwarmup_from = 10\n", []string{"c.toml:4:", "vendors.acme.warmup_from", "warmup is not"}},
		{"warmup_from above rate", "[vendors.acme]\nbase_url = \"https://x\"\nrate = 100\nwarmup = \"30s\"\nwarmup_from = 150\n", []string{"c.toml:5:", "vendors.acme.warmup_from", "at most rate (100)"}},
		{"warmup_from a string", "[vendors.acme]\nbase_url = \"https://x\"\nrate = 100\nwarmup = \"30s\"\nwarmup_from = \"ten\"\n", []string{"c.toml:5:", "vendors.acme.warmup_from", "want a number"}},
		{"adapt_quiet zero", "[vendors.acme]\nbase_url = \"https://x\"\nrate = 1\nadapt_quiet = \"0s\"\n", []string{"c.toml:4:", "vendors.acme.adapt_quiet", "must be positive"}},
		{"vendor timeout zero", "[vendors.acme]\nbase_url = \"https://x\"\nrate = 1\ntimeout = \"0s\"\n", []string{"c.toml:4:", "vendors.acme.timeout"}},
		{"TOML syntax", "[vendors.acme]\nrate = = 1\n", []string{"c.toml:2:", "TOML syntax"}},
		{"two errors at once", "[vendors.a]\nbase_url = \"https://x\"\nrate = 0\n[vendors.b]\nbase_url = \"https://x\"\nrate = 1\nburst = 2\n",
			[]string{"c.toml:3:", "c.toml:7:"}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			_, err := Parse("c.toml", []byte(tt.toml))
			if err == nil {
				t.Fatal("accepted")
			}
			if !errors.Is(err, ErrInvalid) {
				t.Errorf("error does not wrap ErrInvalid: %v", err)
			}
			for _, w := range tt.want {
				if !strings.Contains(err.Error(), w) {
					t.Errorf("error %q\ndoes not contain %q", err, w)
				}
			}
		})
	}
}

// TestErrorsKeepTheirCause checks that wrapped errors keep their chain:
// a caller can reach the TOML decoder's or the URL parser's error.
func TestErrorsKeepTheirCause(t *testing.T) {
	_, err := Parse("c.toml", []byte("[vendors.acme]\nrate = = 1\n"))
	var de *toml.DecodeError
	if !errors.Is(err, ErrInvalid) || !errors.As(err, &de) {
		t.Errorf("TOML syntax error %v: want ErrInvalid and a *toml.DecodeError in its chain", err)
	}
	_, err = Parse("c.toml", []byte("[redis]\naddr = \"redis://[::1\"\n"))
	var ue *url.Error
	if !errors.Is(err, ErrInvalid) || !errors.As(err, &ue) || !strings.Contains(err.Error(), "c.toml:2:") {
		t.Errorf("bad redis URL %v: want ErrInvalid, its line and a *url.Error in its chain", err)
	}
}

func TestLoadMissingFile(t *testing.T) {
	_, err := Load("/nonexistent/shaper.toml")
	if err == nil || !errors.Is(err, os.ErrNotExist) {
		t.Errorf("err = %v, want not-exist", err)
	}
}

// FuzzParse checks that no input makes Parse panic, and that what it
// accepts is a config the gate can enforce.
func FuzzParse(f *testing.F) {
	data, err := os.ReadFile("../config.toml")
	if err != nil {
		f.Fatal(err)
	}
	f.Add(data)
	f.Add([]byte("[vendors.a]\nbase_url = \"https://x\"\nrate = 3\nburst = 3\nlimits = [{ rate = 3, window = \"1m\" }]\n"))
	f.Add([]byte("[vendors.\"a.b\"]\nrate = 1\n"))
	f.Add([]byte(perAccountConfig))
	f.Add([]byte("[vendors.s]\nbase_url = \"https://{account}.s.example/{account}\"\nper_account = true\nrate = 4\nburst = 2\n" +
		"[[vendors.s.account_overrides]]\naccount = \"a-1\"\nburst = 4\nlimits = [{ rate = 8, window = \"2s\" }]\n" +
		"[vendors.s.total]\nrate = 3\n"))
	f.Fuzz(func(t *testing.T, data []byte) {
		cfg, err := Parse("fuzz.toml", data)
		if err != nil {
			return
		}
		for _, v := range cfg.Vendors {
			if err := v.Policy().Validate(); err != nil {
				t.Errorf("accepted vendor %s with an invalid policy: %v", v.Name, err)
			}
			if !v.PerAccount && (strings.Contains(v.BaseURL, "{account}") || v.Overrides != nil || v.Total != nil) {
				t.Errorf("accepted vendor %s with per-account keys but no per_account: %+v", v.Name, v)
			}
			qv := v.Queue()
			for account, p := range qv.Overrides {
				if err := queue.CheckAccount(account); err != nil {
					t.Errorf("accepted vendor %s with an invalid account: %v", v.Name, err)
				}
				if err := p.Validate(); err != nil {
					t.Errorf("accepted vendor %s with an invalid policy for account %s: %v", v.Name, account, err)
				}
			}
			if qv.Total != nil {
				if err := qv.Total.Validate(); err != nil {
					t.Errorf("accepted vendor %s with an invalid total: %v", v.Name, err)
				}
			}
		}
	})
}

func TestVendorHeadersFromEnvironment(t *testing.T) {
	cfg, err := Parse("c.toml", []byte(`[vendors.acme]
base_url = "https://x"
rate = 1
headers = { Authorization = "Bearer ${SHAPER_TEST_TOKEN}", X-Api-Version = "2" }
user_agent = "orders-sync/1.0"
max_retry_after = "10m"
adapt_decrease = 0.5
adapt_quiet = "30s"
strict_spacing = true
`))
	if err != nil {
		t.Fatal(err)
	}
	v := cfg.Vendors[0]
	if v.UserAgent != "orders-sync/1.0" || v.MaxRetryAfter != 10*time.Minute || v.Adapt.Decrease != 0.5 || v.Adapt.Quiet != 30*time.Second || v.Adapt.Increase != 0 {
		t.Errorf("vendor = %+v", v)
	}
	if p := v.Policy(); !p.MeasureGuard || p.Guard != 0 || p.NoGuard {
		t.Errorf("no guard key: policy guard %s, measured %v, none %v; want the default, measured", p.Guard, p.MeasureGuard, p.NoGuard)
	}
	m, err := Parse("c.toml", []byte("[vendors.acme]\nbase_url = \"https://x\"\nrate = 1\nguard = \"measured\"\n"))
	if err != nil || !m.Vendors[0].Policy().MeasureGuard {
		t.Errorf("guard = \"measured\": %v", err)
	}
	f, err := Parse("c.toml", []byte("[vendors.acme]\nbase_url = \"https://x\"\nrate = 1\nguard = \"20ms\"\n"))
	if p := f.Vendors[0].Policy(); err != nil || p.MeasureGuard || p.Guard != 20*time.Millisecond {
		t.Errorf("guard = \"20ms\": policy guard %s, measured %v (%v); want 20ms, fixed", p.Guard, p.MeasureGuard, err)
	}
	if !v.StrictSpacing || !v.Policy().StrictSpacing {
		t.Errorf("strict_spacing = true: vendor %v, policy %v", v.StrictSpacing, v.Policy().StrictSpacing)
	}
	if _, err := Parse("c.toml", []byte("[vendors.acme]\nbase_url = \"https://x\"\nrate = 1\nstrict_spacing = \"yes\"\n")); err == nil || !strings.Contains(err.Error(), "strict_spacing") {
		t.Errorf("strict_spacing = \"yes\": %v", err)
	}
	if _, err := v.ExpandHeaders(); err == nil || !strings.Contains(err.Error(), "SHAPER_TEST_TOKEN not set") {
		t.Errorf("missing variable: %v", err)
	}
	t.Setenv("SHAPER_TEST_TOKEN", "s3cret")
	h, err := v.ExpandHeaders()
	if err != nil || h["Authorization"] != "Bearer s3cret" || h["X-Api-Version"] != "2" {
		t.Errorf("headers = %v, %v", h, err)
	}
	if _, err := Parse("c.toml", []byte("[vendors.acme]\nbase_url = \"https://x\"\nrate = 1\nadapt_decrease = 1.5\n")); err == nil || !strings.Contains(err.Error(), "between 0 and 1") {
		t.Errorf("adapt_decrease 1.5: %v", err)
	}
	if _, err := Parse("c.toml", []byte("[vendors.acme]\nbase_url = \"https://x\"\nrate = 1\nheaders = { Idempotency-Key = \"x\" }\n")); err == nil {
		t.Error("an Idempotency-Key header was accepted")
	}
}

func TestWarmupKeys(t *testing.T) {
	cfg, err := Parse("c.toml", []byte("[vendors.acme]\nbase_url = \"https://x\"\nrate = 100\nwarmup = \"30s\"\nwarmup_from = 12.5\n"))
	if err != nil {
		t.Fatal(err)
	}
	p := cfg.Vendors[0].Policy()
	if p.Warmup != 30*time.Second || p.WarmupFrom != 12.5 {
		t.Errorf("policy warmup %s from %v, want 30s from 12.5", p.Warmup, p.WarmupFrom)
	}
	cfg, err = Parse("c.toml", []byte("[vendors.acme]\nbase_url = \"https://x\"\nrate = 100\n"))
	if err != nil {
		t.Fatal(err)
	}
	if p := cfg.Vendors[0].Policy(); p.Warmup != 0 {
		t.Errorf("no warmup key: warmup %s", p.Warmup)
	}
}

// TestLimitsQuotaOrSpread: a longer limit is a quota unless spread = true;
// a spread that is not a boolean is refused with its line.
func TestLimitsQuotaOrSpread(t *testing.T) {
	path := t.TempDir() + "/c.toml"
	text := `[vendors.crm]
base_url = "https://crm.example"
rate = 10
limits = [ { rate = 5000, window = "24h" }, { rate = 300, window = "1m", spread = true } ]
`
	if err := os.WriteFile(path, []byte(text), 0o600); err != nil {
		t.Fatal(err)
	}
	cfg, err := Load(path)
	if err != nil {
		t.Fatal(err)
	}
	crm, _ := cfg.Vendor("crm")
	p := crm.Policy()
	if !p.Quota(1) || p.Quota(2) || !p.Limits[2].Spread {
		t.Errorf("limits %+v: want the day a quota and the minute spread", p.Limits)
	}
	// The tick keeps the spaced limits: 1.02 s / 10 = 102 ms for the
	// second, 60.02 s / 300 = 200.067 ms for the spread minute; the day's
	// quota does not space.
	if iv, _ := p.Tick(); iv != 200067*time.Microsecond {
		t.Errorf("tick %v: want the spread minute's 200.067ms", iv)
	}
	bad := strings.Replace(text, "spread = true", `spread = "yes"`, 1)
	if err := os.WriteFile(path, []byte(bad), 0o600); err != nil {
		t.Fatal(err)
	}
	_, err = Load(path)
	if err == nil || !strings.Contains(err.Error(), "c.toml:4") || !strings.Contains(err.Error(), "limits item 2") || !strings.Contains(err.Error(), "spread") {
		t.Errorf("spread = \"yes\": %v", err)
	}
}

// TestTotalLimits: a per-account vendor's total takes limits too; a
// daily one is a quota of all accounts together.
func TestTotalLimits(t *testing.T) {
	path := t.TempDir() + "/c.toml"
	text := `[vendors.shop]
base_url = "https://{account}.shop.example"
per_account = true
rate = 2

[vendors.shop.total]
rate = 40
limits = [ { rate = 250000, window = "24h" } ]
`
	if err := os.WriteFile(path, []byte(text), 0o600); err != nil {
		t.Fatal(err)
	}
	cfg, err := Load(path)
	if err != nil {
		t.Fatal(err)
	}
	shop, _ := cfg.Vendor("shop")
	tp := shop.TotalPolicy()
	if tp == nil || len(tp.Limits) != 2 || !tp.Quota(1) || tp.Limits[1].Rate != 250000 {
		t.Fatalf("total policy %+v: want 40 per 1s and a daily quota of 250000", tp)
	}
	bad := strings.Replace(text, `window = "24h"`, `window = "a day"`, 1)
	if err := os.WriteFile(path, []byte(bad), 0o600); err != nil {
		t.Fatal(err)
	}
	if _, err := Load(path); err == nil || !strings.Contains(err.Error(), "c.toml:8") || !strings.Contains(err.Error(), "total.limits item 1") {
		t.Errorf("a bad total limit: %v", err)
	}
}
