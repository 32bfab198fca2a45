package config

import (
	"errors"
	"io/fs"
	"path/filepath"
	"strings"
	"testing"
)

// TestLoadMissingFileSaysWhich: a config file that does not exist is a
// *NotFoundError that names the file (and, for a relative path, the
// directory it was looked for in), and still matches fs.ErrNotExist.
func TestLoadMissingFileSaysWhich(t *testing.T) {
	abs := filepath.Join(t.TempDir(), "missing.toml")
	for _, tc := range []struct {
		path, want string
		dir        bool
	}{
		{path: "no-such-config.toml", want: "config file no-such-config.toml not found in ", dir: true},
		{path: abs, want: "config file " + abs + " not found"},
	} {
		t.Run(tc.path, func(t *testing.T) {
			_, err := Load(tc.path)
			var nf *NotFoundError
			if !errors.As(err, &nf) || !errors.Is(err, fs.ErrNotExist) {
				t.Fatalf("err = %v (%T), want a *NotFoundError wrapping fs.ErrNotExist", err, err)
			}
			if !strings.HasPrefix(err.Error(), tc.want) || strings.Contains(err.Error(), "no such file") {
				t.Errorf("err = %q, want it to start with %q (and no open error)", err, tc.want)
			}
			if (nf.Dir != "") != tc.dir {
				t.Errorf("Dir = %q for path %q", nf.Dir, tc.path)
			}
		})
	}
}
