package demo

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"io"
	"math/rand/v2"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"time"

	zmq "github.com/pebbe/zmq4"

	"github.com/kvflow/kvflow/hw/npu"
	"github.com/kvflow/kvflow/internal/config"
	"github.com/kvflow/kvflow/stages/plan"
)

// Options configures a demo run.
type Options struct {
	Exe       string // the kvflow binary (os.Executable)
	Requests  int
	MinBlocks int
	MaxBlocks int
	PrefillTP int
	DecodeTP  int
	Model     config.Model
	Seed      uint64
	Timeout   time.Duration
	Workdir   string // "" = a new temp dir, removed at the end
	Progress  io.Writer
	Out       io.Writer
	LogLevel  string
}

// Presets of model shapes.
func Presets() map[string]config.Model {
	return map[string]config.Model{
		// Llama-3-8B: 32 layers, 8 KV heads of 128, bf16.
		"llama": {NumLayers: 32, NumKVHeads: 8, HeadDim: 128, BlockSize: 128, DType: "bf16", NumBlocks: 64},
		// DeepSeek-V2/V3-like MLA: kv_lora_rank 512, rope 64 (61 layers
		// trimmed to 24 to keep the demo's memory small).
		"mla": {NumLayers: 24, NumKVHeads: 1, BlockSize: 128, DType: "bf16", NumBlocks: 64, MLA: true, KVLoraRank: 512, QKRopeHeadDim: 64},
	}
}

type worker struct {
	name    string
	cfg     config.Config
	cmd     *exec.Cmd
	exited  chan error
	logPath string
	metrics string
	ctl     *ctlClient
	cache   *npu.Host
	rank    int // DeviceIndex (prefill) or tp rank (decode)
}

// Run runs the demo.
func Run(ctx context.Context, o Options) (*Summary, error) {
	if o.Requests <= 0 || o.MinBlocks <= 0 || o.MaxBlocks < o.MinBlocks {
		return nil, fmt.Errorf("demo: requests %d, blocks %d..%d: want requests > 0 and 0 < min <= max", o.Requests, o.MinBlocks, o.MaxBlocks)
	}
	if o.MaxBlocks > o.Model.NumBlocks {
		return nil, fmt.Errorf("demo: max blocks per request %d exceeds num_blocks %d", o.MaxBlocks, o.Model.NumBlocks)
	}
	dir := o.Workdir
	if dir == "" {
		d, err := os.MkdirTemp("", "kvflow-demo-")
		if err != nil {
			return nil, err
		}
		dir = d
		defer os.RemoveAll(d)
	}
	shmDir, err := os.MkdirTemp("/dev/shm", "kvflow-demo-")
	if err != nil {
		shmDir = filepath.Join(dir, "shm") // no /dev/shm: files in the work dir
		os.MkdirAll(shmDir, 0o700)
	}
	defer os.RemoveAll(shmDir)

	zctx, err := zmq.NewContext()
	if err != nil {
		return nil, err
	}
	defer zctx.Term()

	d := &driver{o: o, dir: dir, shm: shmDir, zctx: zctx, rng: rand.New(rand.NewPCG(o.Seed, 1))}
	defer d.stop()
	if err := d.start(ctx); err != nil {
		return nil, err
	}
	ctx, cancel := context.WithTimeout(ctx, o.Timeout)
	defer cancel()
	return d.run(ctx)
}

type driver struct {
	o       Options
	dir     string
	shm     string
	zctx    *zmq.Context
	rng     *rand.Rand
	prefill []*worker
	decode  []*worker
	all     []*worker
	kvPort  int
	topo    plan.Topology
}

func (d *driver) workerConfig(role config.Role, rank, kvPort int) config.Config {
	c := config.Example(role)
	kv := &c.KVTransfer
	kv.KVConnectorExtraConfig.Prefill = config.Parallel{TPSize: d.o.PrefillTP, DPSize: 1, PPSize: 1}
	kv.KVConnectorExtraConfig.Decode = config.Parallel{TPSize: d.o.DecodeTP, DPSize: 1, PPSize: 1}
	kv.KVPort = config.Port(kvPort)
	c.Model = d.o.Model
	c.Rank = config.Rank{TP: rank}
	name := fmt.Sprintf("%s%d", map[config.Role]string{config.Prefill: "p", config.Decode: "d"}[role], rank)
	c.Cache = config.Cache{Mode: config.CacheShm, Path: filepath.Join(d.shm, name+".kv"), NoHugePages: true}
	c.Node.Control = "ipc://" + filepath.Join(d.dir, name+".sock")
	c.Node.MetricsAddr = "127.0.0.1:0"
	c.Log = config.Log{Level: d.o.LogLevel, Format: "json"}
	c.Shutdown.DrainTimeout = config.Duration(10 * time.Second)
	return c
}

