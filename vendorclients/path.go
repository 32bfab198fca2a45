package vendorclients

import (
	"fmt"
	"net/url"
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
