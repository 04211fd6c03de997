package demo

import (
	"context"
	"fmt"
	"io"
	"math/rand/v2"
	"os"
	"path/filepath"
	"strings"
	"time"

	"github.com/kvflow/kvflow/hw/npu"
	"github.com/kvflow/kvflow/internal/config"
	"github.com/kvflow/kvflow/internal/workers"
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
	// TEBackend is every worker's node.te_backend ("" = the default, tcp).
	// With shm the demo also fails unless the decode workers read over
	// shared memory and never fell back to the network.
	TEBackend string
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
	*workers.Worker
	cfg   config.Config
	cache *npu.Host
	ctl   *workers.Client
	name  string
	rank  int // DeviceIndex (prefill) or tp rank (decode)
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
	shmDir, err := workers.ShmDir("kvflow-demo-", dir)
	if err != nil {
		return nil, err
	}
	defer os.RemoveAll(shmDir)

	set, err := workers.NewSet(o.Exe, dir)
	if err != nil {
		return nil, err
	}
	// Stops every worker on every return, also when ctx is cancelled.
	defer set.Close()

	d := &driver{o: o, dir: dir, shm: shmDir, set: set, rng: rand.New(rand.NewPCG(o.Seed, 1))}
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
	set     *workers.Set
	rng     *rand.Rand
	prefill []*worker
	decode  []*worker
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
	if d.o.TEBackend != "" {
		c.Node.TEBackend = d.o.TEBackend
	}
	c.Log = config.Log{Level: d.o.LogLevel, Format: "json"}
	c.Shutdown.DrainTimeout = config.Duration(10 * time.Second)
	return c
}

func (d *driver) start(ctx context.Context) error {
	base, err := workers.FreePorts(d.o.PrefillTP)
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
	w, err := d.set.Launch(ctx, workers.Spec{Name: name, Config: cfg})
	if err != nil {
		return nil, fmt.Errorf("demo: %w", err)
	}
	return &worker{Worker: w, cfg: cfg, cache: w.Cache, ctl: w.Ctl, name: name}, nil
}
