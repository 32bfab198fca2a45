package config

import (
	"fmt"
	"sort"
	"strings"
	"time"

	"github.com/shaper-dev/shaper/queue"
)

var (
	callbackKeys = []string{"allow", "secret", "receivers", "timeout", "attempts", "concurrency"}
	receiverKeys = []string{"prefix", "secret"}
)

// Callbacks is the [callbacks] table: where calls may ask for their
// outcome to be POSTed, and how it is signed and retried. Without it (or
// with no allow and no receivers), a call that names a callback is
// refused.
type Callbacks struct {
	// Allow lists URL prefixes (scheme://host[:port][/path]); a callback
	// URL must be under one of them, or under a receiver's. Deliveries
	// under them are signed with Secret.
	Allow []string
	// Secret keys the HMAC-SHA256 signature of deliveries under Allow's
	// prefixes; it may name environment variables as ${NAME}, read by
	// workers at start and at each reload (Expand).
	Secret string
	// Receivers ([[callbacks.receivers]]) are prefixes with a secret of
	// their own, so that no receiver can sign another's callbacks: a
	// delivery is signed with the secret of the longest prefix its URL
	// is under. A receiver's prefix is allowed like Allow's.
	Receivers   []Receiver
	Timeout     time.Duration // one delivery attempt
	Attempts    int           // delivery attempts before a callback is archived
	Concurrency int           // deliveries at once per worker
}

// Receiver is a [[callbacks.receivers]] item.
type Receiver struct {
	Prefix string
	Secret string // may name ${NAME}, like Callbacks.Secret
}

// Prefixes returns every URL prefix a callback may name: allow's and the
// receivers'.
func (c Callbacks) Prefixes() []string {
	out := append([]string(nil), c.Allow...)
	for _, r := range c.Receivers {
		out = append(out, r.Prefix)
	}
	return out
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
	if v, present := tbl["receivers"]; present {
		cb.Receivers = p.receivers(v)
	}
	if len(cb.Allow) > 0 && cb.Secret == "" {
		p.errorf(t, "secret", "callbacks are signed: set a secret, e.g. secret = \"${SHAPER_CALLBACK_SECRET}\" (read from the environment)")
	}
	return cb
}

// receivers reads the [[callbacks.receivers]] items.
func (p *parser) receivers(raw any) []Receiver {
	const t = "callbacks"
	list, ok := raw.([]any)
	if !ok {
		p.errorf(t, "receivers", "must be an array of tables: [[callbacks.receivers]] with prefix = \"https://a.example/hooks\" and secret = \"${A_SECRET}\"")
		return nil
	}
	seen := map[string]int{}
	var out []Receiver
	for i, item := range list {
		n := i + 1
		m, isTable := item.(map[string]any)
		line := locateItem(p.text, t, "receivers", n)
		name := fmt.Sprintf("callbacks.receivers item %d", n)
		if prefix, ok := m["prefix"].(string); ok {
			name += fmt.Sprintf(" (%s)", prefix)
		}
		fail := func(format string, args ...any) { p.errorAt(line, name, format, args...) }
		if !isTable {
			fail("must be a table with prefix and secret")
			continue
		}
		keys := make([]string, 0, len(m))
		for k := range m {
			keys = append(keys, k)
		}
		sort.Strings(keys)
		bad := false
		for _, k := range keys {
			if k != "prefix" && k != "secret" {
				fail("unknown key %q; %s", k, knownKeyHint(k, receiverKeys))
				bad = true
			}
		}
		prefix, okPrefix := m["prefix"].(string)
		secret, okSecret := m["secret"].(string)
		switch {
		case !okPrefix || prefix == "":
			fail("prefix is required: the receiver's URL prefix, e.g. prefix = \"https://a.example/hooks\"")
			continue
		case !okSecret || secret == "":
			fail("secret is required: the key its callbacks are signed with, e.g. secret = \"${A_SECRET}\" (read from the environment)")
			continue
		}
		if err := queue.CheckCallbackAllow([]string{prefix}); err != nil {
			fail("%w", err)
			continue
		}
		if first, dup := seen[prefix]; dup {
			fail("prefix %s is item %d's too; give a prefix one secret", prefix, first)
			continue
		}
		seen[prefix] = n
		if !bad {
			out = append(out, Receiver{Prefix: prefix, Secret: secret})
		}
	}
	return out
}

// Expand returns the callbacks' config for a worker, with the secrets'
// ${NAME} references read from the environment: a variable that is not
// set is an error naming it (never a secret).
func (c Callbacks) Expand() (queue.CallbackConfig, error) {
	expand := func(key, s string) (string, error) {
		var missing []string
		x := expandEnv(s, &missing)
		if len(missing) > 0 {
			sort.Strings(missing)
			return "", fmt.Errorf("config: %s: environment variable(s) %s not set; export them before starting the worker", key, strings.Join(missing, ", "))
		}
		if s != "" && x == "" {
			return "", fmt.Errorf("config: %s is empty once expanded: the environment variable it names is set to nothing", key)
		}
		return x, nil
	}
	secret, err := expand("callbacks.secret", c.Secret)
	if err != nil {
		return queue.CallbackConfig{}, err
	}
	if len(c.Allow) > 0 && secret == "" {
		return queue.CallbackConfig{}, fmt.Errorf("config: callbacks.secret is empty once expanded: the environment variable it names is set to nothing")
	}
	qc := queue.CallbackConfig{Allow: c.Allow, Secret: secret, Timeout: c.Timeout, Attempts: c.Attempts, Concurrency: c.Concurrency}
	for i, r := range c.Receivers {
		s, err := expand(fmt.Sprintf("callbacks.receivers item %d (%s): secret", i+1, r.Prefix), r.Secret)
		if err != nil {
			return queue.CallbackConfig{}, err
		}
		qc.Receivers = append(qc.Receivers, queue.CallbackReceiver{Prefix: r.Prefix, Secret: s})
	}
	return qc, nil
}
