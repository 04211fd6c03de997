// Package workers launches `kvflow serve` processes for drivers on one
// machine — the demo and `kvflow bench e2e`: it writes each worker's
// config file, starts the process (in its own process group, killed if the
// driver dies), waits for its "kvflow ready" line, attaches its
// shared-memory cache, talks to its control socket and scrapes its
// /metrics. Set.Close stops every worker it started (SIGTERM, then SIGKILL
// to the process group after StopTimeout) — drivers defer it, so workers
// are stopped on every return, also when ctx is cancelled (Ctrl-C).
package workers

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"time"

	zmq "github.com/pebbe/zmq4"
	dto "github.com/prometheus/client_model/go"
	"github.com/prometheus/common/expfmt"
	"github.com/prometheus/common/model"

	"github.com/kvflow/kvflow/hw/npu"
	"github.com/kvflow/kvflow/internal/config"
)

// Set is the workers of one driver run.
type Set struct {
	// Exe is the kvflow binary (os.Executable()).
	Exe string
	// Dir holds the config files, logs and ipc control sockets.
	Dir string
	// ReadyTimeout bounds a worker's start (default 30s); StopTimeout
	// how long Close waits after SIGTERM before it kills (default 20s).
	ReadyTimeout, StopTimeout time.Duration
	// ZMQ is the context of the control clients.
	ZMQ *zmq.Context

	mu      sync.Mutex
	all     []*Worker
	clients []*Client
	closed  bool
}

// NewSet makes a set whose workers run exe and keep their files in dir.
func NewSet(exe, dir string) (*Set, error) {
	zctx, err := zmq.NewContext()
	if err != nil {
		return nil, err
	}
	return &Set{Exe: exe, Dir: dir, ZMQ: zctx}, nil
}

// Spec is one worker to launch.
type Spec struct {
	// Name names its files: <Dir>/<Name>.json, .log.
	Name   string
	Config config.Config
	// Command builds the process from the binary and its arguments; nil
	// is exec.Command (network shaping runs it through `ip netns exec`).
	Command func(name string, args ...string) *exec.Cmd
	// Dial reaches the worker's metrics address; nil dials from here.
	Dial func(ctx context.Context, network, addr string) (net.Conn, error)
}

// Worker is one running `kvflow serve`.
type Worker struct {
	Name    string
	Config  config.Config
	LogPath string
	// Metrics is the host:port of its /metrics (from its ready line).
	Metrics string
	// Ctl is a control client for the driver's main goroutine; make more
	// with Set.Client for other goroutines.
	Ctl *Client
	// Cache is its shared-memory cache, attached (shm caches only).
	Cache *npu.Host

	cmd    *exec.Cmd
	exited chan struct{}
	err    error // Wait's, once exited is closed
	http   *http.Client
}

// Pid is the worker's process id.
func (w *Worker) Pid() int { return w.cmd.Process.Pid }

// Exited is closed when the process has exited.
func (w *Worker) Exited() <-chan struct{} { return w.exited }

// Err is the process's exit error (exec.Cmd.Wait's) once Exited is
// closed: nil for exit 0.
func (w *Worker) Err() error {
	<-w.exited
	return w.err
}

// ShmDir makes a directory for shm cache files under /dev/shm (or, with
// no /dev/shm, under fallback); the caller removes it.
func ShmDir(prefix, fallback string) (string, error) {
	if d, err := os.MkdirTemp("/dev/shm", prefix); err == nil {
		return d, nil
	}
	d := filepath.Join(fallback, "shm")
	return d, os.MkdirAll(d, 0o700)
}

// FreePorts finds n consecutive free TCP ports on loopback, in
// [10000, 30000): below Linux's default ephemeral range (32768–60999), so
// that between this check and the worker's bind neither a :0 bind nor the
// local end of an outgoing connection can take one (with room for a +1000
// offset).
func FreePorts(n int) (int, error) {
	for range 50 {
		base := 10000 + rand.IntN(20000-n)
		ok := true
		var ls []net.Listener
		for i := range n {
			l, err := net.Listen("tcp", net.JoinHostPort("127.0.0.1", strconv.Itoa(base+i)))
			if err != nil {
				ok = false
				break
			}
			ls = append(ls, l)
		}
		for _, l := range ls {
			l.Close()
		}
		if ok {
			return base, nil
		}
	}
	return 0, errors.New("workers: no free port range on loopback")
}

