package vendorclients

import (
	"fmt"
	"net/url"
	"regexp"
	"strings"
)

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
		return fmt.Errorf("vendorclients: %w: %q: %w", ErrBadPath, p, err)
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

// AccountRef is the placeholder of a call's account in a base_url.
const AccountRef = "{account}"

// hostAccount is what an account must be to stand in a host name: one DNS
// label of lower-case letters, digits and '-'.
var hostAccount = regexp.MustCompile(`^[a-z0-9-]{1,63}$`)

// AccountBaseURL returns base with {account} replaced by account:
// path-escaped in the path, and in the host only when account is a DNS
// label (1-63 of a-z 0-9 -). A base without {account} is returned as is.
// The result must stay under base: its path has no "." or ".." segment
// (an account such as ".." would otherwise turn /stores/{account}/api
// into /stores/../api) and, cleaned, still starts with base's path up to
// {account}; an account that breaks either is an error wrapping
// ErrBadPath, whatever checked it before.
func AccountBaseURL(base, account string) (string, error) {
	if !strings.Contains(base, AccountRef) {
		return base, nil
	}
	if account == "" {
		return "", fmt.Errorf("vendorclients: base_url %s names {account} and the call names none", base)
	}
	scheme, rest, ok := strings.Cut(base, "://")
	if !ok {
		return "", fmt.Errorf("vendorclients: base_url %q is not an absolute URL", base)
	}
	host, path, _ := strings.Cut(rest, "/")
	if strings.Contains(host, AccountRef) {
		if !hostAccount.MatchString(account) {
			return "", fmt.Errorf("vendorclients: account %q cannot stand in the host of %s: it must be one DNS label, 1-63 of a-z 0-9 -", account, base)
		}
		host = strings.ReplaceAll(host, AccountRef, account)
	}
	out := scheme + "://" + host
	if path != "" || strings.HasSuffix(rest, "/") {
		resolved := strings.ReplaceAll(path, AccountRef, url.PathEscape(account))
		out += "/" + resolved
		if err := dotSegment(resolved); err != nil {
			return "", fmt.Errorf("vendorclients: %w: account %q in base_url %s: %w", ErrBadPath, account, base, err)
		}
	}
	return out, nil
}

// dotSegment reports a "." or ".." segment of the path p, also
// percent-encoded (a vendor that decodes before it resolves dot segments
// must not be led out either): a path without one stays under the
// base's, the account being escaped.
func dotSegment(p string) error {
	if d, err := url.PathUnescape(p); err == nil {
		p = d // decoded whole: "%2F" splits segments as the vendor may
	}
	for _, seg := range strings.Split(p, "/") {
		if seg == "." || seg == ".." {
			return fmt.Errorf("a %q segment leaves the account's path", seg)
		}
	}
	return nil
}
