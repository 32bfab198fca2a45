package redistest

import (
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/tls"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/pem"
	"math/big"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"testing"
	"time"
)

// TLSFiles are the PEM files of a TLS Redis of a test's own.
type TLSFiles struct {
	CA                    string // the CA that signed the server's and the client's certificates
	ClientCert, ClientKey string
}

// StartTLS starts a redis-server that speaks TLS only, with a certificate
// for 127.0.0.1 signed by a CA made for the test, and that requires a
// client certificate signed by it (Redis's default, tls-auth-clients).
// extra are more redis-server arguments (an ACL user, say).
func StartTLS(tb testing.TB, extra ...string) (*Server, TLSFiles) {
	tb.Helper()
	ownServer(tb)
	if _, err := exec.LookPath("redis-server"); err != nil {
		tb.Fatalf("redistest: this test runs a TLS redis-server of its own and needs redis-server on PATH (apt-get install redis-server): %v", err)
	}
	dir := tb.TempDir()
	caKey, caCert, caDER := newCert(tb, "shaper test CA", nil, nil, true)
	write := func(name, typ string, der []byte) string {
		p := filepath.Join(dir, name)
		if err := os.WriteFile(p, pem.EncodeToMemory(&pem.Block{Type: typ, Bytes: der}), 0o600); err != nil {
			tb.Fatal(err)
		}
		return p
	}
	files := TLSFiles{CA: write("ca.crt", "CERTIFICATE", caDER)}
	srvKey, _, srvDER := newCert(tb, "127.0.0.1", caCert, caKey, false)
	cliKey, _, cliDER := newCert(tb, "shaper client", caCert, caKey, false)
	srvCert, srvKeyFile := write("server.crt", "CERTIFICATE", srvDER), write("server.key", "EC PRIVATE KEY", marshalKey(tb, srvKey))
	files.ClientCert, files.ClientKey = write("client.crt", "CERTIFICATE", cliDER), write("client.key", "EC PRIVATE KEY", marshalKey(tb, cliKey))

	pool := x509.NewCertPool()
	pool.AddCert(caCert)
	cert, err := tls.LoadX509KeyPair(files.ClientCert, files.ClientKey)
	if err != nil {
		tb.Fatal(err)
	}
	port, err := freePort()
	if err != nil {
		tb.Fatal(err)
	}
	s := &Server{Addr: net.JoinHostPort("127.0.0.1", strconv.Itoa(port)), port: port,
		args: append([]string{"--dir", dir, "--tls-cert-file", srvCert, "--tls-key-file", srvKeyFile, "--tls-ca-cert-file", files.CA}, extra...),
		tls:  &tls.Config{MinVersion: tls.VersionTLS12, RootCAs: pool, Certificates: []tls.Certificate{cert}, ServerName: "127.0.0.1"}}
	if err := s.Restart(); err != nil {
		tb.Fatal(err)
	}
	tb.Cleanup(s.stop)
	return s, files
}

// newCert makes a key and a certificate for name, signed by parent (self
// signed when parent is nil).
func newCert(tb testing.TB, name string, parent *x509.Certificate, parentKey *ecdsa.PrivateKey, ca bool) (*ecdsa.PrivateKey, *x509.Certificate, []byte) {
	tb.Helper()
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		tb.Fatal(err)
	}
	serial, _ := rand.Int(rand.Reader, big.NewInt(1<<62))
	tmpl := &x509.Certificate{
		SerialNumber: serial, Subject: pkix.Name{CommonName: name},
		NotBefore: time.Now().Add(-time.Hour), NotAfter: time.Now().Add(24 * time.Hour),
		KeyUsage:    x509.KeyUsageDigitalSignature | x509.KeyUsageKeyEncipherment,
		ExtKeyUsage: []x509.ExtKeyUsage{x509.ExtKeyUsageServerAuth, x509.ExtKeyUsageClientAuth},
	}
	if ip := net.ParseIP(name); ip != nil {
		tmpl.IPAddresses = []net.IP{ip}
	}
	if ca {
		tmpl.IsCA, tmpl.BasicConstraintsValid = true, true
		tmpl.KeyUsage |= x509.KeyUsageCertSign
	}
	signer, signKey := parent, parentKey
	if parent == nil {
		signer, signKey = tmpl, key
	}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, signer, &key.PublicKey, signKey)
	if err != nil {
		tb.Fatal(err)
	}
	cert, err := x509.ParseCertificate(der)
	if err != nil {
		tb.Fatal(err)
	}
	return key, cert, der
}

func marshalKey(tb testing.TB, k *ecdsa.PrivateKey) []byte {
	der, err := x509.MarshalECPrivateKey(k)
	if err != nil {
		tb.Fatal(err)
	}
	return der
}

// TLSConfig is the client TLS config for a StartTLS server (its CA and
// the client certificate); nil for a plain server.
func (s *Server) TLSConfig() *tls.Config {
	if s.tls == nil {
		return nil
	}
	return s.tls.Clone()
}
