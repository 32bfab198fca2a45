package vendorclients

import (
	"fmt"
	"net/url"
	pathpkg "path"
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
		out += "/" + strings.ReplaceAll(path, AccountRef, url.PathEscape(account))
		if err := underBase("/"+path, out); err != nil {
			return "", fmt.Errorf("vendorclients: %w: account %q in base_url %s: %w", ErrBadPath, account, base, err)
		}
	}
	return out, nil
}

// underBase reports why resolved, a base URL with {account} replaced in
// basePath (the base's path, {account} still in it), is not under the
// base: a "." or ".." segment, or a cleaned path that does not start with
// basePath's part before {account}.
func underBase(basePath, resolved string) error {
	u, err := url.Parse(resolved)
	if err != nil {
		return fmt.Errorf("it resolves to %q, not a URL: %w", resolved, err)
	}
	// Decoded: a vendor that decodes %2F before it resolves dot segments
	// must not be led out either.
	for _, seg := range strings.Split(u.Path, "/") {
		if seg == "." || seg == ".." {
			return fmt.Errorf("it resolves to %s, with a %q segment that leaves the account's path", u.Redacted(), seg)
		}
	}
	prefix, _, _ := strings.Cut(basePath, AccountRef)
	if clean := pathpkg.Clean(u.Path); !strings.HasPrefix(clean+"/", prefix) && !strings.HasPrefix(clean, prefix) {
		return fmt.Errorf("it resolves to %s, outside %s", u.Redacted(), prefix)
	}
	return nil
}
