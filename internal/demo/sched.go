package demo

import (
	"time"

	"github.com/kvflow/kvflow/internal/decode"
	"github.com/kvflow/kvflow/internal/prefill"
)

// The scheduler side of the seed's connector, reduced to what a driver
// needs: the prefill scheduler's request_finished (hold the blocks, hand
// out kv_transfer_params), the decode scheduler's update_state_after_alloc
// (remember the local blocks) and build_connector_meta on both sides (the
// batches a step hands its workers).

type prefillScheduler struct {
	engineID, host string
	port           int // the instance's side_channel_port
	pcp, dcp       int
	toSend         []prefill.SendRequest
}

// requestFinished is called when prefill of a request ends: its blocks
// stay allocated until the workers report it finished sending.
func (s *prefillScheduler) requestFinished(id string, blocks []int, now time.Time) decode.KVTransferParams {
	s.toSend = append(s.toSend, prefill.SendRequest{
		RequestID: id, BlockIDs: blocks,
		DelayStartTime: float64(now.UnixNano()) / 1e9,
	})
	return decode.KVTransferParams{
		RemoteBlockIDs: blocks, RemoteEngineID: s.engineID, RemoteHost: s.host,
		RemotePort: s.port, RemotePCPSize: s.pcp, RemoteDCPSize: s.dcp,
	}
}

func (s *prefillScheduler) buildConnectorMeta() []prefill.SendRequest {
	out := s.toSend
	s.toSend = nil
	return out
}

type decodeScheduler struct {
	toRecv []decode.LoadRequest
}

func (s *decodeScheduler) updateStateAfterAlloc(id string, localBlocks []int, params decode.KVTransferParams) {
	s.toRecv = append(s.toRecv, decode.LoadRequest{RequestID: id, LocalBlockIDs: localBlocks, Params: params})
}

func (s *decodeScheduler) buildConnectorMeta() []decode.LoadRequest {
	out := s.toRecv
	s.toRecv = nil
	return out
}
