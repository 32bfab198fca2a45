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

// TestCallbackReceivers: [[callbacks.receivers]] give prefixes secrets of
// their own; their prefixes are allowed; the global secret stays the
// default for allow's prefixes and is not needed without them.
func TestCallbackReceivers(t *testing.T) {
	text := `[callbacks]
allow = ["https://hooks.example.com/shaper"]
secret = "${CB_DEFAULT}"

[[callbacks.receivers]]
prefix = "https://a.example/hooks/"
secret = "${A_SECRET}"

[[callbacks.receivers]]
prefix = "https://b.example/hooks"
secret = "${B_SECRET}"
`
	cfg, err := Parse("c.toml", []byte(text))
	if err != nil {
		t.Fatal(err)
	}
	want := []string{"https://hooks.example.com/shaper", "https://a.example/hooks/", "https://b.example/hooks"}
	if got := cfg.ClientConfig().CallbackAllow; strings.Join(got, " ") != strings.Join(want, " ") {
		t.Errorf("the client's allow-list = %v, want %v", got, want)
	}
	t.Setenv("CB_DEFAULT", "d")
	t.Setenv("A_SECRET", "a")
	if _, err := cfg.WorkerConfig(); err == nil || !strings.Contains(err.Error(), "B_SECRET") || !strings.Contains(err.Error(), "receivers item 2 (https://b.example/hooks)") {
		t.Errorf("B_SECRET unset: %v, want an error naming it and its receiver", err)
	}
	t.Setenv("B_SECRET", "b")
	wc, err := cfg.WorkerConfig()
	if err != nil {
		t.Fatal(err)
	}
	cb := wc.Callbacks
	if cb.Secret != "d" || len(cb.Receivers) != 2 || cb.Receivers[0] != (queue.CallbackReceiver{Prefix: "https://a.example/hooks/", Secret: "a"}) ||
		cb.Receivers[1] != (queue.CallbackReceiver{Prefix: "https://b.example/hooks", Secret: "b"}) {
		t.Errorf("worker callbacks = %+v", cb)
	}

	only, err := Parse("c.toml", []byte("[callbacks]\n[[callbacks.receivers]]\nprefix = \"https://a.example/hooks\"\nsecret = \"k\"\n"))
	if err != nil {
		t.Fatalf("receivers without allow or a global secret: %v", err)
	}
	if got := only.ClientConfig().CallbackAllow; len(got) != 1 {
		t.Errorf("receivers alone: allow-list %v", got)
	}

	head := "[callbacks]\nallow = [\"https://h.example/x\"]\nsecret = \"k\"\n"
	for _, c := range []struct{ name, toml, want string }{
		{"no secret", head + "[[callbacks.receivers]]\nprefix = \"https://a.example/hooks\"\n", "c.toml:4: invalid config: callbacks.receivers item 1 (https://a.example/hooks): secret is required"},
		{"no prefix", head + "[[callbacks.receivers]]\nsecret = \"k\"\n", "c.toml:4: invalid config: callbacks.receivers item 1: prefix is required"},
		{"dot-segment", head + "[[callbacks.receivers]]\nprefix = \"https://a.example/hooks/../admin\"\nsecret = \"k\"\n", "segment"},
		{"duplicate", head + "[[callbacks.receivers]]\nprefix = \"https://a.example/h\"\nsecret = \"k\"\n[[callbacks.receivers]]\nprefix = \"https://a.example/h\"\nsecret = \"j\"\n",
			"c.toml:7: invalid config: callbacks.receivers item 2 (https://a.example/h): prefix https://a.example/h is item 1's too"},
		{"typo", head + "[[callbacks.receivers]]\nprefix = \"https://a.example/h\"\nsecrett = \"k\"\n", `unknown key "secrett"; did you mean "secret"?`},
		{"not tables", head + "receivers = \"https://a.example/h\"\n", "callbacks.receivers: must be an array of tables"},
	} {
		_, err := Parse("c.toml", []byte(c.toml))
		if err == nil || !strings.Contains(err.Error(), c.want) {
			t.Errorf("%s: %v, want %q", c.name, err, c.want)
		}
	}
}
