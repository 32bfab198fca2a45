package metrics

import (
	"context"
	"net/http"
	"net/http/httptest"
	"runtime"
	"strings"
	"testing"

	"github.com/shaper-dev/shaper/shaper"
)

// noWorker is a worker with no vendors: the scrape reads nothing from
// Redis.
type noWorker struct{}

func (noWorker) Buckets() map[string]*shaper.Bucket { return nil }
func (noWorker) Serving() int                       { return 0 }
func (noWorker) AccountBacklogs(context.Context) (map[string]int64, error) {
	return nil, nil
}

// TestMetricsHaveRuntimeAndProcess scrapes /metrics and finds the Go
// runtime's and the process's standard metrics beside shaper's own.
func TestMetricsHaveRuntimeAndProcess(t *testing.T) {
	m := New(noWorker{}, nil)
	rec := httptest.NewRecorder()
	m.Handler(nil).ServeHTTP(rec, httptest.NewRequest(http.MethodGet, "/metrics", nil))
	if rec.Code != http.StatusOK {
		t.Fatalf("GET /metrics: %d\n%s", rec.Code, rec.Body)
	}
	body := rec.Body.String()
	want := []string{"\ngo_goroutines ", "\ngo_memstats_alloc_bytes ", "\nshaper_vendors_served 0"}
	if runtime.GOOS == "linux" { // the process collector reads /proc
		want = append(want, "\nprocess_cpu_seconds_total ", "\nprocess_resident_memory_bytes ")
	}
	for _, w := range want {
		if !strings.Contains(body, w) {
			t.Errorf("/metrics lacks %q:\n%s", strings.TrimSpace(w), body)
		}
	}
}
