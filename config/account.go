package config

// The per-account keys of a vendor: per_account, account_overrides, the
// [vendors.NAME.total] table, and {account} in base_url.

import (
	"errors"
	"fmt"
	"net/url"
	"regexp"
	"slices"
	"sort"
	"strings"
	"time"

	"github.com/shaper-dev/shaper/queue"
	"github.com/shaper-dev/shaper/shaper"
	"github.com/shaper-dev/shaper/vendorclients"
)

var (
	overrideKeys = []string{"account", "rate", "window", "burst", "guard", "limits", "max_in_flight"}
	totalKeys    = []string{"rate", "window", "limits"}
)

// accountRef is the placeholder of a call's account in base_url.
const accountRef = vendorclients.AccountRef

// sampleAccount stands in for {account} when base_url is checked.
const sampleAccount = "store-42"

// placeholder matches what looks like a placeholder in base_url.
var placeholder = regexp.MustCompile(`\{[^{}/]*\}`)

// accounts reads per-account tables of vendor table t into vd: the
// account_overrides items and the total. Their policies are checked
// only when vendorOK, the vendor's own policy being valid (they inherit
// its keys).
func (p *parser) accounts(t string, tbl map[string]any, vd *Vendor, vendorOK bool) {
	why := "only a per_account vendor's calls name an account; add per_account = true"
	if raw, present := tbl["account_overrides"]; present {
		if !vd.PerAccount {
			p.errorf(t, "account_overrides", "needs per_account = true: an override gives one account its own limits, and %s", why)
		}
		vd.Overrides = p.overrides(t, raw, *vd, vendorOK)
	}
	if raw, present := tbl["total"]; present {
		if !vd.PerAccount {
			p.errorf(t+".total", "", "needs per_account = true in [%s]: a total limits all of a vendor's accounts together, and %s (without it, rate is already the vendor's total)", t, why)
		}
		vd.Total, vd.TotalLimits = p.total(t, raw, *vd, vendorOK)
	}
}

// overrides reads the account_overrides items of vendor table t.
func (p *parser) overrides(t string, raw any, vd Vendor, vendorOK bool) []Override {
	list, ok := raw.([]any)
	if !ok {
		p.errorf(t, "account_overrides", "must be an array of tables, e.g. account_overrides = [ { account = \"big-store\", rate = 20 } ]")
		return nil
	}
	inHost := accountInHost(vd.BaseURL)
	seen := map[string]int{}
	var out []Override
	for i, item := range list {
		n := i + 1
		m, isTable := item.(map[string]any)
		account, _ := m["account"].(string)
		line := locateItem(p.text, t, "account_overrides", n)
		name := fmt.Sprintf("%s.account_overrides item %d", t, n)
		if account != "" {
			name += fmt.Sprintf(" (account %q)", account)
		}
		fail := func(format string, args ...any) { p.errorAt(line, name, format, args...) }
		if !isTable {
			fail("must be a table such as { account = \"big-store\", rate = 20 }")
			continue
		}
		before := len(p.errs)
		keys := make([]string, 0, len(m))
		for k := range m {
			keys = append(keys, k)
		}
		sort.Strings(keys)
		for _, k := range keys {
			if !slices.Contains(overrideKeys, k) {
				fail("unknown key %q; %s", k, knownKeyHint(k, overrideKeys))
			}
		}
		switch a := m["account"].(type) {
		case nil:
			fail("account is required: the account the item's keys apply to, e.g. { account = \"big-store\", rate = 20 }")
		case string:
			if err := queue.CheckAccount(a); err != nil {
				fail("%w", err)
			} else if _, err := vendorclients.AccountBaseURL(vd.BaseURL, a); inHost && err != nil {
				fail("account %q cannot stand in base_url's host name %q: there an account name is 1 to 63 of a-z, 0-9 and '-'; rename the account or move {account} to the path", a, vd.BaseURL)
			} else if first, dup := seen[a]; dup {
				fail("account %q is already overridden by item %d; merge the two items", a, first)
			} else {
				seen[a] = n
			}
		default:
			fail("account = %s: want a quoted string", rawString(a))
		}
		o := overrideOf(vd, account)
		if x, ok := m["rate"]; ok {
			o.Rate = rawInt(x, 1, "rate", fail)
		}
		if x, ok := m["window"]; ok {
			if o.Window, ok = rawDuration(x, "window", fail); ok && o.Window <= 0 {
				fail("window = %s: a window must be positive, e.g. window = \"1s\"", o.Window)
			}
		}
		if x, ok := m["burst"]; ok {
			o.Burst = rawInt(x, 1, "burst", fail)
		}
		if x, ok := m["guard"]; ok {
			o.GuardMeasured = false
			if s, isStr := x.(string); isStr && s == "measured" {
				o.Guard, o.GuardMeasured = shaper.DefaultGuard, true
			} else if o.Guard, ok = rawDuration(x, "guard", fail); ok && o.Guard < 0 {
				fail("guard = %s must not be negative; 0 turns the jitter margin off", o.Guard)
			}
		}
		if x, ok := m["max_in_flight"]; ok {
			o.MaxInFlight = rawInt(x, 0, "max_in_flight", fail)
		}
		if x, ok := m["limits"]; ok {
			o.Limits = limits(x, func(k int, format string, args ...any) {
				if k > 0 {
					fail("limits item %d: "+format, append([]any{k}, args...)...)
				} else {
					fail("limits "+format, args...)
				}
			})
		}
		if len(p.errs) > before {
			continue
		}
		if vendorOK {
			if err := o.apply(vd).Policy().Validate(); err != nil {
				fail("%w (an item keeps the vendor's values of the keys it does not set)", err)
				continue
			}
		}
		out = append(out, o)
	}
	return out
}

