package benche2e

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/kvflow/kvflow/internal/config"
	"github.com/kvflow/kvflow/internal/decode"
	"github.com/kvflow/kvflow/internal/prefill"
	"github.com/kvflow/kvflow/internal/tooling/stagehist"
	"github.com/kvflow/kvflow/internal/tooling/workers"
)

// Net is an emulated link between a prefill and a decode network
// namespace (internal/tooling/netem's *Net): workers run inside through Command,
// decode reaches prefill at PrefillAddr (in userspace mode through the
// delay relays Relay starts for prefill's ports), and the driver reaches
// the workers' metrics through DialContext.
type Net interface {
	Describe() string
	PrefillNS() string
	DecodeNS() string
	PrefillAddr() string
	DecodeAddr() string
	Relay(ports ...int) error
	Command(ns, name string, args ...string) *exec.Cmd
	DialContext(ctx context.Context, ns, network, addr string) (net.Conn, error)
	Close() error
}

// Process runs the workers as `kvflow serve` processes.
type Process struct {
	// Exe is the kvflow binary.
	Exe string
	// Net, if set, puts prefill and decode in their namespaces.
	Net Net
	// LogLevel of the workers (their logs stay in the work dir while they
	// run); "" is warn.
	LogLevel string
}

// pollIdle is how long the poller sleeps after a round of finished
// calls that brought nothing.
const pollIdle = 100 * time.Microsecond

// proc drives `kvflow serve` workers through their control sockets, as
// the demo does: send on every prefill rank, load on every decode rank
// (ranks in parallel), and a poller calling finished on every decode rank
// (a request is done when each reported it, at the time of that reply).
// Caches are the workers' shm files, mapped here to fill and verify.
type proc struct {
	set     *workers.Set
	dir     string
	shm     string
	net     Net
	prefill []*workers.Worker
	decode  []*workers.Worker
	loaders []*workers.Client // per decode rank, used by load
	col     *collector

	mu    sync.Mutex
	bytes map[string]uint64 // per decode rank, by request id

	blockBytes uint64
	stop, done chan struct{}
}

func startProc(ctx context.Context, w Workload, o *Process, log *slog.Logger) (_ *cluster, err error) {
	_, local, pool := w.requests()
	dir, err := os.MkdirTemp("", "kvflow-bench-")
	if err != nil {
		return nil, err
	}
	shm, err := workers.ShmDir("kvflow-bench-", dir)
	if err != nil {
		os.RemoveAll(dir)
		return nil, err
	}
	set, err := workers.NewSet(o.Exe, dir)
	if err != nil {
		os.RemoveAll(shm)
		os.RemoveAll(dir)
		return nil, err
	}
	set.StopTimeout = 15 * time.Second
	be := &proc{set: set, dir: dir, shm: shm, net: o.Net, bytes: map[string]uint64{}, stop: make(chan struct{})}
	c := &cluster{w: w, host: "127.0.0.1", col: newCollector(), be: be}
	be.col = c.col
	defer func() {
		if err != nil {
			c.close()
		}
	}()
	// One free range: prefill handshake ports, prefill TE ports, decode
	// handshake ports. All fixed, so a relay can carry each.
	np, nd := w.PrefillTP, w.DecodeTP
	base, err := workers.FreePorts(2*np + nd)
	if err != nil {
		return nil, err
	}
	c.kvPort = base
	level := o.LogLevel
	if level == "" {
		level = "warn"
	}
	pHost, dHost := "127.0.0.1", "127.0.0.1"
	if o.Net != nil {
		pHost, dHost = o.Net.PrefillAddr(), o.Net.DecodeAddr()
		c.host = pHost
	}
	shape := func(cfg *config.Config, name, host string) {
		cfg.Cache = config.Cache{Mode: config.CacheShm, Path: filepath.Join(shm, name+".kv"), NoHugePages: true}
		cfg.Node.Control = "ipc://" + filepath.Join(dir, name+".sock")
		cfg.Node.MetricsAddr = "127.0.0.1:0"
		cfg.Node.SideChannelHost = host
		cfg.Log = config.Log{Level: level, Format: "json"}
		cfg.Shutdown.DrainTimeout = config.Duration(2 * time.Second)
	}
	spec := func(name string, cfg config.Config, ns string) workers.Spec {
		s := workers.Spec{Name: name, Config: cfg}
		if n := o.Net; n != nil {
			s.Command = func(name string, args ...string) *exec.Cmd { return n.Command(ns, name, args...) }
			s.Dial = func(ctx context.Context, network, addr string) (net.Conn, error) {
				return n.DialContext(ctx, ns, network, addr)
			}
		}
		return s
	}
	var pns, dns string
	if o.Net != nil {
		pns, dns = o.Net.PrefillNS(), o.Net.DecodeNS()
	}
	var relay []int
	for r := range np {
		cfg := w.config(config.Prefill, r, base, pool, local)
		name := fmt.Sprintf("p%d", r)
		shape(&cfg, name, pHost)
		if hp := cfg.HandshakePort(); hp < base || hp >= base+np {
			return nil, fmt.Errorf("prefill rank %d: handshake port %d outside %d..%d", r, hp, base, base+np-1)
		}
		relay = append(relay, cfg.HandshakePort())
		if cfg.Node.TEBackend != config.BackendMooncake { // Mooncake picks its RPC port (listenPorts finds it)
			cfg.Node.TEPort = base + np + r
			relay = append(relay, cfg.Node.TEPort)
		}
		wk, err := set.Launch(ctx, spec(name, cfg, pns))
		if err != nil {
			return nil, err
		}
		be.prefill = append(be.prefill, wk)
		c.prefill = append(c.prefill, rank{cfg: cfg, dev: wk.Cache})
		if o.Net != nil {
			// The engine's data port is its own pick: relay every port
			// the worker listens on (its namespace's /proc view).
			ports, err := listenPorts(wk.Pid())
			if err != nil {
				return nil, fmt.Errorf("%s: its listening ports: %w", name, err)
			}
			relay = append(relay, ports...)
		}
	}
	if o.Net != nil {
		if err := o.Net.Relay(relay...); err != nil {
			return nil, err
		}
	}
	for r := range nd {
		cfg := w.config(config.Decode, r, base, pool, local)
		cfg.KVTransfer.KVPort = config.Port(base + 2*np)
		name := fmt.Sprintf("d%d", r)
		shape(&cfg, name, dHost)
		wk, err := set.Launch(ctx, spec(name, cfg, dns))
		if err != nil {
			return nil, err
		}
		be.decode = append(be.decode, wk)
		be.loaders = append(be.loaders, set.Client(wk, time.Minute))
		c.decode = append(c.decode, rank{cfg: cfg, dev: wk.Cache})
	}
	be.blockBytes = c.decodeBlockBytes()
	pollers := make([]*workers.Client, nd)
	for k, wk := range be.decode {
		pollers[k] = set.Client(wk, 30*time.Second)
	}
	be.done = make(chan struct{})
	go be.poll(pollers)
	c.prepare()
	return c, nil
}

