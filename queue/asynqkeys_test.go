package queue

import (
	"runtime/debug"
	"strings"
	"testing"
)

// TestCheckAsynq: a worker refuses an asynq other than the one the keys of
// asynqkeys.go were pinned against, and this build has that one.
func TestCheckAsynq(t *testing.T) {
	if err := checkAsynq(); err != nil {
		t.Fatalf("this build: %v", err)
	}
	dep := func(v string, replace *debug.Module) *debug.BuildInfo {
		return &debug.BuildInfo{Deps: []*debug.Module{{Path: "github.com/redis/go-redis/v9", Version: "v9.23.0"},
			{Path: "github.com/hibiken/asynq", Version: v, Replace: replace}}}
	}
	for _, tt := range []struct {
		name string
		info *debug.BuildInfo
		bad  string // "": accepted; else a part of the error
	}{
		{"pinned", dep(asynqPinned, nil), ""},
		{"newer", dep("v0.27.1", nil), "asynq v0.27.1"},
		{"replaced by the pinned one", dep("v0.25.0", &debug.Module{Path: "github.com/hibiken/asynq", Version: asynqPinned}), ""},
		{"replaced by another", dep(asynqPinned, &debug.Module{Path: "example.com/asynq", Version: "v0.30.0"}), "asynq v0.30.0"},
		{"without asynq", &debug.BuildInfo{}, ""},
	} {
		t.Run(tt.name, func(t *testing.T) {
			err := checkAsynqIn(tt.info)
			switch {
			case tt.bad == "" && err != nil:
				t.Errorf("refused: %v", err)
			case tt.bad != "" && (err == nil || !strings.Contains(err.Error(), tt.bad) || !strings.Contains(err.Error(), asynqPinned)):
				t.Errorf("error %v, want one naming %q and %s", err, tt.bad, asynqPinned)
			}
		})
	}
}
