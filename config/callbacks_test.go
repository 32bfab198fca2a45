package config

import (
	"strings"
	"testing"
	"time"

	"github.com/shaper-dev/shaper/queue"
)

func TestCallbacksTable(t *testing.T) {
	cfg, err := Parse("c.toml", []byte("[callbacks]\nallow = [\"https://hooks.example.com/shaper\"]\nsecret = \"${CB_SECRET}\"\nattempts = 5\n"))
	if err != nil {
		t.Fatal(err)
	}
	cb := cfg.Callbacks
	if len(cb.Allow) != 1 || cb.Attempts != 5 || cb.Timeout != queue.DefaultCallbackTimeout || cb.Concurrency != queue.DefaultCallbackConcurrency {
		t.Errorf("callbacks = %+v", cb)
	}
	if got := cfg.ClientConfig().CallbackAllow; len(got) != 1 || got[0] != "https://hooks.example.com/shaper" {
		t.Errorf("the client's allow-list = %v", got)
	}
	if _, err := cfg.WorkerConfig(); err == nil || !strings.Contains(err.Error(), "CB_SECRET") {
		t.Errorf("secret's variable unset: %v, want an error naming CB_SECRET", err)
	}
	t.Setenv("CB_SECRET", "k")
	wc, err := cfg.WorkerConfig()
	if err != nil {
		t.Fatal(err)
	}
	if want := (queue.CallbackConfig{Allow: cb.Allow, Secret: "k", Timeout: queue.DefaultCallbackTimeout, Attempts: 5, Concurrency: queue.DefaultCallbackConcurrency}); wc.Callbacks.Secret != want.Secret || wc.Callbacks.Attempts != 5 || wc.Callbacks.Timeout != 10*time.Second {
		t.Errorf("worker callbacks = %+v, want %+v", wc.Callbacks, want)
	}

	none, err := Parse("c.toml", []byte(""))
	if err != nil {
		t.Fatal(err)
	}
	if len(none.Callbacks.Allow) != 0 || len(none.ClientConfig().CallbackAllow) != 0 {
		t.Errorf("no [callbacks]: %+v, want off", none.Callbacks)
	}

	for _, c := range []struct{ name, toml, want string }{
		{"allow without secret", "[callbacks]\nallow = [\"https://h.example\"]\n", "c.toml:1: invalid config: callbacks.secret: callbacks are signed"},
		{"allow not a list", "[callbacks]\nallow = \"https://h.example\"\nsecret = \"k\"\n", "c.toml:2: invalid config: callbacks.allow: want a list"},
		{"relative entry", "[callbacks]\nallow = [\"hooks.example.com\"]\nsecret = \"k\"\n", "c.toml:2: invalid config: callbacks.allow: callback url \"hooks.example.com\": want an absolute http or https URL"},
		{"query in an entry", "[callbacks]\nallow = [\"https://h.example/x?a=1\"]\nsecret = \"k\"\n", "an allowed prefix has no ?query"},
		{"typo", "[callbacks]\nalow = []\n", `c.toml:2: invalid config: callbacks.alow: unknown key; did you mean "allow"?`},
		{"zero attempts", "[callbacks]\nattempts = 0\n", "callbacks.attempts: 0: must be at least 1"},
		{"not a table", "callbacks = 1\n", "[callbacks] must be a table"},
	} {
		_, err := Parse("c.toml", []byte(c.toml))
		if err == nil || !strings.Contains(err.Error(), c.want) {
			t.Errorf("%s: %v, want %q", c.name, err, c.want)
		}
	}
}
