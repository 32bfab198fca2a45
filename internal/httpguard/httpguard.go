// Package httpguard keeps shaper's HTTP servers (the API, the live page)
// to the requests meant for them, and bounds what one client can hold.
//
// A request is answered only when its Host names the address the server
// listens on (Host), so that a web page whose name was rebound to
// 127.0.0.1 (DNS rebinding) is refused: on a loopback address any
// loopback name with the port (localhost, 127.0.0.1, [::1]) is that
// address; on a wildcard address (0.0.0.0, ::), which shaper serves only
// with a token, any name is, since the token keeps others out. A request
// a browser sends for another site's page (an Origin that is not the
// server's own, or Sec-Fetch-Site: cross-site or same-site) is refused
// where the caller asks (CrossSite): without a token, a page the
// operator opens could otherwise queue calls with the vendors'
// credentials. NewServer is every server's construction, with read,
// write and idle timeouts.
package httpguard

import (
	"fmt"
	"log/slog"
	"net"
	"net/http"
	"net/url"
	"strings"
	"time"
)

// CrossSite says which requests Wrap checks for another site's Origin.
type CrossSite int

const (
	// CheckEvery request is checked (a server without a token).
	CheckEvery CrossSite = iota
	// CheckWrites checks every request but GET and HEAD (a server whose
	// token a browser sends by itself, as a cookie).
	CheckWrites
	// CheckNone checks no request (the token is a header a browser
	// never adds to another site's request by itself).
	CheckNone
)

// Options configure Wrap.
type Options struct {
	// Addr is the address the server listens on (Bound): a request's
	// Host must name it. "" takes the local address each connection
	// arrived at.
	Addr string
	// AnyHost accepts any Host on a wildcard Addr (0.0.0.0, ::, ""
	// host): set it when the server requires a token. A wildcard Addr
	// without it takes the local address each connection arrived at.
	AnyHost bool
	// CrossSite says which requests are refused for coming from another
	// site.
	CrossSite CrossSite
}

// Refuse answers a refused request: status and what to fix.
type Refuse func(w http.ResponseWriter, status int, msg string)

// Wrap returns next behind the checks of o: 421 (Misdirected Request)
// for a Host that does not name the server, 403 for another site's
// request. refuse writes the answer in the server's own format.
func Wrap(next http.Handler, o Options, refuse Refuse) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if err := CheckHost(r, o.Addr, o.AnyHost); err != nil {
			refuse(w, http.StatusMisdirectedRequest, err.Error())
			return
		}
		check := o.CrossSite == CheckEvery || o.CrossSite == CheckWrites && r.Method != http.MethodGet && r.Method != http.MethodHead
		if check {
			if err := CheckSameOrigin(r); err != nil {
				refuse(w, http.StatusForbidden, err.Error())
				return
			}
		}
		next.ServeHTTP(w, r)
	})
}

// Bound is the address a server listening on ln for configured (a flag's
// HOST:PORT) answers to: configured's host (a name stays a name) with
// ln's port (":0" picked one).
func Bound(configured string, ln net.Listener) string {
	host, _, err := net.SplitHostPort(configured)
	_, port, perr := net.SplitHostPort(ln.Addr().String())
	if err != nil || perr != nil {
		return ln.Addr().String()
	}
	return net.JoinHostPort(host, port)
}

// CheckHost returns nil when r's Host names the server listening on addr
// ("" for r's local address), else an error that names the Host seen and
// those accepted. A Host without a port names port 80.
func CheckHost(r *http.Request, addr string, anyHost bool) error {
	if addr == "" || wildcard(addr) && !anyHost {
		local, ok := r.Context().Value(http.LocalAddrContextKey).(net.Addr)
		if !ok {
			return fmt.Errorf("request for Host %q: the server's own address is unknown, so no Host is accepted", r.Host)
		}
		addr = local.String()
	}
	lhost, lport, err := net.SplitHostPort(addr)
	if err != nil {
		return fmt.Errorf("request for Host %q: the server's address %q is not HOST:PORT", r.Host, addr)
	}
	if anyHost && wildcard(addr) {
		return nil
	}
	host, port := splitHost(r.Host)
	switch {
	case port != lport:
	case loopback(lhost) && loopback(host):
		return nil
	case strings.EqualFold(host, strings.Trim(lhost, "[]")):
		return nil
	}
	accepted := net.JoinHostPort(lhost, lport)
	if loopback(lhost) {
		accepted = fmt.Sprintf("a loopback name with port %s (localhost:%[1]s, 127.0.0.1:%[1]s, [::1]:%[1]s)", lport)
	}
	return fmt.Errorf("request for Host %q, and this server answers only %s: open it by that address (a Host naming another site is how DNS rebinding reaches a local server)", r.Host, accepted)
}

