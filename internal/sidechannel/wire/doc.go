// Package wire holds the pure encode/decode functions of kvflow's side
// channel, the ZMQ request/reply protocol of vllm-ascend's Mooncake connector
// (see package sidechannel for the sockets). It has no cgo, goroutines or I/O,
// so the pure parts of kvflow can use its types under CGO_ENABLED=0.
//
// # Wire format (byte-identical to the seed)
//
// Requests are one msgpack array each (the seed encodes a Python tuple):
//
//	GET_META      [bin "get_meta_msg", str ""]          92 c4 0c 6765745f6d6574615f6d7367 a0
//	DONE_RECVING  [bin "done_recving_msg", str req_id]
//
// The GET_META reply is msgspec's encoding of MooncakeAgentMetadata: a map
// with keys engine_id (str), te_rpc_port (int), kv_caches_base_addr (array of
// int), num_blocks (int), in that order, every header in its smallest form
// (fixint/uint8/16/32/64, fixstr/str8/16/32, fixarray/array16/32). The
// DONE_RECVING reply is the three raw bytes "ACK" (not msgpack).
//
// kvflow additions, all optional so the plain protocol still works:
//   - metadata field "kvflow" (a map: {"boot_epoch": uint, "lease_ttl_ms":
//     uint, "batch_done": true, "cache": map, "te_auth": bin, "same_host":
//     map}, each omitted when 0/false/nil) after the seed's four, omitted when empty (then kvflow's bytes equal the seed's, as
//     the seed's vectors check). A kvflow prefill worker always sets
//     boot_epoch, so its metadata carries the field; msgspec ignores
//     unknown fields, so seed peers accept it (tested with Python msgpack
//     and the seed's decoding rules, not with msgspec itself);
//   - "kvflow"."cache" (a map), the sender's cache fingerprint
//     (npu.Fingerprint): "kind" (str gqa|mla|sparse), "dtype" (str bf16,
//     fp16, fp32, int8, fp8), "block_size", then each non-zero of
//     "kv_heads", "head_dim", "kv_lora_rank", "qk_rope_head_dim",
//     "indexer_dim", then "layers", "block_len" (array, one uint per part:
//     2 for gqa and mla, 3 for sparse), "num_blocks", and, when stated,
//     "prefill" and "decode" ([tp, pp, pcp, dcp]) and "rank" ([tp, pp,
//     pcp]). kind, dtype, block_size, layers, block_len and num_blocks are
//     required; every integer lies in 0..MaxCacheValue (block_size,
//     layers, num_blocks and block_len entries from 1); anything else is
//     malformed, with the field named (kvflow.cache.block_size);
//     unknown keys are skipped. Golden bytes: TestMetadataCacheBytes;
//   - "kvflow"."te_auth" (bin, exactly TEAuthSize = 32 bytes), the
//     client's credential for the sender's transfer engine, sent only to a
//     CURVE client (bound to its key); present means the sender's
//     transfer engine requires data-plane authentication. Other lengths,
//     types and duplicates are malformed. Golden bytes: TestMetadataTEAuth;
//   - "kvflow"."same_host" (a map), the sender's same-host claim
//     (SameHost, hw/shm.Claim): "host" (str, the kernel's boot id),
//     "path" (str, the cache file), "dev", "ino", "size" (uint, its
//     identity), "header" (bin, its header bytes), "grants" (str, the
//     grant table file), "grants_dev", "grants_ino" (uint), "epoch"
//     (uint, the grant table's run), in that order, all required; strings
//     of 1..4096 bytes, header 1..4096 bytes, size and epoch from 1;
//     anything else is malformed, with the field named; unknown keys are
//     skipped. Sent only by a prefill worker with node.te_backend shm.
//     Golden bytes: TestMetadataSameHost;
//   - RENEW [bin "renew_msg", [str req_id, ...]] → raw "ACK": lease
//     renewal, sent only to a peer whose metadata carries lease_ttl_ms (so
//     a seed ROUTER, which would drop it, never receives it), e.g.
//     92 c4 09 72656e65775f6d7367 92 a1 61 a1 62 for ["a", "b"];
//   - DONE_BATCH [bin "done_batch_msg", [str req_id, ...]] → raw "ACK":
//     1 to MaxDoneBatchIDs DONE_RECVINGs in one message, handled exactly as
//     one done_recving_msg per id in order (an id listed twice counts
//     twice); sent only to a peer whose metadata carries batch_done, e.g.
//     92 c4 0e 646f6e655f62617463685f6d7367 92 a1 61 a1 62 for ["a", "b"];
//     an optional third element, uint msg_id (not 0), names the message
//     for its retries: 93 c4 0e 646f6e655f62617463685f6d7367 91 a1 61
//     cf 0102030405060708 for ["a"] and id 0x0102030405060708;
//   - the raw error reply "ERR <reason>" to a request kvflow could not handle
//     (the seed drops such requests and lets the peer time out).
//
// # Decoding
//
// Decoders are strict on types (bin vs str, non-negative integers, UTF-8
// strings, no trailing bytes, no duplicate keys) and tolerant of extra fields
// and extra trailing request elements. Errors are *DecodeError (wrapping
// ErrMalformed) naming the field and byte offset, ErrUnknownMessage,
// ErrUnexpectedReply or *RemoteError. Decoders never allocate more than the
// input can back and bound nesting, so any byte string is safe to decode.
package wire
