package wire

import (
	"bytes"
	"errors"
	"fmt"
	"math"
	"strconv"
	"time"

	"github.com/kvflow/kvflow/hw/npu"
)

// Message type tags, sent as msgpack bin (Python bytes) in element 0 of a
// request array; the seed's GET_META_MSG and DONE_RECVING_MSG.
const (
	MsgGetMeta     = "get_meta_msg"
	MsgDoneRecving = "done_recving_msg"
	// MsgRenew is kvflow's lease renewal, [b"renew_msg", [req_id, ...]],
	// answered "ACK". Not in the seed: a decode worker sends it only to
	// peers whose metadata advertised Ext.LeaseTTL.
	MsgRenew = "renew_msg"
	// MsgDoneBatch is kvflow's batched DONE_RECVING,
	// [b"done_batch_msg", [req_id, ...]], answered "ACK": the same as one
	// done_recving_msg per id, in order (an id listed twice counts twice).
	// Not in the seed: a decode worker sends it only to peers whose
	// metadata advertised Ext.BatchDone. An optional third element,
	// [b"done_batch_msg", [req_id, ...], msg_id], is the sender's id of
	// the message (uint; senders never use 0, which reads as none), the
	// same on every retry of it: a server that has seen msg_id answers
	// the repeat as it answered the first, without counting its DONEs
	// twice. Servers before it skip the element.
	MsgDoneBatch = "done_batch_msg"
)

// MaxRenewIDs bounds the request ids of one RENEW (a sender splits larger
// batches): 4096 ids of a few hundred bytes stay far below the server's
// 1 MiB message limit.
const MaxRenewIDs = 4096

// MaxDoneBatchIDs bounds the request ids of one DONE batch, for the same
// reason as MaxRenewIDs; a batch is never empty.
const MaxDoneBatchIDs = 4096

// AckReply is the raw (not msgpack) reply to a DONE_RECVING request.
const AckReply = "ACK"

// ErrorReplyPrefix starts kvflow's raw reply to a request it could not
// handle. The seed never sends it (it drops such requests); its first byte,
// 'E' (0x45), is a msgpack positive fixint, so it can never be mistaken for a
// metadata map, and it differs from "ACK".
const ErrorReplyPrefix = "ERR "

// Map keys of the metadata reply, in the order the seed's msgspec Struct
// declares (and so encodes) them.
const (
	keyEngineID         = "engine_id"
	keyTERPCPort        = "te_rpc_port"
	keyKVCachesBaseAddr = "kv_caches_base_addr"
	keyNumBlocks        = "num_blocks"
	keyKvflow           = "kvflow"
	keyBootEpoch        = "boot_epoch"
	keyLeaseTTLMs       = "lease_ttl_ms"
	keyBatchDone        = "batch_done"
	keyTEAuth           = "te_auth"
)

// TEAuthSize is the length of Ext.TEAuth, an HMAC-SHA256.
const TEAuthSize = 32

// Sentinel errors; test with errors.Is.
var (
	// ErrMalformed: the bytes are not a well-formed message of the expected
	// shape (truncated msgpack, wrong types, missing fields, trailing bytes).
	// Every *DecodeError wraps it.
	ErrMalformed = errors.New("sidechannel: malformed message")
	// ErrUnknownMessage: a well-formed request whose type tag is not
	// get_meta_msg, done_recving_msg or (kvflow) renew_msg or done_batch_msg.
	ErrUnknownMessage = errors.New("sidechannel: unknown message type")
	// ErrUnexpectedReply: a reply to DONE_RECVING that is not "ACK" (and not
	// an error reply).
	ErrUnexpectedReply = errors.New("sidechannel: unexpected reply")
)

// DecodeError says where and why decoding failed. It wraps ErrMalformed.
type DecodeError struct {
	Field  string // the value being decoded, e.g. "kv_caches_base_addr[2]"
	Offset int    // byte offset in the message where the problem was found
	Msg    string
}

func (e *DecodeError) Error() string {
	return fmt.Sprintf("sidechannel: malformed message: %s at byte %d: %s", e.Field, e.Offset, e.Msg)
}

func (e *DecodeError) Unwrap() error { return ErrMalformed }

