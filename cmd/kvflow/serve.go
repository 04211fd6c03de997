package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"io/fs"
	"log/slog"
	"net"
	"net/http"
	"net/http/pprof"
	"strings"
	"sync/atomic"
	"syscall"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/collectors"
	"github.com/prometheus/client_golang/prometheus/promhttp"

	"github.com/kvflow/kvflow/hw/npu"
	"github.com/kvflow/kvflow/internal/cli/clierr"
	"github.com/kvflow/kvflow/internal/config"
	"github.com/kvflow/kvflow/internal/control"
	"github.com/kvflow/kvflow/internal/decode"
	"github.com/kvflow/kvflow/internal/node"
	"github.com/kvflow/kvflow/internal/prefill"
)

func runServe(ctx context.Context, args []string, stdout, stderr io.Writer) error {
	fs := newFlagSet("serve")
	printConfig := fs.Bool("print-config", false, "print the effective configuration (defaults < file < flags) and exit")
	cfg, err := config.Parse(args, fs)
	if err != nil {
		if errors.Is(err, flag.ErrHelp) {
			printHelp(fs, stdout)
			return err
		}
		return usageError{err}
	}
	if err := clierr.ArgsLeft(fs, args); err != nil {
		return err
	}
	// --print-config shows only a configuration serve would run: an
	// invalid one is reported (exit 2), not printed.
	if err := cfg.Validate(); err != nil {
		if f := fs.Lookup("config"); f != nil && f.Value.String() == "" {
			// Most likely a first run: say where a working file is.
			return usageError{fmt.Errorf("invalid configuration:\n%w\n(no --config given: start from deploy/examples/prefill.json or decode.json, or see kvflow serve --help)", err)}
		}
		return usageError{fmt.Errorf("invalid configuration:\n%w", err)}
	}
	if *printConfig {
		return cfg.Print(stdout)
	}
	log, err := newLogger(stderr, cfg.Log.Level, cfg.Log.Format)
	if err != nil {
		return err
	}
	logStartup(log, cfg)
	return serve(ctx, cfg, log, stdout)
}

// logStartup logs, once, what an operator must know before the first
// request: kv_connector_extra_config keys kvflow ignores, and for a decode
// worker which prefill ranks and side-channel ports it will dial.
func logStartup(log *slog.Logger, cfg config.Config) {
	if keys := cfg.KVTransfer.KVConnectorExtraConfig.UnknownExtraKeys(); len(keys) > 0 {
		log.Warn("kv_connector_extra_config keys other than prefill and decode are ignored by kvflow (other plugins' settings)", "keys", keys)
	}
	if cfg.Role() != config.Decode {
		return
	}
	ranks, err := prefillPeers(cfg)
	if err != nil {
		log.Warn("cannot list the prefill ranks this worker needs", "err", err)
		return
	}
	log.Info("prefill ranks this decode rank reads from: each must be running, its side channel at the request's remote_port (the prefill instance's kv_port, plus dp_rank*tp*pp*pcp) plus its rank",
		"prefill_ranks", ranks, "ports", describePeers(cfg, ranks))
}

