package durations

import (
	"testing"
	"time"
)

func TestFormat(t *testing.T) {
	for d, want := range map[time.Duration]string{
		24 * time.Hour: "24h", time.Hour + 30*time.Minute: "1h30m", time.Minute: "1m", 90 * time.Second: "1m30s",
		time.Second: "1s", 250 * time.Millisecond: "250ms", 2*time.Hour + 3*time.Second: "2h0m3s",
	} {
		if got := Format(d); got != want {
			t.Errorf("Format(%v) = %q, want %q", d, got, want)
		}
	}
}