func (b *proc) describe() string {
	if b.net != nil {
		return fmt.Sprintf("kvflow serve processes, prefill in netns %s, decode in %s: %s", b.net.PrefillNS(), b.net.DecodeNS(), b.net.Describe())
	}
	return "kvflow serve processes on loopback, driven through their control sockets"
}

func (b *proc) send(ctx context.Context, reqs []prefill.SendRequest) error {
	for _, p := range b.prefill {
		for k := 0; k < len(reqs); k += 256 {
			if _, err := p.Ctl.Call(map[string]any{"op": "send", "requests": reqs[k:min(len(reqs), k+256)]}); err != nil {
				return fmt.Errorf("send on %s: %w", p.Name, err)
			}
		}
	}
	return nil
}

func (b *proc) load(ctx context.Context, reqs []decode.LoadRequest) error {
	b.mu.Lock()
	for _, r := range reqs {
		b.bytes[r.RequestID] = b.blockBytes * uint64(len(r.LocalBlockIDs))
	}
	b.mu.Unlock()
	if len(b.loaders) == 1 {
		return b.loadOn(0, reqs)
	}
	errs := make([]error, len(b.loaders))
	var wg sync.WaitGroup
	for k := range b.loaders {
		wg.Go(func() { errs[k] = b.loadOn(k, reqs) })
	}
	wg.Wait()
	return errors.Join(errs...)
}

func (b *proc) loadOn(k int, reqs []decode.LoadRequest) error {
	if _, err := b.loaders[k].Call(map[string]any{"op": "load", "requests": reqs}); err != nil {
		return fmt.Errorf("load on %s: %w", b.decode[k].Name, err)
	}
	return nil
}

// poll calls finished on every decode rank while requests are pending
// and hands the results to the collector.
func (b *proc) poll(clients []*workers.Client) {
	defer close(b.done)
	for {
		select {
		case <-b.stop:
			return
		default:
		}
		if b.col.outstanding() == 0 {
			time.Sleep(time.Millisecond)
			continue
		}
		progressed := false
		for k, cl := range clients {
			rep, err := cl.Call(map[string]any{"op": "finished"})
			if err != nil {
				b.col.failAll(fmt.Errorf("finished on %s: %w", b.decode[k].Name, err))
				continue
			}
			now := time.Now()
			b.mu.Lock()
			for _, id := range rep.DoneRecving {
				b.col.finish(id, b.bytes[id], nil, now)
				progressed = true
			}
			for _, f := range rep.FailedRecving {
				b.col.finish(f.RequestID, 0, errors.New(f.Reason), now)
				progressed = true
			}
			b.mu.Unlock()
		}
		if !progressed {
			time.Sleep(pollIdle)
		}
	}
}

func (b *proc) stages(ctx context.Context) stagehist.Set {
	out := stagehist.Set{}
	for _, d := range b.decode {
		if mfs, err := d.Scrape(ctx); err == nil {
			out.Add(mfs)
		}
	}
	return out
}

// drain empties the prefill ranks' finished lists and forgets the bytes
// of finished requests.
func (b *proc) drain(ctx context.Context) {
	for _, p := range b.prefill {
		p.Ctl.Call(map[string]any{"op": "finished"})
	}
	b.mu.Lock()
	clear(b.bytes)
	b.mu.Unlock()
}

func (b *proc) close() {
	close(b.stop)
	if b.done != nil {
		<-b.done
	}
	b.set.Close()
	os.RemoveAll(b.shm)
	os.RemoveAll(b.dir)
}

// listenPorts are the TCP ports process pid listens on in its network
// namespace (/proc/<pid>/net/tcp and tcp6, state 0A).
func listenPorts(pid int) ([]int, error) {
	var out []int
	for _, f := range []string{"tcp", "tcp6"} {
		b, err := os.ReadFile(fmt.Sprintf("/proc/%d/net/%s", pid, f))
		if err != nil {
			if f == "tcp6" {
				continue
			}
			return nil, err
		}
		for _, line := range strings.Split(string(b), "\n")[1:] {
			fs := strings.Fields(line)
			if len(fs) < 4 || fs[3] != "0A" {
				continue
			}
			_, hex, ok := strings.Cut(fs[1], ":")
			if !ok {
				continue
			}
			if p, err := strconv.ParseUint(hex, 16, 16); err == nil && !slices.Contains(out, int(p)) {
				out = append(out, int(p))
			}
		}
	}
	return out, nil
}