// splitHost splits a Host header into its name (no brackets) and port
// ("80" when it has none).
func splitHost(h string) (host, port string) {
	if host, port, err := net.SplitHostPort(h); err == nil {
		return host, port
	}
	return strings.Trim(h, "[]"), "80"
}

// wildcard reports whether addr's host is empty or an unspecified IP.
func wildcard(addr string) bool {
	host, _, err := net.SplitHostPort(addr)
	if err != nil {
		return false
	}
	ip := net.ParseIP(host)
	return host == "" || ip != nil && ip.IsUnspecified()
}

// loopback reports whether host is localhost or a loopback IP.
func loopback(host string) bool {
	if strings.EqualFold(host, "localhost") {
		return true
	}
	ip := net.ParseIP(strings.Trim(host, "[]"))
	return ip != nil && ip.IsLoopback()
}

// CheckSameOrigin returns nil unless a browser sent r for another
// origin's page: an Origin whose host is not r's Host (Origin: null
// included), or Sec-Fetch-Site other than same-origin and none, except
// for a link followed to a page (GET or HEAD, Sec-Fetch-Mode: navigate),
// which reads nothing back for the other site.
func CheckSameOrigin(r *http.Request) error {
	if o := r.Header.Get("Origin"); o != "" {
		u, err := url.Parse(o)
		if err != nil || u.Host == "" || !sameHost(u, r.Host) {
			return fmt.Errorf("a request from the page of %q, and this server answers only its own pages (%s) without a token: cross-site requests are refused", o, r.Host)
		}
	}
	switch site := r.Header.Get("Sec-Fetch-Site"); site {
	case "", "same-origin", "none":
	default:
		if (r.Method == http.MethodGet || r.Method == http.MethodHead) && r.Header.Get("Sec-Fetch-Mode") == "navigate" {
			return nil
		}
		return fmt.Errorf("a request from another site's page (Sec-Fetch-Site: %s), and this server answers only its own pages (%s) without a token: cross-site requests are refused", site, r.Host)
	}
	return nil
}

// sameHost reports whether origin u names host (a Host header), default
// ports included.
func sameHost(u *url.URL, host string) bool {
	oh, op := u.Hostname(), u.Port()
	if op == "" {
		op = map[string]string{"http": "80", "https": "443"}[u.Scheme]
	}
	h, p := splitHost(host)
	if _, _, err := net.SplitHostPort(host); err != nil && u.Scheme == "https" {
		p = "443"
	}
	return strings.EqualFold(oh, h) && op == p
}

// Timeouts of NewServer: a request's headers must arrive within
// ReadHeaderTimeout and the whole request within ReadTimeout; a
// keep-alive connection idle for IdleTimeout is closed.
const (
	ReadHeaderTimeout = 10 * time.Second
	ReadTimeout       = time.Minute
	IdleTimeout       = 2 * time.Minute
)

// NewServer returns the server of h: NewServer's timeouts, and write,
// from the end of a request's headers to the end of its answer (longer
// than the longest a handler holds a request). Its own errors go to log
// at warning level (nil: the log package's default logger).
func NewServer(h http.Handler, write time.Duration, log *slog.Logger) *http.Server {
	srv := &http.Server{Handler: h, ReadHeaderTimeout: ReadHeaderTimeout, ReadTimeout: ReadTimeout,
		WriteTimeout: write, IdleTimeout: IdleTimeout}
	if log != nil {
		srv.ErrorLog = slog.NewLogLogger(log.Handler(), slog.LevelWarn)
	}
	return srv
}
