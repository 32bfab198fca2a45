package config

import (
	"errors"
	"reflect"
	"strings"
	"testing"
	"time"

	"github.com/shaper-dev/shaper/queue"
	"github.com/shaper-dev/shaper/shaper"
	"github.com/shaper-dev/shaper/vendorclients"
)

// perAccountConfig has a per-account vendor with both forms of
// account_overrides (inline and [[...]]) and of the total (a table and
// an inline table), and a vendor named total, which is a vendor like any
// other.
const perAccountConfig = `[vendors.shop]
base_url = "https://api.shop.example/stores/{account}"
per_account = true
rate = 2
burst = 2
guard = "10ms"
max_in_flight = 3
limits = [ { rate = 100, window = "1m" } ]
adapt_decrease = 0.5
queue_limit = 500
account_overrides = [
  { account = "big-store", rate = 20 },   # keeps burst, guard, limits and max_in_flight
  { account = "slow", window = "1m", burst = 1, guard = "0s", limits = [], max_in_flight = 1 },
]

[vendors.shop.total]
rate = 40

[vendors.portal]
base_url = "https://{account}.portal.example/api/v2"
per_account = true
rate = 5
total = { rate = 3, window = "2s" }   # below one account's rate: it binds

[[vendors.portal.account_overrides]]
account = "eu-1"
rate = 50
window = "10s"

[vendors.total]
base_url = "https://total.example"
rate = 1
`

func TestPerAccountVendor(t *testing.T) {
	cfg, err := Parse("c.toml", []byte(perAccountConfig))
	if err != nil {
		t.Fatal(err)
	}
	if got := strings.Join(cfg.VendorNames(), ","); got != "portal,shop,total" {
		t.Fatalf("vendors = %s: [vendors.shop.total] must not be a vendor", got)
	}
	shop, _ := cfg.Vendor("shop")
	adapt := shaper.Adapt{Decrease: 0.5}
	want := queue.Vendor{
		Endpoint: vendorclients.Endpoint{Name: "shop", BaseURL: "https://api.shop.example/stores/{account}",
			Timeout: vendorclients.DefaultTimeout, MaxRetryAfter: vendorclients.DefaultMaxRetryAfter},
		Policy: shaper.Policy{Limits: []shaper.Limit{{Rate: 2, Window: time.Second}, {Rate: 100, Window: time.Minute}},
			Burst: 2, Guard: 10 * time.Millisecond, MaxInFlight: 3, Adapt: adapt},
		PerAccount: true,
		Overrides: map[string]shaper.Policy{
			"big-store": {Limits: []shaper.Limit{{Rate: 20, Window: time.Second}, {Rate: 100, Window: time.Minute}},
				Burst: 2, Guard: 10 * time.Millisecond, MaxInFlight: 3, Adapt: adapt},
			"slow": {Limits: []shaper.Limit{{Rate: 2, Window: time.Minute}}, Burst: 1, NoGuard: true, MaxInFlight: 1, Adapt: adapt},
		},
		Total:      &shaper.Policy{Limits: []shaper.Limit{{Rate: 40, Window: time.Second}}, Guard: 10 * time.Millisecond},
		QueueLimit: 500,
	}
	if got := shop.Queue(); !reflect.DeepEqual(got, want) {
		t.Errorf("shop.Queue() =\n%+v\nwant\n%+v", got, want)
	}
	if got := shop.AccountPolicy("slow"); !reflect.DeepEqual(got, want.Overrides["slow"]) {
		t.Errorf("AccountPolicy(slow) = %+v", got)
	}
	if got := shop.AccountPolicy("store-42"); !reflect.DeepEqual(got, want.Policy) {
		t.Errorf("AccountPolicy of an account without override = %+v, want the vendor's", got)
	}
	if len(shop.Overrides) != 2 || shop.Overrides[0].Account != "big-store" || shop.Overrides[1].Account != "slow" {
		t.Errorf("overrides = %+v, want file order", shop.Overrides)
	}

	portal, _ := cfg.Vendor("portal")
	qv := portal.Queue()
	if !qv.PerAccount || qv.Total == nil || !reflect.DeepEqual(qv.Total.Limits, []shaper.Limit{{Rate: 3, Window: 2 * time.Second}}) ||
		qv.Total.Guard != shaper.DefaultGuard {
		t.Errorf("portal = %+v, total %+v", qv, qv.Total)
	}
	if p, ok := qv.Overrides["eu-1"]; !ok || !reflect.DeepEqual(p.Limits, []shaper.Limit{{Rate: 50, Window: 10 * time.Second}}) {
		t.Errorf("portal overrides = %+v", qv.Overrides)
	}
	for _, p := range append([]shaper.Policy{qv.Policy, *qv.Total}, qv.Overrides["eu-1"]) {
		if err := p.Validate(); err != nil {
			t.Errorf("policy %+v: %v", p, err)
		}
	}
}

