package main

import (
	"log/slog"
	"net"
	"net/http"
	"sync"
	"syscall"
	"time"

	"github.com/prometheus/client_golang/prometheus"
)

// newHTTPServer is the metrics/health server, bounded so that no client
// can hold its connections (or the process's descriptors) for ever:
// headers within 5 s, a whole request within 30 s, a keep-alive
// connection idle at most 2 min (Prometheus' default scrape interval is
// 1 min, so a scraper keeps its connection), headers of at most 64 KiB.
// There is no WriteTimeout: /debug/pprof/profile streams for as long as it
// is asked to.
func newHTTPServer(h http.Handler) *http.Server {
	return &http.Server{
		Handler:           h,
		ReadHeaderTimeout: 5 * time.Second,
		ReadTimeout:       30 * time.Second,
		IdleTimeout:       2 * time.Minute,
		MaxHeaderBytes:    64 << 10,
	}
}

// limitListener admits at most cap(sem) open connections; a connection
// beyond is reset at accept and counted, rather than left waiting in the
// backlog behind connections an outsider keeps open.
type limitListener struct {
	net.Listener
	sem     chan struct{}
	refused prometheus.Counter
}

func newLimitListener(ln net.Listener, max int, reg prometheus.Registerer) *limitListener {
	refused := prometheus.NewCounter(prometheus.CounterOpts{
		Name: "kvflow_http_connections_refused_total",
		Help: "Connections to the metrics endpoint closed at accept because node.limits.http_max_conns were open.",
	})
	if reg != nil {
		reg.MustRegister(refused)
	}
	return &limitListener{Listener: ln, sem: make(chan struct{}, max), refused: refused}
}

func (l *limitListener) Accept() (net.Conn, error) {
	for {
		c, err := l.Listener.Accept()
		if err != nil {
			return nil, err
		}
		select {
		case l.sem <- struct{}{}:
			return &limitConn{Conn: c, release: func() { <-l.sem }}, nil
		default:
		}
		if tc, ok := c.(*net.TCPConn); ok {
			tc.SetLinger(0)
		}
		c.Close()
		l.refused.Inc()
	}
}

// limitConn frees its slot once, on the first Close.
type limitConn struct {
	net.Conn
	once    sync.Once
	release func()
}

func (c *limitConn) Close() error {
	err := c.Conn.Close()
	c.once.Do(c.release)
	return err
}

// raiseNoFile raises the soft RLIMIT_NOFILE to the hard limit (Go's
// runtime already does so at start on Linux; this makes it explicit and
// logs both), so the transfer engine's descriptor reserve is taken from
// as large a budget as the operator allows.
func raiseNoFile(log *slog.Logger) {
	var rl syscall.Rlimit
	if err := syscall.Getrlimit(syscall.RLIMIT_NOFILE, &rl); err != nil {
		log.Warn("open files limit unknown", "err", err)
		return
	}
	soft := rl.Cur
	if rl.Cur < rl.Max {
		raised := rl
		raised.Cur = rl.Max
		if err := syscall.Setrlimit(syscall.RLIMIT_NOFILE, &raised); err != nil {
			log.Warn("open files limit: cannot raise the soft limit to the hard one", "soft", rl.Cur, "hard", rl.Max, "err", err)
		} else {
			rl = raised
		}
	}
	log.Info("open files limit", "soft", rl.Cur, "hard", rl.Max, "soft_before", soft)
}
