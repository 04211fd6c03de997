package sched

import (
	"fmt"
	"math"
	"slices"
	"time"
)

// Request is what the scheduler sees of an engine request. Params is the
// request's kv_transfer_params as decoded from JSON or msgpack (nil when
// absent); AfterAlloc and RequestFinished set its do_remote_prefill to
// false, as the seed does.
type Request struct {
	ID             string
	Params         map[string]any
	PromptLen      int
	OutputTokenIDs []int
	Status         string // vLLM's RequestStatus name
}

// StatusLengthCapped is vLLM's FINISHED_LENGTH_CAPPED: the prefill's
// max_tokens=1 ending, the only one handed to a decode instance.
const StatusLengthCapped = "FINISHED_LENGTH_CAPPED"

// Recv is one request to pull (the seed's ReqMeta).
type Recv struct {
	RequestID      string
	LocalBlockIDs  []int
	RemoteBlockIDs []int
	RemoteEngineID string
	RemoteHost     string
	RemotePort     int
	RemotePCPSize  int
	RemoteDCPSize  int
	// BootEpochs is kvflow's kvflow_boot_epochs from the params (nil
	// without it); an entry that is not a whole number >= 0 is -1, which
	// the decode worker refuses naming the field.
	BootEpochs []int64
}

// Send is one request whose blocks are held for decode since
// DelayStartTime (seconds since the epoch); BlockIDs are the held blocks.
type Send struct {
	RequestID      string
	DelayStartTime float64
	BlockIDs       []int
}

// Meta is what one scheduler step hands the workers, in queue order.
type Meta struct {
	Recvs   []Recv
	Sends   []Send
	ToAbort []string
}

// Handover is the kv_transfer_params a finished prefill hands the router:
// the seed's keys, in the seed's order, with its types.
type Handover struct {
	DoRemotePrefill bool   `json:"do_remote_prefill" msgpack:"do_remote_prefill"`
	DoRemoteDecode  bool   `json:"do_remote_decode" msgpack:"do_remote_decode"`
	RemoteBlockIDs  []int  `json:"remote_block_ids" msgpack:"remote_block_ids"`
	RemoteEngineID  string `json:"remote_engine_id" msgpack:"remote_engine_id"`
	RemoteHost      string `json:"remote_host" msgpack:"remote_host"`
	RemotePort      int    `json:"remote_port" msgpack:"remote_port"`
	RemotePCPSize   int    `json:"remote_pcp_size" msgpack:"remote_pcp_size"`
	RemoteDCPSize   int    `json:"remote_dcp_size" msgpack:"remote_dcp_size"`
	LastTokenID     int    `json:"last_token_id" msgpack:"last_token_id"`
	// BootEpochs is kvflow's optional extra key, after the seed's nine:
	// Rules.BootEpochs when set (absent otherwise, so the params are the
	// seed's exactly). A seed decode ignores it.
	BootEpochs []uint64 `json:"kvflow_boot_epochs,omitempty" msgpack:"kvflow_boot_epochs,omitempty"`
}

// Rules is one instance's scheduler-side state. Set the exported fields,
// then call the methods from the scheduler loop.
type Rules struct {
	EngineID  string
	Host      string // side_channel_host
	Port      int    // side_channel_port (SideChannelPort)
	BlockSize int
	PCPSize   int // 0 means 1
	DCPSize   int // 0 means 1
	// Clock gives delay_start_time; nil means time.Now.
	Clock func() float64
	// BootEpochs, when set, are this instance's prefill ranks' boot
	// epochs (entry r: the rank at Port + r, from its worker's status;
	// 0 where unknown), handed over as kvflow_boot_epochs so a decode
	// fails a request whose rank has restarted since instead of reading
	// the new process's blocks. Refresh it when a rank restarts.
	BootEpochs []uint64

	recv     []queued
	send     []Send
	loading  map[string]bool
	toAbort  []string
	heldSend map[string]bool
}

type queued struct {
	req   *Request
	local []int
}

// SideChannelPort is the seed's handshake base port of an instance:
// kv_port + dp_rank·tp·pp·pcp.
func SideChannelPort(kvPort, dpRank, tp, pp, pcp int) int {
	return kvPort + dpRank*tp*pp*max(pcp, 1)
}