// serve runs one worker until ctx ends, then shuts it down in two phases.
func serve(ctx context.Context, cfg config.Config, log *slog.Logger, stdout io.Writer) error {
	reg := prometheus.NewRegistry()
	reg.MustRegister(collectors.NewGoCollector(), collectors.NewProcessCollector(collectors.ProcessCollectorOpts{}))
	raiseNoFile(log)

	// The control socket is this worker's identity: a live worker holding
	// it is a second copy of this one (exit 2); a dead one's is taken
	// over. Held until everything below is closed, then the socket file
	// is removed.
	sockLock, err := control.LockSocket(cfg.ControlEndpoint())
	if err != nil {
		if errors.Is(err, control.ErrInUse) {
			return usageError{err}
		}
		return err
	}
	defer func() {
		if err := sockLock.Release(); err != nil {
			log.Warn("control socket files not removed", "err", err)
		}
	}()

	// The HTTP endpoint first: a port in use is a configuration error
	// found before anything else is started.
	var ready atomic.Bool
	// debug holds the role's /debug/... handlers once the node is up.
	var debugPeers, debugKV atomic.Pointer[http.Handler]
	var httpSrv *http.Server
	var metricsAddr string
	if cfg.Node.MetricsAddr != "" {
		ln, err := net.Listen("tcp", cfg.Node.MetricsAddr)
		if err != nil {
			return usageError{fmt.Errorf("node.metrics_addr %s: %w", cfg.Node.MetricsAddr, err)}
		}
		metricsAddr = ln.Addr().String()
		mux := http.NewServeMux()
		mux.Handle("/metrics", promhttp.HandlerFor(reg, promhttp.HandlerOpts{Registry: reg}))
		mux.HandleFunc("/healthz", func(w http.ResponseWriter, r *http.Request) { io.WriteString(w, "ok\n") })
		mux.HandleFunc("/readyz", func(w http.ResponseWriter, r *http.Request) {
			if !ready.Load() {
				http.Error(w, "not ready\n", http.StatusServiceUnavailable)
				return
			}
			io.WriteString(w, "ready\n")
		})
		mux.Handle("/debug/peers", debugHandler("/debug/peers", "decode", cfg.Role().String(), &debugPeers))
		mux.Handle("/debug/kv", debugHandler("/debug/kv", "prefill", cfg.Role().String(), &debugKV))
		if !cfg.Node.Pprof {
			mux.HandleFunc("/debug/pprof/", pprofOff)
		}
		if cfg.Node.Pprof {
			mux.HandleFunc("/debug/pprof/", pprof.Index)
			mux.HandleFunc("/debug/pprof/cmdline", pprof.Cmdline)
			mux.HandleFunc("/debug/pprof/profile", pprof.Profile)
			mux.HandleFunc("/debug/pprof/symbol", pprof.Symbol)
			mux.HandleFunc("/debug/pprof/trace", pprof.Trace)
		}
		httpSrv = newHTTPServer(mux)
		go httpSrv.Serve(newLimitListener(ln, cfg.Node.Limits.HTTPMaxConns, reg))
		defer httpSrv.Close()
	}

	n, err := node.Start(cfg, node.Deps{Registerer: reg, Logger: log})
	if err != nil {
		// A port already taken or a cache file that is not this worker's
		// is the operator's to fix: exit 2, as for a bad config.
		if isConfigProblem(err) {
			return usageError{err}
		}
		return err
	}
	ctl, err := control.Serve(ctx, n.ZMQ, cfg.ControlEndpoint(), backend(n), n.Curve)
	if err != nil {
		closeCtx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		defer cancel()
		n.Close(closeCtx)
		return err
	}
	if n.Peers != nil {
		var h http.Handler = n.Peers
		debugPeers.Store(&h)
	}
	if n.Prefill != nil {
		var h http.Handler = n.Prefill
		debugKV.Store(&h)
	}
	ready.Store(true)
	// One line on stdout that launchers (the demo, tests) can read.
	fmt.Fprintf(stdout, "kvflow ready role=%s control=%s handshake_port=%d te_session=%s metrics=%s\n",
		cfg.Role(), cfg.ControlEndpoint(), cfg.HandshakePort(), n.Engine.SessionID(), metricsAddr)
	log.Info("serving", "control", cfg.ControlEndpoint(), "metrics", metricsAddr)

	<-ctx.Done()
	ready.Store(false)
	drain := cfg.Shutdown.DrainTimeout.D()
	log.Info("shutting down: draining in-flight requests", "deadline", drain)
	dctx, cancel := context.WithTimeout(context.Background(), drain)
	defer cancel()
	// A prefill worker refuses new sends from now on and keeps its side
	// channel (GET_META, DONE, RENEW), its transfer engine and its control
	// socket serving until every held request is DONE'd, aborted or
	// force-freed and the engine collected it — or the deadline passes —
	// so that a rolling restart fails no request a decode is reading.
	if n.Prefill != nil {
		log.Info("draining: new sends refused; serving reads and DONEs of the held requests", "held", n.Prefill.Status()["held"])
		if err := n.Prefill.Drain(dctx, collectWait); err != nil {
			log.Warn("drain deadline passed: the requests still held will fail on their decode", "err", err)
		} else {
			log.Info("drained: no request held")
		}
	}
	// Phase one and two: the decode pipeline stops intake, drains until the
	// deadline, then cancels what is left (each such request still ends,
	// as failed). The control socket keeps answering meanwhile so the
	// engine can collect the results; it closes with the side channel.
	var errs []error
	if n.Decode != nil {
		if err := n.Decode.Close(dctx); err != nil {
			log.Warn("drain deadline passed; remaining requests canceled", "err", err)
		}
		// Give the engine one poll interval to collect the last results.
		waitCollected(n.Decode, collectWait)
	}
	_ = ctl
	// The pipeline's drain error (deadline passed) was logged above: the
	// canceled requests were reported, which is the shutdown contract.
	if err := n.Close(dctx); err != nil && !errors.Is(err, context.DeadlineExceeded) {
		errs = append(errs, err)
	}
	log.Info("stopped")
	return errors.Join(errs...)
}