// RemoteError is a peer's error reply ("ERR <reason>"): the peer received the
// request and refused it.
type RemoteError struct{ Reason string }

func (e *RemoteError) Error() string { return "sidechannel: peer replied error: " + e.Reason }

// Kind is the type of a side-channel request.
type Kind uint8

const (
	KindGetMeta     Kind = iota + 1 // [b"get_meta_msg", ""] → metadata map
	KindDoneRecving                 // [b"done_recving_msg", request_id] → b"ACK"
	KindRenew                       // [b"renew_msg", [request_id, ...]] → b"ACK" (kvflow only)
	KindDoneBatch                   // [b"done_batch_msg", [request_id, ...]] → b"ACK" (kvflow only)
)

// String returns the short name used in metrics and logs: "get_meta",
// "done", "renew", "done_batch".
func (k Kind) String() string {
	switch k {
	case KindGetMeta:
		return "get_meta"
	case KindDoneRecving:
		return "done"
	case KindRenew:
		return "renew"
	case KindDoneBatch:
		return "done_batch"
	}
	return "unknown(" + strconv.Itoa(int(k)) + ")"
}

// Request is a decoded side-channel request.
type Request struct {
	Kind       Kind
	RequestID  string   // KindDoneRecving only
	RequestIDs []string // KindRenew (may be empty), KindDoneBatch (never empty)
	// MsgID is a KindDoneBatch message's id (0: none sent).
	MsgID uint64
}

// Metadata is the seed's MooncakeAgentMetadata plus kvflow's optional
// extension. The zero Ext is omitted on the wire, so kvflow's bytes equal the
// seed's unless an extension field is set.
type Metadata struct {
	EngineID         string
	TERPCPort        int
	KVCachesBaseAddr []uint64 // virtual addresses; may exceed 2^63
	NumBlocks        int
	Ext              Ext
}

// Ext holds kvflow-only metadata, sent as one extra map field "kvflow" (a map)
// after the seed's four. The seed's msgspec decoder ignores unknown fields,
// so a seed decode worker still reads kvflow's metadata. Add fields here with
// zero meaning "absent" and keep them omitted when zero.
type Ext struct {
	// BootEpoch changes each time the serving process restarts, so a peer
	// can tell that cached metadata is stale. 0 = not sent.
	BootEpoch uint64
	// LeaseTTL advertises leases: the server accepts RENEW, and one RENEW
	// keeps a request's blocks held for LeaseTTL. Sent as "lease_ttl_ms",
	// whole milliseconds (a positive value under 1 ms is sent as 1).
	// 0 = not sent: the peer does not take RENEW.
	LeaseTTL time.Duration
	// BatchDone advertises that the server takes done_batch_msg (batched
	// DONE_RECVING). Sent as "batch_done": true; false = not sent: send the
	// peer one done_recving_msg per request.
	BatchDone bool
	// Cache is the sender's cache fingerprint (sent as "cache", a map; see
	// the package docs): a decode worker compares it with the shape it
	// expects before reading. nil = not sent (a seed peer, or an older
	// kvflow one).
	Cache *npu.Fingerprint
	// TEAuth is the client's data-plane credential (sent as "te_auth", bin
	// of TEAuthSize bytes): the server's transfer engine refuses its
	// handshake and data ports to anyone who cannot prove knowledge of it,
	// and this is the key of that proof (see package mooncake, "Data-plane
	// authentication"). The server sends it only over CURVE, bound to the
	// client's CURVE public key. nil = not sent: the peer's transfer engine
	// speaks the plain protocol.
	TEAuth *[TEAuthSize]byte
	// SameHost is the sender's same-host claim (sent as "same_host", a
	// map; see the package docs): a decode worker on the same host may
	// read its cache by mapping the file (hw/shm) instead of over the
	// network. nil = not sent.
	SameHost *SameHost
}

// IsZero reports whether no extension field is set (then "kvflow" is omitted).
func (e Ext) IsZero() bool {
	return e.BootEpoch == 0 && e.LeaseTTL <= 0 && !e.BatchDone && e.Cache == nil && e.TEAuth == nil && e.SameHost == nil
}