// MatchedTokens is get_num_new_matched_tokens.
func (s *Rules) MatchedTokens(r *Request, computed int) (int, bool, error) {
	if r.Params != nil && truthy(r.Params["do_remote_prefill"]) {
		if s.BlockSize <= 0 || computed%s.BlockSize != 0 {
			return 0, false, fmt.Errorf("request %s: num_computed_tokens %d is not a multiple of block_size %d", r.ID, computed, s.BlockSize)
		}
		n := max(r.PromptLen-computed, 0)
		return n, n > 0, nil
	}
	return 0, false, nil
}

// AfterAlloc is update_state_after_alloc; unhashed are the blocks the
// engine allocated for the external tokens.
func (s *Rules) AfterAlloc(r *Request, unhashed []int, external int) error {
	p := r.Params
	if p == nil || !truthy(p["do_remote_prefill"]) {
		return nil
	}
	if truthy(p["remote_block_ids"]) {
		if complete(p) {
			local := []int{}
			if external > 0 {
				local = append(local, unhashed...)
			}
			s.queue(r, local)
		}
	} else if external != 0 {
		return fmt.Errorf("request %s: %d external tokens but no remote_block_ids", r.ID, external)
	}
	p["do_remote_prefill"] = false
	return nil
}

func complete(p map[string]any) bool {
	for _, k := range []string{"remote_engine_id", "remote_host", "remote_port"} {
		if _, ok := p[k]; !ok {
			return false
		}
	}
	return true
}

// queue adds or replaces r's receive, keeping the first insertion's place
// (a Python dict's order).
func (s *Rules) queue(r *Request, local []int) {
	for i := range s.recv {
		if s.recv[i].req.ID == r.ID {
			s.recv[i] = queued{r, local}
			return
		}
	}
	s.recv = append(s.recv, queued{r, local})
}

func (s *Rules) unqueue(id string) bool {
	for i := range s.recv {
		if s.recv[i].req.ID == id {
			s.recv = append(s.recv[:i], s.recv[i+1:]...)
			return true
		}
	}
	return false
}

// BuildMeta is build_connector_meta: it hands over and clears the queues.
func (s *Rules) BuildMeta() Meta {
	var m Meta
	for _, q := range s.recv {
		p := q.req.Params
		m.Recvs = append(m.Recvs, Recv{
			RequestID: q.req.ID, LocalBlockIDs: q.local, RemoteBlockIDs: ints(p["remote_block_ids"]),
			RemoteEngineID: str(p["remote_engine_id"]), RemoteHost: str(p["remote_host"]),
			RemotePort: num(p["remote_port"], 0), RemotePCPSize: num(p["remote_pcp_size"], 1),
			RemoteDCPSize: num(p["remote_dcp_size"], 1), BootEpochs: epochs(p["kvflow_boot_epochs"]),
		})
		if len(q.local) > 0 {
			if s.loading == nil {
				s.loading = map[string]bool{}
			}
			s.loading[q.req.ID] = true
		}
	}
	s.recv = nil
	m.Sends, s.send = s.send, nil
	m.ToAbort, s.toAbort = s.toAbort, nil
	return m
}

// FinishedRecving records loads the workers reported ended (done or failed).
func (s *Rules) FinishedRecving(ids []string) {
	for _, id := range ids {
		delete(s.loading, id)
	}
}

// RequestFinished is request_finished: whether the blocks' free is
// delayed, and the params to hand the router (nil: none).
func (s *Rules) RequestFinished(r *Request, blocks []int) (bool, *Handover) {
	p := r.Params
	if s.loading[r.ID] {
		delete(s.loading, r.ID)
		s.toAbort = append(s.toAbort, r.ID)
		return false, nil
	}
	queued := s.unqueue(r.ID)
	if p != nil && (truthy(p["do_remote_prefill"]) || queued) {
		if truthy(p["remote_block_ids"]) && complete(p) {
			s.queue(r, []int{})
		}
		p["do_remote_prefill"] = false
		return false, nil
	}
	if p == nil || !truthy(p["do_remote_decode"]) || r.Status != StatusLengthCapped {
		return false, nil
	}
	if blocks == nil {
		blocks = []int{}
	}
	delay := len(blocks) > 0
	if delay {
		s.send = append(s.send, Send{RequestID: r.ID, DelayStartTime: s.now(), BlockIDs: blocks})
	}
	last := 0
	if n := len(r.OutputTokenIDs); n > 0 {
		last = r.OutputTokenIDs[n-1]
	}
	return delay, &Handover{
		DoRemotePrefill: true, RemoteBlockIDs: blocks, RemoteEngineID: s.EngineID, RemoteHost: s.Host,
		RemotePort: s.Port, RemotePCPSize: max(s.PCPSize, 1), RemoteDCPSize: max(s.DCPSize, 1), LastTokenID: last,
		BootEpochs: s.handedEpochs(),
	}
}

