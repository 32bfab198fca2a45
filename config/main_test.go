package config

import (
	"testing"

	"go.uber.org/goleak"
)

// Watch starts goroutines (fsnotify's): none may outlive a test.
func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }
