package vendorclients

import (
	"strconv"
	"testing"
)

// TestAnnouncedRatesPerBucket: a repeated announcement of one bucket costs
// nothing after the first, another bucket's (an account's) still counts,
// and the memory stays bounded.
func TestAnnouncedRatesPerBucket(t *testing.T) {
	var a announcedRates
	if !a.changed("shop/a", 20) || a.changed("shop/a", 20) {
		t.Error("the second identical announcement of shop/a counted as a change")
	}
	if !a.changed("shop/b", 20) {
		t.Error("shop/b's first announcement was taken for shop/a's")
	}
	if !a.changed("shop/a", 10) {
		t.Error("a new rate for shop/a was not a change")
	}
	for i := range 3 * maxAnnounced {
		a.changed("shop/"+strconv.Itoa(i), 5)
	}
	if len(a.last) > maxAnnounced {
		t.Errorf("%d buckets remembered, want at most %d", len(a.last), maxAnnounced)
	}
}