// TestWithoutPerAccount checks that a vendor without per_account builds
// the queue.Vendor it always did.
func TestWithoutPerAccount(t *testing.T) {
	cfg, err := Parse("c.toml", []byte("[vendors.acme]\nbase_url = \"https://api.acme.example\"\nrate = 100\nmax_in_flight = 4\nper_account = false\n"))
	if err != nil {
		t.Fatal(err)
	}
	acme := cfg.Vendors[0]
	want := queue.Vendor{
		Endpoint: vendorclients.Endpoint{Name: "acme", BaseURL: "https://api.acme.example",
			Timeout: vendorclients.DefaultTimeout, MaxRetryAfter: vendorclients.DefaultMaxRetryAfter},
		Policy:     shaper.Policy{Limits: []shaper.Limit{{Rate: 100, Window: time.Second}}, Burst: 1, MeasureGuard: true, MaxInFlight: 4},
		QueueLimit: DefaultQueueLimit,
	}
	if got := acme.Queue(); !reflect.DeepEqual(got, want) {
		t.Errorf("acme.Queue() =\n%+v\nwant\n%+v", got, want)
	}
	if acme.TotalPolicy() != nil || !reflect.DeepEqual(acme.AccountPolicy("x"), acme.Policy()) {
		t.Errorf("a vendor without per_account has a total or account policies")
	}
}

func TestBaseURLAccount(t *testing.T) {
	tests := []struct {
		url  string
		want string // "" for accepted
	}{
		{"https://{account}.api.example", ""},
		{"https://{account}.api.example:8443/v1", ""},
		{"http://api.example/stores/{account}", ""},
		{"https://api.example/store-{account}/orders", ""},
		{"https://{account}.api.example/{account}", ""},
		{"{account}://api.example", "{account} in the scheme"},
		{"https://{account}@api.example", "{account} in the user info"},
		{"https://api.example:{account}/", "{account} in the port"},
		{"https://api.example/?store={account}", "{account} in the query"},
		{"https://api.example/#{account}", "{account} in the fragment"},
		{"https://store-{account}.api.example", `host label "store-{account}" (it must be the whole label)`},
		{"https://api.{account}", "last label of the host"},
		{"https://{account}", "last label of the host"},
		{"https://[{account}]/", "it must be the whole label"},
		{"https://api.example/{acount}", "{acount} is not a placeholder shaper knows"},
		{"https://api.example/{}", "{} is not a placeholder"},
		{"api.example/{account}", "absolute http:// or https:// URL once {account} is replaced"},
		{"https://{account}_x.api.example/", "it must be the whole label"},
		{"https://api.example/a/../stores/{account}", `a "." or ".." segment in the path`},
		{"https://api.example/stores/{account}/./api", `a "." or ".." segment in the path`},
		{"https://{account}.api.example/v1/../v2", `a "." or ".." segment in the path`},
	}
	for _, tt := range tests {
		t.Run(tt.url, func(t *testing.T) {
			err := checkBaseURL(tt.url, true)
			if tt.want == "" {
				if err != nil {
					t.Errorf("rejected: %v", err)
				}
				return
			}
			if err == nil || !strings.Contains(err.Error(), tt.want) {
				t.Errorf("err = %v, want %q", err, tt.want)
			}
		})
	}
	if err := checkBaseURL("https://{account}.api.example", false); err == nil || !strings.Contains(err.Error(), "per_account = true") {
		t.Errorf("{account} without per_account: %v", err)
	}
	if err := checkBaseURL("https://api.example/v1", false); err != nil {
		t.Errorf("a plain base_url: %v", err)
	}
}

