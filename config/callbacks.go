package config

import (
	"fmt"
	"sort"
	"strings"
	"time"

	"github.com/shaper-dev/shaper/queue"
)

var callbackKeys = []string{"allow", "secret", "timeout", "attempts", "concurrency"}

// Callbacks is the [callbacks] table: where calls may ask for their
// outcome to be POSTed, and how it is signed and retried. Without it (or
// with an empty allow), a call that names a callback is refused.
type Callbacks struct {
	// Allow lists URL prefixes (scheme://host[:port][/path]); a callback
	// URL must be under one of them.
	Allow []string
	// Secret keys the HMAC-SHA256 signature; it may name environment
	// variables as ${NAME}, read by workers at start (Expand).
	Secret      string
	Timeout     time.Duration // one delivery attempt
	Attempts    int           // delivery attempts before a callback is archived
	Concurrency int           // deliveries at once per worker
}

// callbacks reads the [callbacks] table.
func (p *parser) callbacks(raw map[string]any) Callbacks {
	const t = "callbacks"
	tbl, ok := raw[t].(map[string]any)
	if !ok {
		if _, present := raw[t]; present {
			p.errorf(t, "", "[callbacks] must be a table")
		}
		return Callbacks{}
	}
	p.unknownKeys(t, tbl, callbackKeys)
	cb := Callbacks{
		Secret:  p.str(t, "secret"),
		Timeout: p.duration(t, "timeout", queue.DefaultCallbackTimeout),
	}
	cb.Attempts, _ = p.integer(t, "attempts", 1, queue.DefaultCallbackAttempts)
	cb.Concurrency, _ = p.integer(t, "concurrency", 1, queue.DefaultCallbackConcurrency)
	if cb.Timeout <= 0 {
		p.errorf(t, "timeout", "%s: must be positive", cb.Timeout)
	}
	if v, present := tbl["allow"]; present {
		list, ok := v.([]any)
		if !ok {
			p.errorf(t, "allow", "want a list of URL prefixes, e.g. allow = [\"https://hooks.example.com/shaper\"]")
		}
		for _, x := range list {
			s, ok := x.(string)
			if !ok {
				p.errorf(t, "allow", "%v: want a quoted URL prefix", x)
				continue
			}
			if err := queue.CheckCallbackAllow([]string{s}); err != nil {
				p.errorf(t, "allow", "%w", err)
				continue
			}
			cb.Allow = append(cb.Allow, s)
		}
	}
	if len(cb.Allow) > 0 && cb.Secret == "" {
		p.errorf(t, "secret", "callbacks are signed: set a secret, e.g. secret = \"${SHAPER_CALLBACK_SECRET}\" (read from the environment)")
	}
	return cb
}

// Expand returns the callbacks' config for a worker, with the secret's
// ${NAME} references read from the environment: a variable that is not
// set is an error naming it.
func (c Callbacks) Expand() (queue.CallbackConfig, error) {
	var missing []string
	secret := expandEnv(c.Secret, &missing)
	if len(missing) > 0 {
		sort.Strings(missing)
		return queue.CallbackConfig{}, fmt.Errorf("config: callbacks.secret: environment variable(s) %s not set; export them before starting the worker", strings.Join(missing, ", "))
	}
	if len(c.Allow) > 0 && secret == "" {
		return queue.CallbackConfig{}, fmt.Errorf("config: callbacks.secret is empty once expanded: the environment variable it names is set to nothing")
	}
	return queue.CallbackConfig{Allow: c.Allow, Secret: secret, Timeout: c.Timeout, Attempts: c.Attempts, Concurrency: c.Concurrency}, nil
}