// total reads the [vendors.NAME.total] table of vendor table t.
func (p *parser) total(t string, raw any, vd Vendor, vendorOK bool) (*shaper.Limit, []shaper.Limit) {
	tt := t + ".total"
	m, ok := raw.(map[string]any)
	if !ok {
		p.errorf(t, "total", "must be a table: [%s] with rate and window", tt)
		return nil, nil
	}
	before := len(p.errs)
	p.unknownKeys(tt, m, totalKeys)
	var l shaper.Limit
	if _, present := m["rate"]; !present {
		p.errorf(tt, "", "rate is required: the calls all of the vendor's accounts together may start per window, e.g. rate = 40")
	} else {
		l.Rate, _ = p.integer(tt, "rate", 1, 0)
	}
	l.Window = p.duration(tt, "window", DefaultWindow)
	if l.Window <= 0 {
		p.errorf(tt, "window", "%s: a window must be positive, e.g. window = \"1s\"", l.Window)
	}
	more := limits(m["limits"], func(n int, format string, args ...any) {
		if n == 0 {
			p.errorf(tt, "limits", format, args...)
			return
		}
		p.errorAt(locateItem(p.text, tt, "limits", n), fmt.Sprintf("%s.limits item %d", tt, n), format, args...)
	})
	if len(p.errs) > before {
		return nil, nil
	}
	vd.Total, vd.TotalLimits = &l, more
	if err := vd.TotalPolicy().Validate(); vendorOK && err != nil {
		p.errorf(tt, "window", "%w: the total is shaped with the vendor's guard; lengthen the window or lower the guard", err)
		return nil, nil
	}
	return &l, more
}

// rawInt reads a whole number >= lo from the raw parse; problems go to
// fail, naming key.
func rawInt(x any, lo int, key string, fail func(string, ...any)) int {
	n, ok := x.(int64)
	if !ok {
		fail("%s = %s: want a whole number", key, rawString(x))
		return 0
	}
	if n < int64(lo) {
		fail("%s = %d: must be at least %d", key, n, lo)
		return 0
	}
	return int(n)
}

// rawDuration reads a duration string from the raw parse; problems go to
// fail, naming key, and ok is false.
func rawDuration(x any, key string, fail func(string, ...any)) (time.Duration, bool) {
	s, ok := x.(string)
	if !ok {
		fail("%s = %s: want a duration string such as \"1s\", \"250ms\" or \"1m\"", key, rawString(x))
		return 0, false
	}
	d, err := time.ParseDuration(s)
	if err != nil {
		fail("%s = %q: want a duration such as \"1s\", \"250ms\" or \"1m\"", key, s)
		return 0, false
	}
	return d, true
}

