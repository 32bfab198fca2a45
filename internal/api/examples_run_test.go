//go:build examples

package api

import (
	"bytes"
	"context"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/shaper-dev/shaper/queue"
)

// TestExamples runs docs/examples' programs against a real API, worker
// and vendor: each queues three calls (202), cancels the third while it
// is pending (the vendor, taking one call at a time, holds the second
// until the test ends), and follows the first until it completed with the
// vendor's 200. The cancelled call never reaches the vendor. Built with
// -tags examples only (make test-examples, which CI runs): where an
// interpreter is missing it fails, naming what to install.
func TestExamples(t *testing.T) {
	for _, ex := range examples {
		t.Run(ex.file, func(t *testing.T) {
			if out, err := exec.Command(ex.check[0], ex.check[1:]...).CombinedOutput(); err != nil {
				t.Fatalf("%s needs %s: %v %s", ex.file, ex.install, err, out)
			}
			s := newSetup(t, Options{Token: "tok"}, 100, true, func(v *queue.Vendor) { v.Concurrency = 1 })
			release := make(chan struct{})
			var once sync.Once
			s.v.mu.Lock()
			s.v.hold = func(key string) {
				if strings.HasSuffix(key, "-2") {
					<-release
				}
			}
			s.v.mu.Unlock()
			t.Cleanup(func() { once.Do(func() { close(release) }) })

			ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
			defer cancel()
			args := append(ex.command[1:], filepath.Join("..", "..", "docs", "examples", ex.file), s.url, s.vendor)
			cmd := exec.CommandContext(ctx, ex.command[0], args...)
			cmd.Env = append(os.Environ(), "SHAPER_API_TOKEN=tok")
			start := time.Now()
			out, err := cmd.CombinedOutput()
			t.Logf("%s %s ran in %s:\n%s", ex.command[0], ex.file, time.Since(start).Round(time.Millisecond), out)
			if err != nil {
				t.Fatalf("%s: %v\n%s", ex.file, err, out)
			}
			m := regexp.MustCompile(`queued 3 calls: (example-\d+)-1 `).FindSubmatch(out)
			if m == nil {
				t.Fatalf("%s did not say it queued 3 calls:\n%s", ex.file, out)
			}
			run := string(m[1])
			for _, want := range []string{"cancelled " + run + "-3 while pending", run + "-1 completed, HTTP 200: "} {
				if !bytes.Contains(out, []byte(want)) {
					t.Errorf("%s did not say %q:\n%s", ex.file, want, out)
				}
			}
			s.v.mu.Lock()
			defer s.v.mu.Unlock()
			if n := s.v.keys[run+"-3"]; n != 0 {
				t.Errorf("the cancelled call reached the vendor %d times", n)
			}
		})
	}
}