// AppendGetMeta appends the GET_META request, msgpack [b"get_meta_msg", ""].
func AppendGetMeta(dst []byte) []byte {
	dst = appendArrayLen(dst, 2)
	dst = appendBin(dst, MsgGetMeta)
	return appendStr(dst, "")
}

// EncodeGetMeta returns the GET_META request bytes.
func EncodeGetMeta() []byte { return AppendGetMeta(nil) }

// AppendDoneRecving appends msgpack [b"done_recving_msg", reqID].
func AppendDoneRecving(dst []byte, reqID string) []byte {
	dst = appendArrayLen(dst, 2)
	dst = appendBin(dst, MsgDoneRecving)
	return appendStr(dst, reqID)
}

// EncodeDoneRecving returns the DONE_RECVING request bytes for reqID.
func EncodeDoneRecving(reqID string) []byte { return AppendDoneRecving(nil, reqID) }

// AppendRenew appends msgpack [b"renew_msg", [reqIDs...]].
func AppendRenew(dst []byte, reqIDs []string) []byte { return appendIDList(dst, MsgRenew, reqIDs) }

// EncodeRenew returns the RENEW request bytes for reqIDs.
func EncodeRenew(reqIDs []string) []byte { return AppendRenew(nil, reqIDs) }

// AppendDoneBatch appends msgpack [b"done_batch_msg", [reqIDs...]]. The
// caller keeps 1 ≤ len(reqIDs) ≤ MaxDoneBatchIDs (DecodeRequest rejects
// anything else).
func AppendDoneBatch(dst []byte, reqIDs []string) []byte {
	return appendIDList(dst, MsgDoneBatch, reqIDs)
}

// AppendDoneBatchMsg is AppendDoneBatch with the message's id (0 = none,
// the same bytes as AppendDoneBatch): [b"done_batch_msg", [reqIDs...],
// msgID]. A sender keeps one msgID per message, across its retries.
func AppendDoneBatchMsg(dst []byte, reqIDs []string, msgID uint64) []byte {
	if msgID == 0 {
		return AppendDoneBatch(dst, reqIDs)
	}
	return appendUint(appendIDListOf(dst, 3, MsgDoneBatch, reqIDs), msgID)
}

// appendIDList appends msgpack [bin kind, [str id, ...]], the shape of
// kvflow's list messages.
func appendIDList(dst []byte, kind string, reqIDs []string) []byte {
	return appendIDListOf(dst, 2, kind, reqIDs)
}

// appendIDListOf is appendIDList heading an array of n elements, the
// caller appending the n-2 after the list.
func appendIDListOf(dst []byte, n int, kind string, reqIDs []string) []byte {
	dst = appendArrayLen(dst, n)
	dst = appendBin(dst, kind)
	dst = appendArrayLen(dst, len(reqIDs))
	for _, id := range reqIDs {
		dst = appendStr(dst, id)
	}
	return dst
}

// EncodeDoneBatch returns the batched DONE request bytes for reqIDs.
func EncodeDoneBatch(reqIDs []string) []byte { return AppendDoneBatch(nil, reqIDs) }

// EncodeRequest encodes r; it panics on an unknown Kind (a programming error).
func EncodeRequest(r Request) []byte {
	switch r.Kind {
	case KindGetMeta:
		return EncodeGetMeta()
	case KindDoneRecving:
		return EncodeDoneRecving(r.RequestID)
	case KindRenew:
		return EncodeRenew(r.RequestIDs)
	case KindDoneBatch:
		return AppendDoneBatchMsg(nil, r.RequestIDs, r.MsgID)
	}
	panic("sidechannel: EncodeRequest: unknown kind " + r.Kind.String())
}

