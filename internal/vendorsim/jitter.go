package vendorsim

import (
	"math/rand/v2"
	"net/http"
	"time"
)

// Jitter is an http.Handler that models network delay between a caller and
// a vendor: it sleeps a delay drawn uniformly from [Min, Max] and then
// passes the request to Next. Requests sent evenly spaced reach Next
// bunched up, as they reach a real vendor. Requests are delayed
// concurrently, each on its own server goroutine.
//
// A Vendor behind a Jitter records a request's At when it receives it,
// that is after the delay. The delay is not cut short when the caller
// gives up: a request already on the wire still reaches the vendor.
//
//	srv := httptest.NewServer(&vendorsim.Jitter{Next: vend, Max: 40 * time.Millisecond})
type Jitter struct {
	Next http.Handler
	// Min and Max bound the delay. A Max below Min means a delay of
	// exactly Min; a negative delay means none.
	Min, Max time.Duration

	sleep func(time.Duration) // time.Sleep when nil (tests replace it)
}

// delay draws one delay from [Min, Max].
func (j *Jitter) delay() time.Duration {
	if j.Max <= j.Min {
		return j.Min
	}
	return j.Min + rand.N(j.Max-j.Min+1)
}

// ServeHTTP sleeps a random delay, then serves the request with Next.
func (j *Jitter) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	if d := j.delay(); d > 0 {
		if j.sleep != nil {
			j.sleep(d)
		} else {
			time.Sleep(d)
		}
	}
	j.Next.ServeHTTP(w, r)
}