// TestOverrideAccountNames checks override names against the one rule,
// queue.CheckAccount, and the host-label rule when {account} is in the
// host.
func TestOverrideAccountNames(t *testing.T) {
	long := strings.Repeat("a", queue.MaxAccountLen)
	good := []string{"a", "store-42", "Big.Store_1", "user@example.com", "org:team+x=y", long}
	bad := []string{"", "a b", "a/b", "a{b}", "a|b", "ü", "tab\t", long + "a", ".", "..", "...", "a%2Fb"}
	cfgOf := func(baseURL, account string) string {
		return "[vendors.shop]\nbase_url = \"" + baseURL + "\"\nper_account = true\nrate = 2\naccount_overrides = [ { account = \"" + account + "\", rate = 3 } ]\n"
	}
	for _, a := range good {
		if _, err := Parse("c.toml", []byte(cfgOf("https://api.example/{account}", a))); err != nil {
			t.Errorf("account %q rejected: %v", a, err)
		}
		if err := queue.CheckAccount(a); err != nil {
			t.Errorf("queue.CheckAccount(%q) = %v", a, err)
		}
	}
	for _, a := range bad {
		_, err := Parse("c.toml", []byte(cfgOf("https://api.example/{account}", strings.ReplaceAll(a, "\t", `\t`))))
		if err == nil || !errors.Is(err, queue.ErrBadAccount) || !strings.Contains(err.Error(), "c.toml:5: invalid config: vendors.shop.account_overrides item 1") {
			t.Errorf("account %q: err = %v, want queue.ErrBadAccount at the item's line", a, err)
		}
	}
	// In the host, a name must be a DNS label of a-z, 0-9 and '-'.
	for _, a := range []string{"Big", "a.b", "a_b", strings.Repeat("a", 64)} {
		_, err := Parse("c.toml", []byte(cfgOf("https://{account}.api.example", a)))
		if err == nil || !strings.Contains(err.Error(), "cannot stand in base_url's host name") {
			t.Errorf("account %q in the host: err = %v", a, err)
		}
	}
	if _, err := Parse("c.toml", []byte(cfgOf("https://{account}.api.example", "eu-1"))); err != nil {
		t.Errorf("a host-label account: %v", err)
	}
}

