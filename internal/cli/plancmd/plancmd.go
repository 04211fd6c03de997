package plancmd

import (
	"context"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"slices"
	"strings"

	"github.com/kvflow/kvflow/hw/npu"
	"github.com/kvflow/kvflow/internal/cli/clierr"
	"github.com/kvflow/kvflow/internal/cli/flaghelp"
	"github.com/kvflow/kvflow/internal/config"
	"github.com/kvflow/kvflow/stages/plan"
)

// placeholderEngineID stands in for a missing kv_transfer_config.engine_id:
// planning never uses it, and an operator checking a topology from flags
// alone should not have to invent one.
const placeholderEngineID = "plan"

// options are plan's own flags (the configuration's are config's).
type options struct {
	requestID      string
	local, remote  blockList
	remotePort     int
	remoteHost     string
	remoteEngineID string
	remotePCP      int
	remoteDCP      int
	decodeRank     int
	json           bool
}

func (o *options) register(fs *flag.FlagSet) {
	fs.StringVar(&o.requestID, "request-id", "", "request id (decides the rank choice); required")
	fs.Var(&o.local, "local-blocks", `decode-side block `+"`ids`"+`, e.g. "0,1,2" or "0-127"; required ("" = full prefix hit)`)
	fs.Var(&o.remote, "remote-blocks", "prefill-side block `ids` (default: the local blocks)")
	fs.IntVar(&o.remotePort, "remote-port", 0, "prefill replica's side-channel base port, kv_transfer_params.remote_port (default: kv_port of a prefill configuration)")
	fs.StringVar(&o.remoteHost, "remote-host", "", "prefill host (default: node.side_channel_host of a prefill configuration, else 127.0.0.1)")
	fs.StringVar(&o.remoteEngineID, "remote-engine-id", "", "prefill engine id (default: engine_id of a prefill configuration)")
	fs.IntVar(&o.remotePCP, "remote-pcp", 0, "request's remote_pcp_size, 0 = the prefill instance's pcp_size")
	fs.IntVar(&o.remoteDCP, "remote-dcp", 0, "request's remote_dcp_size, 0 = the prefill instance's dcp_size")
	fs.IntVar(&o.decodeRank, "decode-rank", -1, "plan only this decode rank: its device index pcp_rank*decode_tp + tp_rank (default: every rank)")
	fs.BoolVar(&o.json, "json", false, "print JSON instead of a table")
}

// Run is `kvflow plan`: it builds the P/D configuration from args (config
// flags and/or --config FILE), validates it, plans the request given by
// plan's flags on every decode rank (or --decode-rank) and prints the plan
// as a table, or as JSON with --json. Bad flags, an invalid configuration
// and a request that cannot be planned are *clierr.UsageError; -h returns
// flag.ErrHelp.
func Run(ctx context.Context, args []string, stdout, stderr io.Writer) error {
	fs := flag.NewFlagSet("kvflow plan", flag.ContinueOnError)
	var o options
	o.register(fs)
	// The flag package would print the whole (long) flag list after every
	// parse error; print it for -h only, and leave errors to the caller.
	fs.SetOutput(io.Discard)
	cfg, err := config.Parse(args, fs)
	if errors.Is(err, flag.ErrHelp) {
		printUsage(fs, stdout)
		return err
	}
	if err != nil {
		return clierr.Usage(err)
	}
	if err := clierr.ArgsLeft(fs, args); err != nil {
		return err
	}
	rep, err := build(cfg, o)
	if err != nil {
		return err
	}
	if o.json {
		enc := json.NewEncoder(stdout)
		enc.SetIndent("", "  ")
		return enc.Encode(rep)
	}
	return writeTable(stdout, rep)
}

// planFlags are plan's own flags, configFlags the configuration's that
// change a plan (every other serve flag is accepted and ignored), both in
// the order -h lists them.
var (
	planFlags   = []string{"request-id", "local-blocks", "remote-blocks", "remote-port", "remote-host", "remote-engine-id", "remote-pcp", "remote-dcp", "decode-rank", "json"}
	configFlags = []string{config.ConfigFlag, "kv-transfer-config", "role", "engine-id", "kv-port", "side-channel-host",
		"prefill-tp", "prefill-dp", "prefill-pp", "prefill-pcp", "prefill-dcp",
		"decode-tp", "decode-dp", "decode-pp", "decode-pcp", "decode-dcp",
		"layers", "kv-heads", "head-dim", "block-size", "dtype", "num-blocks",
		"mla", "kv-lora-rank", "qk-rope-head-dim", "sparse", "indexer-dim", "pp-layer-partition", "decode-pp-layer-partition"}
)

