package main

import (
	"encoding/json"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/shaper-dev/shaper/internal/redistest"
	"github.com/shaper-dev/shaper/queue"
)

// TestExplainCommand explains a call queued behind others, in text and
// JSON, and an unknown id, through the CLI.
func TestExplainCommand(t *testing.T) {
	t.Parallel()
	vendor := "expl-" + redistest.Prefix(t)[5:]
	cfg := filepath.Join(t.TempDir(), "config.toml")
	err := os.WriteFile(cfg, []byte(`[redis]
addr = "`+redistest.Addr(t)+`"

[vendors.`+vendor+`]
base_url = "https://api.vendor.example"
rate = 5
`), 0o600)
	if err != nil {
		t.Fatal(err)
	}
	var lines strings.Builder
	for i := range 12 {
		fmt.Fprintf(&lines, "{\"id\":\"%s-%d\",\"path\":\"/o/%d\",\"headers\":{\"Authorization\":\"Bearer s3cret\"}}\n", vendor, i, i)
	}
	if out, err := runShaper(t, lines.String(), "enqueue", "--config", cfg, "--vendor", vendor, "--file", "-"); err != nil {
		t.Fatalf("enqueue: %v\n%s", err, out)
	}
	id := vendor + "-10"
	out, err := runShaper(t, "", "explain", "--config", cfg, id)
	if err != nil {
		t.Fatalf("explain: %v\n%s", err, out)
	}
	for _, want := range []string{"task " + id, "pending", "place 11 in its lane, 10 calls start before it", "a backlog of 10 calls", "estimated start"} {
		if !strings.Contains(out, want) {
			t.Errorf("explain lacks %q:\n%s", want, out)
		}
	}
	if strings.Contains(out, "s3cret") {
		t.Errorf("explain shows a header value:\n%s", out)
	}
	out, err = runShaper(t, "", "explain", "--config", cfg, "--json", id)
	if err != nil {
		t.Fatalf("explain --json: %v\n%s", err, out)
	}
	var ex queue.Explanation
	if err := json.Unmarshal([]byte(out), &ex); err != nil || ex.Place != 11 || ex.Binding != queue.BindBacklog || ex.EstimatedStart == nil {
		t.Fatalf("explain --json: %v\n%s", err, out)
	}
	out, err = runShaper(t, "", "explain", "--config", cfg, "no-such-"+vendor)
	if err == nil || !strings.Contains(out, "no such task") || strings.Contains(out, "goroutine") {
		t.Fatalf("an unknown id: %v\n%s", err, out)
	}
}
