// Package durations prints durations the way config files write them.
package durations

import (
	"strings"
	"time"
)

// Format prints d like time.Duration.String without zero units: "24h",
// "1m30s", "250ms".
func Format(d time.Duration) string {
	s := d.String()
	if strings.HasSuffix(s, "m0s") {
		s = s[:len(s)-2]
	}
	if strings.HasSuffix(s, "h0m") {
		s = s[:len(s)-2]
	}
	return s
}