// collectWait is how long a stopping worker waits, once its last request
// ended, for the engine to collect the results with a finished poll (an
// engine polls every step: milliseconds).
const collectWait = 2 * time.Second

func waitCollected(w *decode.Worker, max time.Duration) {
	deadline := time.Now().Add(max)
	for time.Now().Before(deadline) {
		s := w.Status()
		if s.PendingDone+s.PendingFailed == 0 {
			return
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// backend exposes a node's role on the control socket.
func backend(n *node.Node) control.Backend {
	b := control.Backend{Role: n.Config.Role().String()}
	switch {
	case n.Decode != nil:
		w := n.Decode
		b.Load = w.Load
		b.Abort = w.Abort
		b.Finished = func() ([]string, []string, []decode.Failure) {
			done, failed := w.Finished()
			return nil, done, failed
		}
		b.Status = func() map[string]any {
			s := w.Status()
			return map[string]any{"in_flight": s.InFlight, "pending_done": s.PendingDone, "pending_failed": s.PendingFailed,
				"dropped_results": s.DroppedResults, "cached_peers": s.CachedPeers}
		}
	case n.Prefill != nil:
		w := n.Prefill
		b.Send = func(reqs []prefill.SendRequest) []error { return w.Send(reqs) }
		b.Abort = w.Abort
		b.Finished = func() ([]string, []string, []decode.Failure) { return w.Finished(), nil, nil }
		b.Status = w.Status
	}
	return b
}

func isConfigProblem(err error) bool {
	if errors.Is(err, syscall.EADDRINUSE) || errors.Is(err, npu.ErrBadFile) || errors.Is(err, npu.ErrInUse) || errors.Is(err, fs.ErrExist) {
		return true
	}
	msg := strings.ToLower(err.Error())
	return strings.Contains(msg, "address already in use") || strings.Contains(msg, "address in use")
}

// debugHandler serves path with the handler h holds once the worker has
// started; before that, or on a worker of a role other than servedBy, it
// answers 404 saying which.
func debugHandler(path, servedBy, role string, h *atomic.Pointer[http.Handler]) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if hp := h.Load(); hp != nil {
			(*hp).ServeHTTP(w, r)
			return
		}
		if role != servedBy {
			http.Error(w, fmt.Sprintf("%s: served by %s workers only; this one is %s\n", path, servedBy, role), http.StatusNotFound)
			return
		}
		http.Error(w, fmt.Sprintf("%s: not served yet (the worker is starting)\n", path), http.StatusNotFound)
	})
}

// pprofOff answers /debug/pprof/ when the profiler is off.
func pprofOff(w http.ResponseWriter, r *http.Request) {
	http.Error(w, "/debug/pprof/: off; start the worker with --pprof (node.pprof: true)\n", http.StatusNotFound)
}