// DecodeRequest decodes one request payload (the single non-empty frame after
// the ROUTER identity). It accepts what the seed's handler accepts, with
// types checked:
//   - a msgpack array whose element 0 is bin;
//   - get_meta_msg: further elements are ignored (the seed ignores them);
//   - done_recving_msg: element 1 must be a UTF-8 str (the request id);
//     further elements are ignored (room for optional kvflow additions);
//   - renew_msg (kvflow): element 1 must be an array of at most MaxRenewIDs
//     UTF-8 strs; further elements are ignored;
//   - done_batch_msg (kvflow): element 1 must be an array of 1 to
//     MaxDoneBatchIDs UTF-8 strs; element 2, if present, a uint message
//     id (0 reads as none); further elements are ignored;
//   - nothing may follow the array.
//
// A str tag (instead of bin) is malformed, as it is "unexpected" to the seed.
func DecodeRequest(b []byte) (Request, error) {
	r := &reader{b: b}
	n, err := r.arrayLen("request")
	if err != nil {
		return Request{}, err
	}
	if n < 1 {
		return Request{}, r.errf("request", "empty array, want [type, ...]")
	}
	tag, err := r.bin("request[0]")
	if err != nil {
		return Request{}, err
	}
	var req Request
	rest := n - 1
	switch string(tag) {
	case MsgGetMeta:
		req.Kind = KindGetMeta
	case MsgDoneRecving:
		req.Kind = KindDoneRecving
		if n < 2 {
			return Request{}, r.errf("request", "done_recving_msg without a request id")
		}
		if req.RequestID, err = r.str("request[1]"); err != nil {
			return Request{}, err
		}
		rest--
	case MsgRenew:
		req.Kind = KindRenew
		if n < 2 {
			return Request{}, r.errf("request", "renew_msg without request ids")
		}
		if req.RequestIDs, err = r.ids(0, MaxRenewIDs); err != nil {
			return Request{}, err
		}
		rest--
	case MsgDoneBatch:
		req.Kind = KindDoneBatch
		if n < 2 {
			return Request{}, r.errf("request", "done_batch_msg without request ids")
		}
		if req.RequestIDs, err = r.ids(1, MaxDoneBatchIDs); err != nil {
			return Request{}, err
		}
		rest--
		if rest > 0 {
			if req.MsgID, err = r.uint("request[2]"); err != nil {
				return Request{}, err
			}
			rest--
		}
	default:
		return Request{}, fmt.Errorf("%w %s", ErrUnknownMessage, quote(tag))
	}
	for i := 0; i < rest; i++ {
		if err := r.skip("request["+strconv.Itoa(n-rest+i)+"]", 1); err != nil {
			return Request{}, err
		}
	}
	if r.remaining() != 0 {
		return Request{}, r.errf("request", "%d trailing bytes", r.remaining())
	}
	return req, nil
}

// ids reads request[1], an array of lo..hi UTF-8 strs.
func (r *reader) ids(lo, hi int) ([]string, error) {
	const field = "request[1]"
	start := r.off
	m, err := r.arrayLen(field)
	if err != nil {
		return nil, err
	}
	if m < lo || m > hi {
		r.off = start
		return nil, r.errf(field, "%d request ids, want %d..%d", m, lo, hi)
	}
	ids := make([]string, m) // m ≤ bytes left: arrayLen checked it
	for i := range ids {
		if ids[i], err = r.str(field + "[" + strconv.Itoa(i) + "]"); err != nil {
			return nil, err
		}
	}
	return ids, nil
}

// AppendMetadata appends m as msgspec encodes MooncakeAgentMetadata: a map
// with engine_id, te_rpc_port, kv_caches_base_addr, num_blocks in that order,
// smallest headers, then "kvflow" only when m.Ext is not zero.
func AppendMetadata(dst []byte, m Metadata) []byte {
	n := 4
	if !m.Ext.IsZero() {
		n++
	}
	dst = appendMapLen(dst, n)
	dst = appendStr(dst, keyEngineID)
	dst = appendStr(dst, m.EngineID)
	dst = appendStr(dst, keyTERPCPort)
	dst = appendInt(dst, int64(m.TERPCPort))
	dst = appendStr(dst, keyKVCachesBaseAddr)
	dst = appendArrayLen(dst, len(m.KVCachesBaseAddr))
	for _, a := range m.KVCachesBaseAddr {
		dst = appendUint(dst, a)
	}
	dst = appendStr(dst, keyNumBlocks)
	dst = appendInt(dst, int64(m.NumBlocks))
	if !m.Ext.IsZero() {
		dst = appendStr(dst, keyKvflow)
		dst = appendExt(dst, m.Ext)
	}
	return dst
}

// EncodeMetadata returns the metadata reply bytes for m.
func EncodeMetadata(m Metadata) []byte { return AppendMetadata(nil, m) }