// Launch writes spec's config, starts the worker and waits until it is
// ready. The set owns it from the moment it starts: Close stops it even
// when Launch fails.
func (s *Set) Launch(ctx context.Context, spec Spec) (*Worker, error) {
	cfg := spec.Config
	if err := cfg.Validate(); err != nil {
		return nil, fmt.Errorf("workers: %s config: %w", spec.Name, err)
	}
	name := spec.Name
	w := &Worker{Name: name, Config: cfg, LogPath: filepath.Join(s.Dir, name+".log"), exited: make(chan struct{})}
	cfgPath := filepath.Join(s.Dir, name+".json")
	f, err := os.Create(cfgPath)
	if err != nil {
		return nil, err
	}
	if err := cfg.Print(f); err != nil {
		f.Close()
		return nil, err
	}
	f.Close()
	logf, err := os.Create(w.LogPath)
	if err != nil {
		return nil, err
	}
	defer logf.Close()
	command := spec.Command
	if command == nil {
		command = exec.Command
	}
	w.cmd = command(s.Exe, "serve", "--config", cfgPath)
	w.cmd.Stderr = logf
	out, err := w.cmd.StdoutPipe()
	if err != nil {
		return nil, err
	}
	// Its own process group: a terminal's Ctrl-C reaches only the driver,
	// which stops the workers in order; a kill reaches all of the group.
	// Pdeathsig: a driver that dies takes its workers with it.
	w.cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true, Pdeathsig: syscall.SIGKILL}
	s.mu.Lock()
	if s.closed {
		s.mu.Unlock()
		return nil, errors.New("workers: set closed")
	}
	if err := w.cmd.Start(); err != nil {
		s.mu.Unlock()
		return nil, fmt.Errorf("workers: start %s: %w", name, err)
	}
	s.all = append(s.all, w) // Close reaps it whatever happens next
	s.mu.Unlock()
	ready := make(chan string, 1)
	go func() {
		sc := bufio.NewScanner(out)
		for sc.Scan() {
			if line := sc.Text(); strings.HasPrefix(line, "kvflow ready") {
				select {
				case ready <- line:
				default:
				}
			}
		}
	}()
	go func() {
		w.err = w.cmd.Wait()
		close(w.exited)
	}()
	rt := s.ReadyTimeout
	if rt <= 0 {
		rt = 30 * time.Second
	}
	timer := time.NewTimer(rt)
	defer timer.Stop()
	select {
	case line := <-ready:
		for _, f := range strings.Fields(line) {
			if v, ok := strings.CutPrefix(f, "metrics="); ok {
				w.Metrics = v
			}
		}
	case <-w.exited:
		return nil, fmt.Errorf("workers: %s exited before it was ready (%v); its log:\n%s", name, w.err, Tail(w.LogPath))
	case <-timer.C:
		return nil, fmt.Errorf("workers: %s not ready after %v; its log:\n%s", name, rt, Tail(w.LogPath))
	case <-ctx.Done():
		return nil, context.Cause(ctx)
	}
	tr := &http.Transport{DialContext: spec.Dial, DisableCompression: true}
	w.http = &http.Client{Timeout: 10 * time.Second, Transport: tr}
	w.Ctl = s.Client(w, 10*time.Second)
	if cfg.Cache.Mode == config.CacheShm {
		shape, _ := cfg.Shape()
		w.Cache, err = npu.OpenShm(cfg.Cache.Path, npu.HostOptions{NoHugePages: true, NoLock: true, Expect: &shape})
		if err != nil {
			return nil, fmt.Errorf("workers: attach %s cache: %w", name, err)
		}
	}
	return w, nil
}

// Client is a new control client of w, for one goroutine; Close closes it.
func (s *Set) Client(w *Worker, timeout time.Duration) *Client {
	c := NewClient(s.ZMQ, w.Config.ControlEndpoint(), timeout)
	s.mu.Lock()
	s.clients = append(s.clients, c)
	s.mu.Unlock()
	return c
}

// Scrape fetches the worker's metric families.
func (w *Worker) Scrape(ctx context.Context) ([]*dto.MetricFamily, error) {
	if w.Metrics == "" {
		return nil, fmt.Errorf("%s: no metrics endpoint", w.Name)
	}
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, "http://"+w.Metrics+"/metrics", nil)
	if err != nil {
		return nil, err
	}
	resp, err := w.http.Do(req)
	if err != nil {
		return nil, err
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		return nil, fmt.Errorf("metrics %s: %s", w.Metrics, resp.Status)
	}
	p := expfmt.NewTextParser(model.UTF8Validation)
	mfs, err := p.TextToMetricFamilies(resp.Body)
	if err != nil {
		return nil, err
	}
	out := make([]*dto.MetricFamily, 0, len(mfs))
	for _, mf := range mfs {
		out = append(out, mf)
	}
	return out, nil
}

// Tail is the last 4000 bytes of a log file.
func Tail(path string) string {
	b, _ := os.ReadFile(path)
	if len(b) > 4000 {
		b = b[len(b)-4000:]
	}
	return string(b)
}

// Close stops every worker (SIGTERM to its process group: two-phase
// shutdown), waits StopTimeout, kills the groups of those still running,
// closes the control clients and caches and terminates the ZMQ context.
// It is safe to call more than once.
func (s *Set) Close() {
	s.mu.Lock()
	if s.closed {
		s.mu.Unlock()
		return
	}
	s.closed = true
	all, clients := s.all, s.clients
	s.mu.Unlock()
	for _, c := range clients {
		c.Close()
	}
	for _, w := range all {
		if w.Cache != nil {
			w.Cache.Close()
		}
		signalGroup(w.cmd.Process.Pid, syscall.SIGTERM)
	}
	st := s.StopTimeout
	if st <= 0 {
		st = 20 * time.Second
	}
	deadline := time.Now().Add(st)
	for _, w := range all {
		t := time.NewTimer(max(0, time.Until(deadline)))
		select {
		case <-w.exited:
		case <-t.C:
			signalGroup(w.cmd.Process.Pid, syscall.SIGKILL)
			<-w.exited
		}
		t.Stop()
		// Whatever the worker left in its group goes with it.
		syscall.Kill(-w.cmd.Process.Pid, syscall.SIGKILL)
	}
	s.ZMQ.Term()
}

func signalGroup(pid int, sig syscall.Signal) {
	if err := syscall.Kill(-pid, sig); err != nil {
		syscall.Kill(pid, sig)
	}
}
