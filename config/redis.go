package config

import (
	"crypto/tls"
	"crypto/x509"
	"fmt"
	"net"
	"os"
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
	if (r.TLS || r.TLSCAFile != "" || r.TLSCertFile != "") && o.TLSConfig == nil {
		o.TLSConfig = &tls.Config{MinVersion: tls.VersionTLS12}
	}
	if r.TLSCAFile != "" {
		pem, err := os.ReadFile(r.TLSCAFile)
		if err != nil {
			return nil, fmt.Errorf("config: redis.tls_ca_file: %w", err)
		}
		pool := x509.NewCertPool()
		if !pool.AppendCertsFromPEM(pem) {
			return nil, fmt.Errorf("config: redis.tls_ca_file %s: no PEM certificate in it", r.TLSCAFile)
		}
		o.TLSConfig.RootCAs = pool
	}
	if r.TLSCertFile != "" {
		cert, err := tls.LoadX509KeyPair(r.TLSCertFile, r.TLSKeyFile)
		if err != nil {
			return nil, fmt.Errorf("config: redis.tls_cert_file and tls_key_file: %w", err)
		}
		o.TLSConfig.Certificates = []tls.Certificate{cert}
	}
	if o.TLSConfig != nil && o.TLSConfig.ServerName == "" && len(o.Addrs) > 0 && r.MasterName == "" && !r.Cluster {
		if host, _, err := net.SplitHostPort(o.Addrs[0]); err == nil {
			o.TLSConfig.ServerName = host
		}
	}
	return o, nil
}

func firstNonEmpty(a, b string) string {
	if a != "" {
		return a
	}
	return b
}