func appendExt(dst []byte, e Ext) []byte {
	n := 0
	if e.BootEpoch != 0 {
		n++
	}
	if e.LeaseTTL > 0 {
		n++
	}
	if e.BatchDone {
		n++
	}
	if e.Cache != nil {
		n++
	}
	if e.TEAuth != nil {
		n++
	}
	if e.SameHost != nil {
		n++
	}
	dst = appendMapLen(dst, n)
	if e.BootEpoch != 0 {
		dst = appendStr(dst, keyBootEpoch)
		dst = appendUint(dst, e.BootEpoch)
	}
	if e.LeaseTTL > 0 {
		dst = appendStr(dst, keyLeaseTTLMs)
		dst = appendUint(dst, leaseMillis(e.LeaseTTL))
	}
	if e.BatchDone {
		dst = appendStr(dst, keyBatchDone)
		dst = append(dst, 0xc3) // true
	}
	if e.Cache != nil {
		dst = appendStr(dst, keyCache)
		dst = appendCache(dst, e.Cache)
	}
	if e.TEAuth != nil {
		dst = appendStr(dst, keyTEAuth)
		dst = appendBin(dst, string(e.TEAuth[:]))
	}
	if e.SameHost != nil {
		dst = appendStr(dst, keySameHost)
		dst = appendSameHost(dst, e.SameHost)
	}
	return dst
}

// leaseMillis is d in whole milliseconds, rounded up (so a positive d is
// never sent as 0).
func leaseMillis(d time.Duration) uint64 {
	return uint64((d + time.Millisecond - 1) / time.Millisecond)
}

// DecodeMetadata decodes a metadata reply. Keys must be str; the four seed
// fields are required and type-checked (te_rpc_port and num_blocks
// non-negative and at most MaxInt64, addresses any uint64); unknown fields are
// skipped, so newer peers may add fields; "kvflow", when present, must be a
// map, whose unknown fields are skipped too. Duplicate keys and trailing
// bytes are malformed.
func DecodeMetadata(b []byte) (Metadata, error) {
	var m Metadata
	if len(b) >= len(ErrorReplyPrefix) && string(b[:len(ErrorReplyPrefix)]) == ErrorReplyPrefix {
		return m, &RemoteError{Reason: string(b[len(ErrorReplyPrefix):])}
	}
	r := &reader{b: b}
	n, err := r.mapLen("metadata")
	if err != nil {
		return m, err
	}
	const (
		seenEngine = 1 << iota
		seenPort
		seenAddrs
		seenBlocks
		seenExt
	)
	seen := 0
	mark := func(bit int, key string) error {
		if seen&bit != 0 {
			return r.errf(key, "duplicate key")
		}
		seen |= bit
		return nil
	}
	for i := 0; i < n; i++ {
		key, err := r.str("metadata key")
		if err != nil {
			return m, err
		}
		switch key {
		case keyEngineID:
			if err = mark(seenEngine, key); err == nil {
				m.EngineID, err = r.str(key)
			}
		case keyTERPCPort:
			if err = mark(seenPort, key); err == nil {
				m.TERPCPort, err = r.int(key)
			}
		case keyKVCachesBaseAddr:
			if err = mark(seenAddrs, key); err == nil {
				m.KVCachesBaseAddr, err = r.uints(key)
			}
		case keyNumBlocks:
			if err = mark(seenBlocks, key); err == nil {
				m.NumBlocks, err = r.int(key)
			}
		case keyKvflow:
			if err = mark(seenExt, key); err == nil {
				m.Ext, err = r.ext()
			}
		default:
			err = r.skip(key, 1)
		}
		if err != nil {
			return Metadata{}, err
		}
	}
	for _, f := range []struct {
		bit int
		key string
	}{{seenEngine, keyEngineID}, {seenPort, keyTERPCPort}, {seenAddrs, keyKVCachesBaseAddr}, {seenBlocks, keyNumBlocks}} {
		if seen&f.bit == 0 {
			return Metadata{}, r.errf("metadata", "missing required field %q", f.key)
		}
	}
	if r.remaining() != 0 {
		return Metadata{}, r.errf("metadata", "%d trailing bytes", r.remaining())
	}
	return m, nil
}

