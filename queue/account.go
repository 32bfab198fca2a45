package queue

import (
	"errors"
	"fmt"
	"strings"
)

// MaxAccountLen is the longest account name (all its characters are
// ASCII, so this is bytes too).
const MaxAccountLen = 128

// ErrBadAccount is wrapped by CheckAccount's errors.
var ErrBadAccount = errors.New("queue: invalid account name")

// CheckAccount reports whether name can name an account of a per-account
// vendor: 1 to MaxAccountLen characters from A-Z a-z 0-9 . _ @ : + = -,
// not only dots. The rule is the one place account names are checked, by the config
// (account_overrides) and at enqueue alike. It keeps names safe inside
// Redis keys and hash tags (no braces, no '|'), in log lines (no spaces
// or control characters) and in a URL path segment: no slashes,
// backslashes or '%', and never ".", ".." or any other name made only of
// dots, which a base_url such as https://v/stores/{account}/api would
// resolve to a path outside the account's (/stores/../api).
func CheckAccount(name string) error {
	if name == "" {
		return fmt.Errorf("%w: an account name is 1 to %d characters from A-Z a-z 0-9 . _ @ : + = -, not empty", ErrBadAccount, MaxAccountLen)
	}
	for _, r := range name {
		if r >= 0x80 || !accountByte(byte(r)) {
			return fmt.Errorf("%w: account %q: %q is not allowed; an account name is made of A-Z a-z 0-9 . _ @ : + = - (no spaces, braces, slashes or '|')",
				ErrBadAccount, name, r)
		}
	}
	if strings.Trim(name, ".") == "" {
		return fmt.Errorf("%w: account %q is only dots: in a URL path \".\" and \"..\" name the segment itself and its parent, so {account} in base_url would leave the account's path; an account name needs a character other than '.'",
			ErrBadAccount, name)
	}
	if len(name) > MaxAccountLen {
		return fmt.Errorf("%w: account %.20q... has %d characters; an account name has at most %d", ErrBadAccount, name, len(name), MaxAccountLen)
	}
	return nil
}

func accountByte(c byte) bool {
	switch {
	case 'a' <= c && c <= 'z', 'A' <= c && c <= 'Z', '0' <= c && c <= '9':
		return true
	}
	switch c {
	case '.', '_', '@', ':', '+', '=', '-':
		return true
	}
	return false
}