func printUsage(fs *flag.FlagSet, w io.Writer) {
	fmt.Fprint(w, "usage: kvflow plan [--config FILE] [config flags] --request-id ID --local-blocks IDS [--remote-blocks IDS] [--remote-port N] [--decode-rank N] [--json]\n\n"+
		"Validates the P/D configuration and prints, for every decode rank, the tasks of one request:\n"+
		"remote ranks, handshake ports, layers, head slot, op count and bytes.\n\nflags:\n")
	flaghelp.Print(w, fs, planFlags...)
	fmt.Fprint(w, "\nconfiguration (flags override --config FILE):\n")
	flaghelp.Print(w, fs, configFlags...)
	fmt.Fprint(w, "\nThe other flags of 'kvflow serve' are accepted and do not change the plan (kvflow serve -h).\n")
}

// report is the printed plan (the JSON form of --json).
type report struct {
	RequestID      string       `json:"request_id"`
	RemoteHost     string       `json:"remote_host"`
	RemotePort     int          `json:"remote_port"`
	RemoteEngineID string       `json:"remote_engine_id"`
	RemotePCP      int          `json:"remote_pcp_size"`
	RemoteDCP      int          `json:"remote_dcp_size"`
	LocalBlockIDs  []int        `json:"local_block_ids"`
	RemoteBlockIDs []int        `json:"remote_block_ids"`
	Prefill        parallel     `json:"prefill"`
	Decode         parallel     `json:"decode"`
	Model          model        `json:"model"`
	Mode           string       `json:"mode"`
	P              int          `json:"tp_num_need_pulls"`
	Stitch         bool         `json:"stitch"`
	Ranks          []rankReport `json:"decode_ranks"`
	Ops            int          `json:"ops"`
	Bytes          uint64       `json:"bytes"`
	// KvflowOnly: decode tp > prefill tp or decode pp > 1, which only a
	// kvflow prefill instance serves; PrefillRanks then lists, per
	// prefill rank, the reads it serves for this request.
	KvflowOnly   bool            `json:"kvflow_only,omitempty"`
	PrefillRanks []prefillReport `json:"prefill_ranks,omitempty"`
}

// prefillReport is one prefill rank's side of the request (kvflow-only
// topologies): the decode ranks that read it, the DONEs it waits for
// (plan.PrefillExpectedDones) and the bytes it serves.
type prefillReport struct {
	Rank          int    `json:"rank"` // tp + pp*prefill_tp
	HandshakePort int    `json:"handshake_port"`
	Readers       []int  `json:"decode_readers"` // decode device indexes
	ExpectedDones int    `json:"expected_dones"`
	Bytes         uint64 `json:"bytes"`
}

type parallel struct {
	TP     int `json:"tp_size"`
	PP     int `json:"pp_size"`
	DP     int `json:"dp_size"`
	PCP    int `json:"pcp_size"`
	DCP    int `json:"dcp_size"`
	KVPort int `json:"kv_port,omitempty"`
}

type model struct {
	Kind       string `json:"kind"` // gqa, mla or sparse
	NumLayers  int    `json:"num_layers"`
	NumKVHeads int    `json:"num_kv_heads,omitempty"`
	// BlockLen is a decode rank's block_len list (bytes per block per part).
	BlockLen []int `json:"block_len"`
}

type rankReport struct {
	Index          int          `json:"index"` // (pp_rank+pcp_rank)*decode_tp + tp_rank
	TP             int          `json:"tp_rank"`
	PP             int          `json:"pp_rank,omitempty"`
	PCP            int          `json:"pcp_rank"`
	DCP            int          `json:"dcp_rank"`
	RemoteRanks    []int        `json:"remote_ranks"`
	HandshakePorts []int        `json:"handshake_ports"`
	Ops            int          `json:"ops"`
	Bytes          uint64       `json:"bytes"`
	Tasks          []taskReport `json:"tasks"`
}

