package config

import (
	"crypto/tls"
	"fmt"
	"strings"
	"time"

	"github.com/redis/go-redis/v9"
)

// Options returns the go-redis options for addr (which replaces r.Addr:
// the embedded Redis has an address only once it runs).
func (r Redis) Options(addr string) (*redis.UniversalOptions, error) {
	o := &redis.UniversalOptions{
		Username: r.Username, Password: r.Password, DB: r.DB, MasterName: r.MasterName,
		IsClusterMode: r.Cluster, DialTimeout: 3 * time.Second, PoolSize: 256,
	}
	if strings.Contains(addr, "://") {
		u, err := redis.ParseURL(addr)
		if err != nil {
			return nil, fmt.Errorf("config: redis.addr %q: %w", addr, err)
		}
		o.Addrs = []string{u.Addr}
		o.Username, o.Password, o.DB, o.TLSConfig = firstNonEmpty(u.Username, o.Username), firstNonEmpty(u.Password, o.Password), u.DB, u.TLSConfig
	} else {
		for _, a := range strings.Split(addr, ",") {
			o.Addrs = append(o.Addrs, strings.TrimSpace(a))
		}
	}
	if r.TLS && o.TLSConfig == nil {
		o.TLSConfig = &tls.Config{MinVersion: tls.VersionTLS12}
	}
	return o, nil
}

func firstNonEmpty(a, b string) string {
	if a != "" {
		return a
	}
	return b
}