// freePorts finds n consecutive free TCP ports on loopback.
func freePorts(n int) (int, error) {
	for range 50 {
		base := 20000 + rand.IntN(30000)
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
	return 0, errors.New("demo: no free port range on loopback")
}

func (d *driver) start(ctx context.Context) error {
	base, err := freePorts(d.o.PrefillTP)
	if err != nil {
		return err
	}
	d.kvPort = base
	for r := range d.o.PrefillTP {
		w, err := d.launch(ctx, d.workerConfig(config.Prefill, r, base))
		if err != nil {
			return err
		}
		w.rank = plan.DeviceIndex(w.cfg.Topology().Prefill, w.cfg.Self())
		d.prefill = append(d.prefill, w)
	}
	for r := range d.o.DecodeTP {
		w, err := d.launch(ctx, d.workerConfig(config.Decode, r, base+1000))
		if err != nil {
			return err
		}
		w.rank = r
		d.decode = append(d.decode, w)
	}
	d.topo = d.decode[0].cfg.Topology()
	d.topo.Prefill.KVPort = base
	return nil
}

func (d *driver) launch(ctx context.Context, cfg config.Config) (*worker, error) {
	if err := cfg.Validate(); err != nil {
		return nil, fmt.Errorf("demo: worker config: %w", err)
	}
	name := strings.TrimSuffix(filepath.Base(cfg.Cache.Path), ".kv")
	w := &worker{name: name, cfg: cfg, logPath: filepath.Join(d.dir, name+".log"), exited: make(chan error, 1)}
	cfgPath := filepath.Join(d.dir, name+".json")
	f, err := os.Create(cfgPath)
	if err != nil {
		return nil, err
	}
	if err := cfg.Print(f); err != nil {
		f.Close()
		return nil, err
	}
	f.Close()
	logf, err := os.Create(w.logPath)
	if err != nil {
		return nil, err
	}
	defer logf.Close()
	w.cmd = exec.Command(d.o.Exe, "serve", "--config", cfgPath)
	w.cmd.Stderr = logf
	out, err := w.cmd.StdoutPipe()
	if err != nil {
		return nil, err
	}
	w.cmd.SysProcAttr = &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL}
	if err := w.cmd.Start(); err != nil {
		return nil, fmt.Errorf("demo: start %s: %w", name, err)
	}
	ready := make(chan string, 1)
	go func() {
		sc := bufio.NewScanner(out)
		for sc.Scan() {
			if line := sc.Text(); strings.HasPrefix(line, "kvflow ready") {
				ready <- line
			}
		}
	}()
	go func() { w.exited <- w.cmd.Wait() }()
	d.all = append(d.all, w) // stop() reaps it whatever happens next
	select {
	case line := <-ready:
		for _, f := range strings.Fields(line) {
			if v, ok := strings.CutPrefix(f, "metrics="); ok {
				w.metrics = v
			}
		}
	case err := <-w.exited:
		w.exited <- err
		return nil, fmt.Errorf("demo: %s exited before it was ready (%v); its log:\n%s", name, err, tail(w.logPath))
	case <-time.After(30 * time.Second):
		w.cmd.Process.Kill()
		return nil, fmt.Errorf("demo: %s not ready after 30s; its log:\n%s", name, tail(w.logPath))
	case <-ctx.Done():
		return nil, ctx.Err()
	}
	w.ctl = newCtlClient(d.zctx, cfg.Node.Control, 10*time.Second)
	shape, _ := cfg.Shape()
	w.cache, err = npu.OpenShm(cfg.Cache.Path, npu.HostOptions{NoHugePages: true, Expect: &shape})
	if err != nil {
		return nil, fmt.Errorf("demo: attach %s cache: %w", name, err)
	}
	return w, nil
}

func tail(path string) string {
	b, _ := os.ReadFile(path)
	if len(b) > 4000 {
		b = b[len(b)-4000:]
	}
	return string(b)
}

// stop terminates every worker (SIGTERM: two-phase shutdown), waits, and
// kills what does not exit.
func (d *driver) stop() {
	for _, w := range d.all {
		if w.ctl != nil {
			w.ctl.close()
		}
		if w.cache != nil {
			w.cache.Close()
		}
		w.cmd.Process.Signal(syscall.SIGTERM)
	}
	for _, w := range d.all {
		select {
		case <-w.exited:
		case <-time.After(20 * time.Second):
			w.cmd.Process.Kill()
			<-w.exited
		}
	}
}