type taskReport struct {
	RemoteRank     int    `json:"remote_rank"`
	HandshakePort  int    `json:"handshake_port"`
	Offset         int    `json:"offset"`
	HeadSlot       int    `json:"head_slot"`
	P              int    `json:"p"`
	PPStage        int    `json:"pp_stage"`
	LayerStart     int    `json:"layer_start"`
	LayerEnd       int    `json:"layer_end"`
	LocalBlockIDs  []int  `json:"local_block_ids"`
	RemoteBlockIDs []int  `json:"remote_block_ids"`
	Ops            int    `json:"ops"`
	Bytes          uint64 `json:"bytes"`
	Last           bool   `json:"last"`
	Stitch         bool   `json:"stitch"`
	HeadSplit      int    `json:"head_split,omitempty"` // > 1: reads slice HeadSlice of each token row
	HeadSlice      int    `json:"head_slice,omitempty"`
}

// build is the pure core of the command: configuration and options in,
// report out. Every error it returns is a usage error.
func build(cfg config.Config, o options) (*report, error) {
	// plan is a decode-side question: a configuration without kv_role is
	// read as the decode instance's, and a missing engine_id is not a
	// reason to refuse.
	if cfg.KVTransfer.KVRole == "" {
		cfg.KVTransfer.KVRole = config.KVConsumer
	}
	if cfg.KVTransfer.EngineID == "" {
		cfg.KVTransfer.EngineID = placeholderEngineID
	}
	if err := cfg.Validate(); err != nil {
		return nil, clierr.Usagef("invalid configuration:\n%w", err)
	}
	prefillCfg := cfg.Role() == config.Prefill

	var errs []error
	if o.requestID == "" {
		errs = append(errs, errors.New("--request-id: required"))
	}
	if !o.local.set {
		errs = append(errs, errors.New(`--local-blocks: required (e.g. "0,1,2"; "" for a full prefix hit)`))
	}
	remote := o.remote.ids
	if !o.remote.set {
		remote = o.local.ids
	}
	port, host, engine := o.remotePort, o.remoteHost, o.remoteEngineID
	if prefillCfg {
		if port == 0 {
			port = int(cfg.KVTransfer.KVPort)
		}
		if host == "" {
			host = cfg.Node.SideChannelHost
		}
		if engine == "" {
			engine = cfg.KVTransfer.EngineID
		}
	}
	if host == "" {
		host = "127.0.0.1"
	}
	switch {
	case port == 0 && !prefillCfg:
		errs = append(errs, errors.New("--remote-port: required with a decode configuration (its kv_port is the decode instance's)"))
	case port < 1 || port > 65535:
		errs = append(errs, fmt.Errorf("--remote-port: %d outside 1..65535", port))
	}
	if o.remotePCP < 0 {
		errs = append(errs, fmt.Errorf("--remote-pcp: negative (%d)", o.remotePCP))
	}
	if o.remoteDCP < 0 {
		errs = append(errs, fmt.Errorf("--remote-dcp: negative (%d)", o.remoteDCP))
	}
	topo := cfg.Topology()
	dtp, dpcp, ddcp, dpp := topo.Decode.TP, max(1, topo.Decode.PCP), max(1, topo.Decode.DCP), max(1, topo.Decode.PP)
	if o.decodeRank < -1 || o.decodeRank >= dtp*dpcp*dpp {
		errs = append(errs, fmt.Errorf("--decode-rank: %d outside [0, %d) (decode tp_size %d x pcp_size %d x pp_size %d)", o.decodeRank, dtp*dpcp*dpp, dtp, dpcp, dpp))
	}
	if len(errs) > 0 {
		return nil, &clierr.UsageError{Err: errors.Join(errs...)}
	}

	locals := make([]localCaches, dpp) // by decode PP stage
	for pp := range locals {
		var err error
		if locals[pp], err = decodeCaches(cfg, pp, !prefillCfg); err != nil {
			return nil, clierr.Usagef("decode pp stage %d cache layout: %w", pp, err)
		}
	}
	local := locals[0]
	layout := plan.CacheLayout{CachesPerLayer: local.layout.NumParts(), BlockSize: cfg.Model.BlockSize}
	for _, l := range local.layout.BlockLens() {
		layout.BlockLen = append(layout.BlockLen, uint64(l))
	}
	remoteCaches := map[int]plan.Caches{} // by prefill PP stage
	kvflowOnly := topo.NeedsKvflowPeer()
	served := map[int]*prefillReport{} // by prefill rank

	req := plan.Request{
		ID:             o.requestID,
		LocalBlockIDs:  o.local.ids,
		RemoteBlockIDs: remote,
		RemoteHost:     host,
		RemotePort:     port,
		RemoteEngineID: engine,
		RemotePCPSize:  cmp0(o.remotePCP, topo.Prefill.PCP),
		RemoteDCPSize:  cmp0(o.remoteDCP, topo.Prefill.DCP),
	}
	rep := &report{
		RequestID:      req.ID,
		RemoteHost:     host,
		RemotePort:     port,
		RemoteEngineID: engine,
		RemotePCP:      max(1, req.RemotePCPSize),
		RemoteDCP:      max(1, req.RemoteDCPSize),
		LocalBlockIDs:  nonNil(req.LocalBlockIDs),
		RemoteBlockIDs: nonNil(req.RemoteBlockIDs),
		Prefill:        toParallel(topo.Prefill),
		Decode:         toParallel(topo.Decode),
		Model:          toModel(cfg, local.layout),
		Ranks:          []rankReport{},
		KvflowOnly:     kvflowOnly,
	}
	dp := 0
	if !prefillCfg {
		dp = cfg.Rank.DP
	}
	for rank := range dtp * dpcp * dpp {
		tp, pcp, pp := rank%dtp, rank/dtp%dpcp, rank/dtp/dpcp
		{
			self := plan.Rank{TP: tp, PP: pp, PCP: pcp, DCP: tp % ddcp, DP: dp}
			idx := plan.DeviceIndex(topo.Decode, self)
			if o.decodeRank >= 0 && idx != o.decodeRank {
				continue
			}
			local := locals[pp]
			p, err := plan.PlanRequest(topo, self, req)
			if err != nil {
				return nil, &clierr.UsageError{Err: renameFields(fmt.Errorf("decode rank %d (tp %d, pp %d, pcp %d): %w", idx, tp, pp, pcp, err))}
			}
			rep.Mode, rep.P, rep.Stitch = modeName(p.Mode), p.P, p.Stitch
			rr := rankReport{Index: idx, TP: tp, PP: pp, PCP: pcp, DCP: self.DCP, RemoteRanks: []int{}, HandshakePorts: []int{}, Tasks: []taskReport{}}
			for _, t := range p.Tasks {
				rc, ok := remoteCaches[t.PPStage]
				if !ok {
					if rc, err = prefillCaches(cfg, t.PPStage, prefillCfg); err != nil {
						return nil, clierr.Usagef("prefill pp stage %d cache layout: %w", t.PPStage, err)
					}
					remoteCaches[t.PPStage] = rc
				}
				ops, err := plan.Ops(layout, t, local.caches, rc)
				if err != nil {
					return nil, &clierr.UsageError{Err: renameFields(fmt.Errorf("decode rank %d (tp %d, pcp %d), task to remote rank %d: %w", idx, tp, pcp, t.RemoteRank, err))}
				}
				var bytes uint64
				for _, op := range ops {
					bytes += op.Len
				}
				if !slices.Contains(rr.RemoteRanks, t.RemoteRank) {
					rr.RemoteRanks = append(rr.RemoteRanks, t.RemoteRank)
				}
				if !slices.Contains(rr.HandshakePorts, t.HandshakePort) {
					rr.HandshakePorts = append(rr.HandshakePorts, t.HandshakePort)
				}
				rr.Tasks = append(rr.Tasks, taskReport{
					RemoteRank: t.RemoteRank, HandshakePort: t.HandshakePort,
					Offset: t.Offset, HeadSlot: t.HeadSlot, P: t.P, PPStage: t.PPStage,
					LayerStart: t.LayerStart, LayerEnd: t.LayerEnd,
					LocalBlockIDs: nonNil(t.LocalBlockIDs), RemoteBlockIDs: nonNil(t.RemoteBlockIDs),
					Ops: len(ops), Bytes: bytes, Last: t.Last, Stitch: t.Stitch,
					HeadSplit: t.HeadSplit, HeadSlice: t.HeadSlice,
				})
				if kvflowOnly {
					pr := served[t.RemoteRank]
					if pr == nil {
						pr = &prefillReport{Rank: t.RemoteRank, HandshakePort: t.HandshakePort, Readers: []int{}}
						served[t.RemoteRank] = pr
					}
					if !slices.Contains(pr.Readers, idx) {
						pr.Readers = append(pr.Readers, idx)
					}
					pr.Bytes += bytes
				}
				rr.Ops += len(ops)
				rr.Bytes += bytes
			}
			rep.Ops += rr.Ops
			rep.Bytes += rr.Bytes
			rep.Ranks = append(rep.Ranks, rr)
		}
	}
	if kvflowOnly {
		// Every prefill rank, with the DONEs its tracker will wait for
		// (computed as the prefill side does, over all decode ranks).
		ptp := topo.Prefill.TP
		for r := range ptp * topo.Prefill.PP {
			pr := served[r]
			if pr == nil {
				pr = &prefillReport{Rank: r, HandshakePort: port + r, Readers: []int{}}
			}
			n, err := plan.PrefillExpectedDones(topo, plan.Rank{TP: r % ptp, PP: r / ptp}, req.ID, len(req.LocalBlockIDs))
			if err != nil {
				return nil, clierr.Usagef("prefill rank %d: %w", r, err)
			}
			pr.ExpectedDones = n
			rep.PrefillRanks = append(rep.PrefillRanks, *pr)
		}
	}
	return rep, nil
}

