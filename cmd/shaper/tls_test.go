package main

import (
	"context"
	"fmt"
	"net/http/httptest"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/shaper-dev/shaper/internal/redistest"
	"github.com/shaper-dev/shaper/internal/vendorsim"
	"github.com/shaper-dev/shaper/queue"
)

// TestOwnRedisTLSAndLeastPrivilegeACL runs the worker, enqueue and stats over
// rediss:// against a TLS-only redis-server (certificates made for the
// test, a client certificate required) as an ACL user made by the command
// `shaper config acl` prints (queue.ACLRules): every call completes, and Redis logged no ACL denial,
// so the documented rules are enough; the user cannot flush the database
// or touch another application's keys, so they are not too broad.
func TestOwnRedisTLSAndLeastPrivilegeACL(t *testing.T) {
	t.Parallel()
	srv, files := redistest.StartTLS(t)
	ctx := context.Background()
	admin := redis.NewClient(&redis.Options{Addr: srv.Addr, TLSConfig: srv.TLSConfig()})
	defer admin.Close()
	const pass = "s3cret-pw"
	// The user is made by the command `shaper config acl` prints.
	out, err := runShaper(t, "", "config", "acl", "--user", "shaper")
	if err != nil {
		t.Fatalf("shaper config acl: %v\n%s", err, out)
	}
	var setuser []any
	for _, line := range strings.Split(out, "\n") {
		if strings.HasPrefix(line, "ACL SETUSER ") {
			for _, f := range strings.Fields(strings.Replace(line, ">PASSWORD", ">"+pass, 1)) {
				setuser = append(setuser, f)
			}
		}
	}
	if !strings.Contains(out, queue.ACLRules("")) || len(setuser) == 0 {
		t.Fatalf("shaper config acl printed no ACL SETUSER with queue.ACLRules:\n%s", out)
	}
	if err := admin.Do(ctx, setuser...).Err(); err != nil {
		t.Fatalf("%v: %v", setuser, err)
	}

	vend := &vendorsim.Mock{Rate: 50, Window: time.Second}
	hs := httptest.NewServer(vend)
	defer hs.Close()
	cfg := filepath.Join(t.TempDir(), "config.toml")
	body := fmt.Sprintf(`[redis]
addr = "rediss://%s"
username = "shaper"
password = %q
tls_ca_file = %q
tls_cert_file = %q
tls_key_file = %q

[vendors.tls]
base_url = %q
rate = 50
`, srv.Addr, pass, files.CA, files.ClientCert, files.ClientKey, hs.URL)
	if err := os.WriteFile(cfg, []byte(body), 0o600); err != nil {
		t.Fatal(err)
	}
	_, log := startWorker(t, cfg)
	const n = 100
	if out, err := runShaper(t, jobLines("tls", n), "enqueue", "--config", cfg, "--vendor", "tls", "--file", "-"); err != nil {
		t.Fatalf("enqueue over TLS as the ACL user: %v\n%s", err, out)
	}
	waitUntil(t, time.Minute, "every call over TLS", func() bool { return vend.Summarize().DistinctKeys == n })
	if out, err := runShaper(t, "", "stats", "--config", cfg, "--json"); err != nil || !strings.Contains(out, `"vendor": "tls"`) {
		t.Errorf("stats over TLS as the ACL user: %v\n%s", err, out)
	}
	time.Sleep(2 * time.Second) // the worker's periodic work (sweeps, supervisors, asynq's heartbeats) under the ACL too

	denials, err := admin.Do(ctx, "ACL", "LOG").Slice()
	if err != nil {
		t.Fatal(err)
	}
	for _, d := range denials {
		t.Errorf("ACL denial: %v", d)
	}
	if strings.Contains(log.String(), "NOPERM") {
		t.Errorf("the worker logged a permission error:\n%s", log.String())
	}

	user := redis.NewClient(&redis.Options{Addr: srv.Addr, TLSConfig: srv.TLSConfig(), Username: "shaper", Password: pass})
	defer user.Close()
	for _, cmd := range [][]any{{"FLUSHALL"}, {"SET", "otherapp:key", "x"}, {"CONFIG", "SET", "maxmemory-policy", "allkeys-lru"}, {"KEYS", "*"}} {
		if err := user.Do(ctx, cmd...).Err(); err == nil || !strings.Contains(err.Error(), "NOPERM") {
			t.Errorf("%v as the shaper user: %v, want NOPERM", cmd, err)
		}
	}
	// Plain TCP is refused: the server speaks TLS only.
	plain := redis.NewClient(&redis.Options{Addr: srv.Addr, MaxRetries: -1, DialTimeout: time.Second, ReadTimeout: time.Second})
	defer plain.Close()
	if err := plain.Ping(ctx).Err(); err == nil {
		t.Error("a plain-TCP client reached the TLS-only server")
	}
}
