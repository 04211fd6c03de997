package prefill

// SendRequest tells the worker a request's blocks are held for decode
// (the seed's requests_to_send entry).
type SendRequest struct {
	RequestID string `msgpack:"request_id" json:"request_id"`
	// DelayStartTime is when the scheduler started holding the blocks, in
	// seconds since the Unix epoch (the seed's time.time()); 0 means now.
	DelayStartTime float64 `msgpack:"delay_start_time" json:"delay_start_time"`
	// BlockIDs are this worker's block ids of the request. Optional (the
	// seed does not send them); needed for read grants and for the DONE
	// count of split (PCP/DCP) transfers.
	BlockIDs []int `msgpack:"block_ids" json:"block_ids"`
}