// checkBaseURL reports why raw cannot be a vendor's base_url. {account}
// is allowed only for a per-account vendor, and only where per-call
// substitution keeps every call under its account's base URL: a whole
// label of the host name left of the domain, or the path.
func checkBaseURL(raw string, perAccount bool) error {
	s := raw
	if strings.Contains(raw, accountRef) {
		if !perAccount {
			return errors.New("{account} is replaced by each call's account, and only a per_account vendor's calls name one: add per_account = true or remove {account}")
		}
		if err := checkAccountPlace(raw); err != nil {
			return err
		}
		if _, err := vendorclients.AccountBaseURL(raw, sampleAccount); errors.Is(err, vendorclients.ErrBadPath) {
			return fmt.Errorf("a \".\" or \"..\" segment in the path: every call's URL would leave the account's path; write the path without them")
		}
		s = strings.ReplaceAll(raw, accountRef, sampleAccount)
	}
	if ph := placeholder.FindString(s); ph != "" {
		return fmt.Errorf("%s is not a placeholder shaper knows: the only one is {account}", ph)
	}
	u, err := url.Parse(s)
	if err != nil || (u.Scheme != "http" && u.Scheme != "https") || u.Host == "" {
		if s != raw {
			return fmt.Errorf("want an absolute http:// or https:// URL once {account} is replaced (e.g. by %q)", sampleAccount)
		}
		return errors.New("want an absolute http:// or https:// URL")
	}
	if u.RawQuery != "" || u.Fragment != "" {
		return errors.New("a base URL has no query or fragment; put them in each call's path")
	}
	return nil
}

// checkAccountPlace reports a {account} of raw outside the host's
// subdomain labels and the path.
func checkAccountPlace(raw string) error {
	where := func(part string) error {
		return fmt.Errorf("{account} in the %s: it may only be a whole label of the host name left of the domain (https://{account}.api.example) or in the path (https://api.example/stores/{account})", part)
	}
	scheme, rest, ok := strings.Cut(raw, "://")
	if !ok {
		return nil // not an absolute URL: the parse says so
	}
	if strings.Contains(scheme, accountRef) {
		return where("scheme")
	}
	authority, tail := rest, ""
	if i := strings.IndexAny(rest, "/?#"); i >= 0 {
		authority, tail = rest[:i], rest[i:]
	}
	hostport := authority
	if i := strings.LastIndex(authority, "@"); i >= 0 {
		if strings.Contains(authority[:i], accountRef) {
			return where("user info")
		}
		hostport = authority[i+1:]
	}
	host := hostport
	if i := strings.LastIndex(hostport, ":"); i >= 0 && i > strings.LastIndex(hostport, "]") {
		if strings.Contains(hostport[i+1:], accountRef) {
			return where("port")
		}
		host = hostport[:i]
	}
	if strings.Contains(host, accountRef) {
		labels := strings.Split(host, ".")
		for i, l := range labels {
			if !strings.Contains(l, accountRef) {
				continue
			}
			if l != accountRef {
				return where(fmt.Sprintf("host label %q (it must be the whole label)", l))
			}
			if i == len(labels)-1 {
				return where("last label of the host")
			}
		}
	}
	if i := strings.IndexAny(tail, "?#"); i >= 0 && strings.Contains(tail[i:], accountRef) {
		part := "query"
		if j := strings.IndexByte(tail, '#'); j >= 0 && strings.Contains(tail[j:], accountRef) {
			part = "fragment"
		}
		return where(part)
	}
	return nil
}

// accountInHost reports whether base_url has {account} in its host name.
func accountInHost(raw string) bool {
	_, rest, ok := strings.Cut(raw, "://")
	if !ok {
		return false
	}
	if i := strings.IndexAny(rest, "/?#"); i >= 0 {
		rest = rest[:i]
	}
	return strings.Contains(rest, accountRef)
}
