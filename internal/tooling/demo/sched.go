package demo

import (
	"time"

	"github.com/kvflow/kvflow/internal/decode"
	"github.com/kvflow/kvflow/internal/prefill"
	"github.com/kvflow/kvflow/internal/sched"
)

// The scheduler side of the connector, as the demo's engine loop calls
// it: thin adapters over internal/sched (the seed's rules, shared with
// the Python connector's kvflow.scheduler and tested on the same cases)
// to the control socket's request types.

type prefillScheduler struct{ rules sched.Rules }

func newPrefillScheduler(engineID, host string, port int) *prefillScheduler {
	return &prefillScheduler{rules: sched.Rules{EngineID: engineID, Host: host, Port: port, BlockSize: 1}}
}

// requestFinished is called when prefill of a request ends (length capped
// at its one token, as a prefill instance's requests are): its blocks stay
// allocated until the workers report it finished sending.
func (s *prefillScheduler) requestFinished(id string, blocks []int, now time.Time) decode.KVTransferParams {
	s.rules.Clock = func() float64 { return float64(now.UnixNano()) / 1e9 }
	_, h := s.rules.RequestFinished(&sched.Request{ID: id, Params: map[string]any{"do_remote_decode": true},
		PromptLen: len(blocks), OutputTokenIDs: []int{0}, Status: sched.StatusLengthCapped}, blocks)
	return decode.KVTransferParams{
		RemoteBlockIDs: h.RemoteBlockIDs, RemoteEngineID: h.RemoteEngineID, RemoteHost: h.RemoteHost,
		RemotePort: h.RemotePort, RemotePCPSize: h.RemotePCPSize, RemoteDCPSize: h.RemoteDCPSize,
		BootEpochs: signed(h.BootEpochs),
	}
}

// signed is kvflow_boot_epochs as the control socket's params carry them.
func signed(e []uint64) []int64 {
	if e == nil {
		return nil
	}
	out := make([]int64, len(e))
	for i, v := range e {
		out[i] = int64(v) // boot epochs are unix nanoseconds: below 2^63
	}
	return out
}

func (s *prefillScheduler) buildConnectorMeta() []prefill.SendRequest {
	var out []prefill.SendRequest
	for _, x := range s.rules.BuildMeta().Sends {
		out = append(out, prefill.SendRequest{RequestID: x.RequestID, DelayStartTime: x.DelayStartTime, BlockIDs: x.BlockIDs})
	}
	return out
}

type decodeScheduler struct{ rules sched.Rules }

func newDecodeScheduler() *decodeScheduler {
	return &decodeScheduler{rules: sched.Rules{BlockSize: 1}}
}

// updateStateAfterAlloc is the decode scheduler's path for a request that
// arrives with the prefill's params: matched tokens, allocation (local),
// update_state_after_alloc. The demo counts one token per block.
func (s *decodeScheduler) updateStateAfterAlloc(id string, local []int, p decode.KVTransferParams) {
	r := &sched.Request{ID: id, PromptLen: len(local), Params: map[string]any{
		"do_remote_prefill": true, "do_remote_decode": false, "remote_block_ids": p.RemoteBlockIDs,
		"remote_engine_id": p.RemoteEngineID, "remote_host": p.RemoteHost, "remote_port": p.RemotePort,
		"remote_pcp_size": p.RemotePCPSize, "remote_dcp_size": p.RemoteDCPSize,
	}}
	if p.BootEpochs != nil {
		r.Params["kvflow_boot_epochs"] = p.BootEpochs
	}
	n, _, _ := s.rules.MatchedTokens(r, 0) // never fails: BlockSize 1
	_ = s.rules.AfterAlloc(r, local, n)    // never fails: remote blocks present
}

func (s *decodeScheduler) buildConnectorMeta() []decode.LoadRequest {
	var out []decode.LoadRequest
	for _, x := range s.rules.BuildMeta().Recvs {
		out = append(out, decode.LoadRequest{RequestID: x.RequestID, LocalBlockIDs: x.LocalBlockIDs, Params: decode.KVTransferParams{
			RemoteBlockIDs: x.RemoteBlockIDs, RemoteEngineID: x.RemoteEngineID, RemoteHost: x.RemoteHost,
			RemotePort: x.RemotePort, RemotePCPSize: x.RemotePCPSize, RemoteDCPSize: x.RemoteDCPSize,
			BootEpochs: x.BootEpochs,
		}})
	}
	return out
}

// finishedRecving is update_connector_output: these loads ended.
func (s *decodeScheduler) finishedRecving(ids []string) { s.rules.FinishedRecving(ids) }