func (r *reader) int(field string) (int, error) {
	start := r.off
	v, err := r.uint(field)
	if err != nil {
		return 0, err
	}
	if v > math.MaxInt64 {
		r.off = start
		return 0, r.errf(field, "%d does not fit in int64", v)
	}
	return int(v), nil
}

func (r *reader) uints(field string) ([]uint64, error) {
	n, err := r.arrayLen(field)
	if err != nil {
		return nil, err
	}
	out := make([]uint64, n) // n ≤ bytes left: arrayLen checked it
	for i := range out {
		if out[i], err = r.uint(field + "[" + strconv.Itoa(i) + "]"); err != nil {
			return nil, err
		}
	}
	return out, nil
}

func (r *reader) ext() (Ext, error) {
	var e Ext
	n, err := r.mapLen(keyKvflow)
	if err != nil {
		return e, err
	}
	seenEpoch, seenLease, seenBatch, seenCache, seenAuth, seenSame := false, false, false, false, false, false
	for i := 0; i < n; i++ {
		key, err := r.str(keyKvflow + " key")
		if err != nil {
			return Ext{}, err
		}
		field := keyKvflow + "." + key
		switch key {
		case keyBootEpoch:
			if seenEpoch {
				return Ext{}, r.errf(field, "duplicate key")
			}
			seenEpoch = true
			e.BootEpoch, err = r.uint(field)
		case keyLeaseTTLMs:
			if seenLease {
				return Ext{}, r.errf(field, "duplicate key")
			}
			seenLease = true
			start := r.off
			var ms uint64
			if ms, err = r.uint(field); err == nil && ms > uint64(math.MaxInt64/int64(time.Millisecond)) {
				r.off = start
				return Ext{}, r.errf(field, "%d ms does not fit in a duration", ms)
			}
			e.LeaseTTL = time.Duration(ms) * time.Millisecond
		case keyBatchDone:
			if seenBatch {
				return Ext{}, r.errf(field, "duplicate key")
			}
			seenBatch = true
			e.BatchDone, err = r.bool(field)
		case keyCache:
			if seenCache {
				return Ext{}, r.errf(field, "duplicate key")
			}
			seenCache = true
			e.Cache, err = r.cache(field)
		case keyTEAuth:
			if seenAuth {
				return Ext{}, r.errf(field, "duplicate key")
			}
			seenAuth = true
			start := r.off
			var tok []byte
			if tok, err = r.bin(field); err == nil && len(tok) != TEAuthSize {
				r.off = start
				return Ext{}, r.errf(field, "%d bytes, want %d", len(tok), TEAuthSize)
			}
			if err == nil {
				e.TEAuth = (*[TEAuthSize]byte)(bytes.Clone(tok))
			}
		case keySameHost:
			if seenSame {
				return Ext{}, r.errf(field, "duplicate key")
			}
			seenSame = true
			e.SameHost, err = r.sameHost(field)
		default:
			err = r.skip(field, 2)
		}
		if err != nil {
			return Ext{}, err
		}
	}
	return e, nil
}

// DecodeAck checks a reply to DONE_RECVING: nil for exactly "ACK", a
// *RemoteError for an error reply, else an error wrapping ErrUnexpectedReply.
func DecodeAck(b []byte) error {
	if string(b) == AckReply {
		return nil
	}
	if bytes.HasPrefix(b, []byte(ErrorReplyPrefix)) {
		return &RemoteError{Reason: string(b[len(ErrorReplyPrefix):])}
	}
	return fmt.Errorf("%w: want %q, got %s", ErrUnexpectedReply, AckReply, quote(b))
}

// EncodeErrorReply returns kvflow's raw error reply for reason.
func EncodeErrorReply(reason string) []byte {
	return append([]byte(ErrorReplyPrefix), reason...)
}

// quote renders at most 64 bytes of b for logs and errors.
func quote(b []byte) string {
	const max = 64
	if len(b) > max {
		return strconv.Quote(string(b[:max])) + "…(" + strconv.Itoa(len(b)) + " bytes)"
	}
	return strconv.Quote(string(b))
}

// Quote renders at most 64 bytes of b, escaped, for logs.
func Quote(b []byte) string { return quote(b) }
