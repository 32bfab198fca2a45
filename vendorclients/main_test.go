package vendorclients

import (
	"os"
	"testing"

	"github.com/shaper-dev/shaper/internal/redistest"
)

func TestMain(m *testing.M) {
	os.Exit(redistest.Main(m))
}