// handedEpochs is a copy of BootEpochs to hand over, nil when none is
// known (all 0): then the params are the seed's exactly.
func (s *Rules) handedEpochs() []uint64 {
	if !slices.ContainsFunc(s.BootEpochs, func(e uint64) bool { return e != 0 }) {
		return nil
	}
	return slices.Clone(s.BootEpochs)
}

func (s *Rules) now() float64 {
	if s.Clock != nil {
		return s.Clock()
	}
	return float64(time.Now().UnixNano()) / 1e9
}

// Params returns a Handover as the map a decode request carries
// (kv_transfer_params), for handing it to another Rules.
func (h *Handover) Params() map[string]any {
	p := map[string]any{
		"do_remote_prefill": h.DoRemotePrefill, "do_remote_decode": h.DoRemoteDecode,
		"remote_block_ids": append([]int(nil), h.RemoteBlockIDs...), "remote_engine_id": h.RemoteEngineID,
		"remote_host": h.RemoteHost, "remote_port": h.RemotePort, "remote_pcp_size": h.RemotePCPSize,
		"remote_dcp_size": h.RemoteDCPSize, "last_token_id": h.LastTokenID,
	}
	if len(h.BootEpochs) > 0 {
		p["kvflow_boot_epochs"] = slices.Clone(h.BootEpochs)
	}
	return p
}

// truthy is Python's truth value for decoded JSON/msgpack values.
func truthy(v any) bool {
	switch x := v.(type) {
	case nil:
		return false
	case bool:
		return x
	case string:
		return x != ""
	case int:
		return x != 0
	case int64:
		return x != 0
	case uint64:
		return x != 0
	case float64:
		return x != 0
	case []any:
		return len(x) > 0
	case []int:
		return len(x) > 0
	case map[string]any:
		return len(x) > 0
	}
	return true
}

func ints(v any) []int {
	switch x := v.(type) {
	case []int:
		return append([]int(nil), x...)
	case []any:
		out := make([]int, 0, len(x))
		for _, e := range x {
			out = append(out, num(e, 0))
		}
		return out
	}
	return nil
}

func num(v any, def int) int {
	switch x := v.(type) {
	case int:
		return x
	case int64:
		return int(x)
	case uint64:
		return int(x)
	case float64:
		return int(x)
	}
	return def
}

// epochs reads kvflow_boot_epochs as decoded from JSON or msgpack: nil
// when absent or nil; an entry that is not a whole number >= 0 (or a list
// that is not one) gives -1 entries, which the decode worker refuses
// naming the field rather than this pure state machine erroring.
func epochs(v any) []int64 {
	switch x := v.(type) {
	case nil:
		return nil
	case []uint64:
		out := make([]int64, len(x))
		for i, e := range x {
			out[i] = -1
			if e <= math.MaxInt64 {
				out[i] = int64(e)
			}
		}
		return out
	case []int64:
		return slices.Clone(x)
	case []any:
		out := make([]int64, len(x))
		for i, e := range x {
			out[i] = -1
			switch n := e.(type) {
			case int:
				out[i] = max(int64(n), -1)
			case int64:
				out[i] = max(n, -1)
			case uint64:
				if n <= math.MaxInt64 {
					out[i] = int64(n)
				}
			case float64:
				if n >= 0 && n <= math.MaxInt64 && n == math.Trunc(n) {
					out[i] = int64(n)
				}
			}
		}
		return out
	}
	return []int64{-1}
}

func str(v any) string {
	if s, ok := v.(string); ok {
		return s
	}
	return ""
}