type localCaches struct {
	layout npu.Layout
	caches plan.Caches
}

// decodeCaches is a decode rank's layout and caches (PP stage pp's layers), addressed from 0 (the
// plan reports counts and bytes, not addresses). Block ids are checked
// against model.num_blocks only when the configuration is the decode
// instance's (checkBlocks).
func decodeCaches(cfg config.Config, pp int, checkBlocks bool) (localCaches, error) {
	cfg.KVTransfer.KVRole = config.KVConsumer
	cfg.Rank = config.Rank{PP: pp}
	s, err := cfg.Shape()
	if err != nil {
		return localCaches{}, err
	}
	l, err := npu.NewLayout(s)
	if err != nil {
		return localCaches{}, err
	}
	c := plan.Caches{Base: l.BaseAddrs(0)}
	if checkBlocks {
		c.NumBlocks = s.NumBlocks
	}
	return localCaches{l, c}, nil
}

// prefillCaches is the caches of a prefill worker of PP stage pp (its
// layers only), addressed from 0; block ids are checked against
// model.num_blocks only for a prefill configuration.
func prefillCaches(cfg config.Config, pp int, checkBlocks bool) (plan.Caches, error) {
	cfg.KVTransfer.KVRole = config.KVProducer
	cfg.Rank = config.Rank{PP: pp}
	s, err := cfg.Shape()
	if err != nil {
		return plan.Caches{}, err
	}
	l, err := npu.NewLayout(s)
	if err != nil {
		return plan.Caches{}, err
	}
	c := plan.Caches{Base: l.BaseAddrs(0)}
	if checkBlocks {
		c.NumBlocks = s.NumBlocks
	}
	return c, nil
}