func TestInvalidPerAccountConfigs(t *testing.T) {
	const head = "[vendors.shop]\nbase_url = \"https://x/{account}\"\nper_account = true\nrate = 2\n" // lines 1-4
	tests := []struct {
		name string
		toml string
		want []string // substrings of the error, in any order
	}{
		{"overrides without per_account", "[vendors.shop]\nbase_url = \"https://x\"\nrate = 2\naccount_overrides = [ { account = \"a\", rate = 3 } ]\n",
			[]string{"c.toml:4: invalid config: vendors.shop.account_overrides: needs per_account = true", "add per_account = true"}},
		{"total without per_account", "[vendors.shop]\nbase_url = \"https://x\"\nrate = 2\nper_account = false\n\n[vendors.shop.total]\nrate = 40\n",
			[]string{"c.toml:6: invalid config: vendors.shop.total: needs per_account = true in [vendors.shop]"}},
		{"{account} without per_account", "[vendors.shop]\nbase_url = \"https://{account}.x.example\"\nrate = 2\n",
			[]string{"c.toml:2: invalid config: vendors.shop.base_url", `"https://{account}.x.example"`, "only a per_account vendor's calls name one"}},
		{"{account} in the query", "[vendors.shop]\nbase_url = \"https://x/?a={account}\"\nper_account = true\nrate = 2\n",
			[]string{"c.toml:2: invalid config: vendors.shop.base_url", "{account} in the query"}},
		{"per_account not a bool", "[vendors.shop]\nbase_url = \"https://x\"\nrate = 2\nper_account = \"yes\"\n",
			[]string{"c.toml:4: invalid config: vendors.shop.per_account", "want true or false"}},
		{"override typo", head + "account_overrides = [ { account = \"a\", rat = 3 } ]\n",
			[]string{`c.toml:5: invalid config: vendors.shop.account_overrides item 1 (account "a"): unknown key "rat"; did you mean "rate"?`}},
		{"override without account", head + "account_overrides = [\n  { account = \"a\", rate = 3 },\n  { rate = 4 },\n]\n",
			[]string{"c.toml:7: invalid config: vendors.shop.account_overrides item 2: account is required"}},
		{"override account not a string", head + "account_overrides = [ { account = 42 } ]\n",
			[]string{"c.toml:5:", "item 1: account = 42: want a quoted string"}},
		{"duplicate account", head + "account_overrides = [\n  { account = \"a\", rate = 3 },\n  { account = \"b\", rate = 3 },\n  { account = \"a\", rate = 4 },\n]\n",
			[]string{`c.toml:8: invalid config: vendors.shop.account_overrides item 3 (account "a"): account "a" is already overridden by item 1; merge the two items`}},
		{"override burst above its rate", head + "account_overrides = [ { account = \"a\", rate = 3, burst = 5 } ]\n",
			[]string{`c.toml:5: invalid config: vendors.shop.account_overrides item 1 (account "a")`, "burst 5 > rate 3 per 1s", "use burst <= 3"}},
		{"override inherits a burst above its rate", "[vendors.shop]\nbase_url = \"https://x\"\nper_account = true\nrate = 10\nburst = 5\naccount_overrides = [ { account = \"a\", rate = 2 } ]\n",
			[]string{`c.toml:6: invalid config: vendors.shop.account_overrides item 1 (account "a")`, "burst 5 > rate 2", "keeps the vendor's values"}},
		{"override window not above the guard", head + "account_overrides = [ { account = \"a\", window = \"10ms\" } ]\n",
			[]string{"c.toml:5:", "item 1", "guard 20ms must be shorter than the window 10ms"}},
		{"override window zero", head + "account_overrides = [ { account = \"a\", window = \"0s\" } ]\n",
			[]string{"c.toml:5:", "item 1", "window = 0s: a window must be positive"}},
		{"override window without unit", head + "account_overrides = [ { account = \"a\", window = 5 } ]\n",
			[]string{"c.toml:5:", "window = 5: want a duration string"}},
		{"override rate as a string", head + "account_overrides = [ { account = \"a\", rate = \"20\" } ]\n",
			[]string{"c.toml:5:", `rate = "20": want a whole number`}},
		{"override rate zero", head + "account_overrides = [ { account = \"a\", rate = 0 } ]\n",
			[]string{"c.toml:5:", "rate = 0: must be at least 1"}},
		{"override negative guard", head + "account_overrides = [ { account = \"a\", guard = \"-1ms\" } ]\n",
			[]string{"c.toml:5:", "guard = -1ms must not be negative"}},
		{"override negative max_in_flight", head + "account_overrides = [ { account = \"a\", max_in_flight = -1 } ]\n",
			[]string{"c.toml:5:", "max_in_flight = -1: must be at least 0"}},
		{"override bad limits", head + "account_overrides = [ { account = \"a\", limits = [ { rate = 5 } ] } ]\n",
			[]string{"c.toml:5:", `item 1 (account "a"): limits item 1: window = (missing)`}},
		{"override limit above the burst", head + "burst = 2\naccount_overrides = [ { account = \"a\", limits = [ { rate = 1, window = \"1m\" } ] } ]\n",
			[]string{"c.toml:6:", `item 1 (account "a")`, "burst 2 > rate 1 per 1m"}},
		{"overrides not an array", head + "account_overrides = { account = \"a\" }\n",
			[]string{"c.toml:5: invalid config: vendors.shop.account_overrides: must be an array of tables"}},
		{"override not a table", head + "account_overrides = [ \"a\" ]\n",
			[]string{"c.toml:5:", "item 1: must be a table"}},
		{"array-of-tables item", head + "\n[[vendors.shop.account_overrides]]\naccount = \"a\"\n\n[[vendors.shop.account_overrides]]\naccount = \"b\"\nburts = 1\n",
			[]string{`c.toml:9: invalid config: vendors.shop.account_overrides item 2 (account "b"): unknown key "burts"; did you mean "burst"?`}},
		{"total without rate", head + "\n[vendors.shop.total]\nwindow = \"1s\"\n",
			[]string{"c.toml:6: invalid config: vendors.shop.total: rate is required"}},
		{"total rate zero", head + "\n[vendors.shop.total]\nrate = 0\n",
			[]string{"c.toml:7: invalid config: vendors.shop.total.rate: 0: must be at least 1"}},
		{"total window zero", head + "\n[vendors.shop.total]\nrate = 10\nwindow = \"0s\"\n",
			[]string{"c.toml:8: invalid config: vendors.shop.total.window: 0s: a window must be positive"}},
		{"total window negative", head + "\n[vendors.shop.total]\nrate = 10\nwindow = \"-1s\"\n",
			[]string{"c.toml:8:", "vendors.shop.total.window: -1s"}},
		{"total window not above the guard", head + "\n[vendors.shop.total]\nrate = 10\nwindow = \"20ms\"\n",
			[]string{"c.toml:8: invalid config: vendors.shop.total.window", "guard 20ms must be shorter than the window 20ms", "lengthen the window or lower the guard"}},
		{"total typo", head + "\n[vendors.shop.total]\nrate = 10\nwindw = \"1s\"\n",
			[]string{`c.toml:8: invalid config: vendors.shop.total.windw: unknown key; did you mean "window"?`}},
		{"total not a table", head + "total = 40\n",
			[]string{"c.toml:5: invalid config: vendors.shop.total: must be a table: [vendors.shop.total] with rate and window"}},
		{"inline total", head + "total = { rate = 0 }\n",
			[]string{"c.toml:5: invalid config: vendors.shop.total.rate: 0: must be at least 1"}},
		{"quoted total header", head + "\n[vendors.\"shop\" . total]\nrate = 1\nburst = 1\n",
			[]string{"c.toml:8: invalid config: vendors.shop.total.burst: unknown key"}},
		{"all at once", "[vendors.shop]\nbase_url = \"https://x:{account}\"\nper_account = true\nrate = 0\n" +
			"account_overrides = [ { account = \"a b\" } ]\n\n[vendors.shop.total]\nrate = -1\n",
			[]string{"c.toml:2:", "{account} in the port", "c.toml:4:", "vendors.shop.rate", "c.toml:5:", `account "a b"`, "c.toml:8:", "vendors.shop.total.rate"}},
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

func TestLocateItem(t *testing.T) {
	text := `[vendors.shop]
rate = 1
account_overrides = [ { account = "a" },   # { not an item }
  { account = "}{", limits = [ { rate = 1, window = "1s" } ] },
  { account = 'x' }, { account = "y" }
]
limits = [ { rate = 1, window = "1s" } ]

[vendors."shop".total]
rate = 1
`
	for _, tt := range []struct {
		table, key string
		n, want    int
	}{
		{"vendors.shop", "account_overrides", 1, 3},
		{"vendors.shop", "account_overrides", 2, 4},
		{"vendors.shop", "account_overrides", 3, 5},
		{"vendors.shop", "account_overrides", 4, 5},
		{"vendors.shop", "account_overrides", 9, 3},
		{"vendors.shop", "limits", 1, 7},
		{"vendors.other", "limits", 1, 0},
	} {
		if got := locateItem(text, tt.table, tt.key, tt.n); got != tt.want {
			t.Errorf("locateItem(%s, %s, %d) = %d, want %d", tt.table, tt.key, tt.n, got, tt.want)
		}
	}
	if got := locate(text, "vendors.shop.total", "rate"); got != 10 {
		t.Errorf("locate(vendors.shop.total, rate) = %d, want 10", got)
	}
	if got := locate(text, `vendors."shop".total`, ""); got != 9 {
		t.Errorf("locate of a quoted table = %d, want 9", got)
	}
	text2 := "[vendors.shop]\nrate = 1\n[[vendors.shop.account_overrides]]\naccount = \"a\"\n[[vendors.shop.account_overrides]]\naccount = \"b\"\n"
	if got := locateItem(text2, "vendors.shop", "account_overrides", 2); got != 5 {
		t.Errorf("second [[...]] item at line %d, want 5", got)
	}
}
