package queue

import (
	"math"
	"strings"
	"time"

	"github.com/shaper-dev/shaper/shaper"
	"github.com/shaper-dev/shaper/vendorclients"
)

// Vendor is one vendor as the queue sees it: how to call it (the embedded
// vendorclients.Endpoint: name, base_url, headers, timeout), how to shape
// its calls (Policy), and its queue. The client reads Name and
// QueueLimit; the worker reads the rest.
type Vendor struct {
	vendorclients.Endpoint
	// Policy shapes the vendor's calls; with PerAccount, it shapes each
	// account's calls on their own (Overrides replace it for some).
	Policy shaper.Policy
	// PerAccount gives each account (a store, a portal, an API key) a
	// bucket of its own; every call then names its account.
	PerAccount bool
	// Overrides are the policies of accounts that differ from Policy.
	Overrides map[string]shaper.Policy
	// Total, when set, is a limit over all of a PerAccount vendor's
	// accounts together, shared max-min fairly among those with waiting
	// calls.
	Total *shaper.Policy
	// QueueLimit is how many calls may wait in the vendor's queue; 0
	// means no bound.
	QueueLimit int
	// MaxAnswer is how many bytes of an answer's body a call keeps with
	// its result (see CallResult): 0 for DefaultMaxAnswer, NoAnswerBody
	// for none, at most MaxMaxAnswer. KeepHeaders names the answer's
	// headers it keeps. Both apply to the next call on a reload.
	MaxAnswer   int64
	KeepHeaders []string
	// Concurrency is the vendor's worker budget: tasks waiting for a tick
	// or calling at once in one worker process. 0 sizes it from the rate.
	Concurrency int
}

// maxConcurrency caps a vendor's worker budget sized from its rate.
const maxConcurrency = 1000

// perAccountBudget is how many accounts' worth of calls a per-account
// vendor without a total holds at once, when its budget is sized from one
// account's rate. (Set concurrency to size it yourself.)
const perAccountBudget = 128

// concurrency sizes a vendor's worker budget: enough goroutines to hold a
// horizon of granted ticks plus the calls in flight, so that no tick is
// lost to slow pick-up, and each replica alone can carry the full rate if
// the others die.
func (v Vendor) concurrency() int {
	if v.Concurrency > 0 {
		return v.Concurrency
	}
	policy, accounts := v.Policy, 1
	if v.PerAccount && v.Total != nil {
		policy = *v.Total // all accounts together
	} else if v.PerAccount {
		accounts = perAccountBudget // accounts busy at once, from one process
	}
	iv, burst := policy.Tick()
	perSecond := float64(burst) * float64(time.Second) / float64(iv)
	timeout := v.Timeout
	if timeout <= 0 {
		timeout = vendorclients.DefaultTimeout
	}
	hold := v.Policy.Horizon
	switch {
	case hold > 0:
	case v.PerAccount:
		hold = perAccountHorizon
	default:
		hold = shaper.DefaultHorizon
	}
	hold += min(timeout, time.Second)
	n := (int(math.Ceil(perSecond*hold.Seconds())) + burst) * accounts
	return max(2, min(n, maxConcurrency))
}

// secrets returns the vendor's header values that must never reach a log,
// an error or a task result.
func (v Vendor) secrets() []string { return headerSecrets(v.Headers) }

// headerSecrets returns the values of headers to redact: each value of 4
// bytes or more, and the token of a "Scheme token" value.
func headerSecrets(headers map[string]string) []string {
	var out []string
	for _, val := range headers {
		if len(val) >= 4 {
			out = append(out, val)
			if _, token, ok := strings.Cut(val, " "); ok && len(token) >= 4 { // "Bearer <token>"
				out = append(out, token)
			}
		}
	}
	return out
}

// perAccountForward is how often a per-account vendor's server moves
// calls whose planned moment has come from the schedule to the queue
// (asynq's DelayedTaskCheckInterval): their accounts' backlogs wait
// there, and a call forwarded late is a tick lost. Other vendors' queues
// hold only retries and long waits there, checked every second.
const perAccountForward = 100 * time.Millisecond

func (v Vendor) forwardEvery() time.Duration {
	if v.PerAccount {
		return perAccountForward
	}
	return time.Second
}

// perAccountHorizon is how far ahead an account's ticks are reserved when
// its policy does not say (shaper's default is 1 s). An account's planned
// calls come back from asynq's schedule (checked every perAccountForward)
// ahead of their ticks; reserving 1.2 s ahead lets each ask the gate once
// (1.00 round trips per call in `go run ./bench -accounts`), while a high
// call, which waits behind the ticks already reserved, starts within
// about 1.35 s (TestHighLaneGoesFirstThroughWorkers; at 1.5 s it waited 1.62 s).
// The price: a group Redis lost (or never saw) waits 1.2 s before its
// first tick, not 1 s.
const perAccountHorizon = 1200 * time.Millisecond

// accountPolicy is the policy of one account of a per-account vendor:
// its override, or the vendor's, with the per-account horizon.
func accountPolicy(base shaper.Policy, overrides map[string]shaper.Policy, account string) shaper.Policy {
	p := base
	if o, ok := overrides[account]; ok {
		p = o
	}
	if p.Horizon == 0 {
		p.Horizon = perAccountHorizon
	}
	return p
}