// fieldNames maps package plan's request field names to plan's flags.
var fieldNames = strings.NewReplacer(
	"request.local_block_ids", "--local-blocks",
	"request.remote_block_ids", "--remote-blocks",
	"request.remote_port", "--remote-port",
	"request.remote_pcp_size", "--remote-pcp",
	"request.remote_dcp_size", "--remote-dcp",
	"local_block_ids", "--local-blocks",
	"remote_block_ids", "--remote-blocks",
)

// renamed is err with its message rewritten; the chain is kept.
type renamed struct {
	msg string
	err error
}

func (r *renamed) Error() string { return r.msg }
func (r *renamed) Unwrap() error { return r.err }

func renameFields(err error) error { return &renamed{fieldNames.Replace(err.Error()), err} }

func modeName(m plan.Mode) string {
	switch m {
	case plan.ModeTP:
		return "tp"
	case plan.ModePointToPoint:
		return "point-to-point"
	case plan.ModeSplit:
		return "split"
	}
	return m.String()
}

func toParallel(p plan.Parallel) parallel {
	return parallel{TP: p.TP, PP: p.PP, DP: p.DP, PCP: max(1, p.PCP), DCP: max(1, p.DCP), KVPort: p.KVPort}
}

func toModel(cfg config.Config, l npu.Layout) model {
	m := model{Kind: "gqa", NumLayers: cfg.Model.NumLayers, NumKVHeads: cfg.Model.NumKVHeads, BlockLen: l.BlockLens()}
	switch {
	case cfg.Model.Sparse:
		m.Kind, m.NumKVHeads = "sparse", 0
	case cfg.Model.MLA:
		m.Kind, m.NumKVHeads = "mla", 0
	}
	return m
}

// cmp0 is a, or b when a is 0.
func cmp0(a, b int) int {
	if a != 0 {
		return a
	}
	return b
}

func nonNil(s []int) []int {
	if s == nil {
		return []int{}
	}
	return s
}
