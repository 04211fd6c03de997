package mooncake

// Wire formats of Mooncake TransferEngine's TCP transport, as pure
// functions: no sockets, goroutines or clocks. The facts below were checked
// against kvcache-ai/Mooncake (mooncake-transfer-engine):
//
//   - include/common.h: HandShakeRequestType, writeString/readString
//     (uint64 length counting the type byte, then the type byte, then JSON;
//     a first byte above Probe means the old protocol without a type byte;
//     length 0 and length > 1 MiB are refused).
//   - src/transfer_metadata.cpp: encodeSegmentDesc/decodeSegmentDesc for
//     protocol "tcp" (name, protocol, tcp_data_port, tcp_proto_version,
//     timestamp, buffers[{name, addr, length}], addresses as Json::UInt64),
//     written with Json::FastWriter (keys sorted, no spaces, trailing '\n').
//   - src/transport/tcp_transport/tcp_transport_session_impl.h: the 24-byte
//     SessionHeader {uint64 size; uint64 addr; uint8 opcode} (7 bytes of
//     struct padding, uninitialised on the C++ side), little-endian; opcode
//     bit 0x80 marks protocol v2, whose status frames carry the magic
//     "MCTV" (0x4D435456) in the high 32 bits; |1 means the address was
//     rejected.

import (
	"bytes"
	"encoding/binary"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"strings"
	"time"
)

// FrameType is the request type byte of a P2P handshake frame.
type FrameType uint8

// Handshake frame types (Mooncake HandShakeRequestType).
const (
	FrameConnection FrameType = 0
	FrameMetadata   FrameType = 1
	FrameNotify     FrameType = 2
	FrameProbe      FrameType = 3
	// FrameLegacy is the old protocol: the payload is JSON with no type
	// byte, answered as a Connection request and replied to without one.
	FrameLegacy FrameType = 0xff
)

func (t FrameType) String() string {
	switch t {
	case FrameConnection:
		return "connection"
	case FrameMetadata:
		return "metadata"
	case FrameNotify:
		return "notify"
	case FrameProbe:
		return "probe"
	case FrameLegacy:
		return "legacy"
	}
	return fmt.Sprintf("type(%d)", uint8(t))
}

// DefaultMaxFrame is Mooncake's default handshake length cap
// (kDefaultHandshakeMaxLength, 1 MiB).
const DefaultMaxFrame = 1 << 20

// Data-port constants.
const (
	HeaderSize = 24 // sizeof(SessionHeader) with its 7 padding bytes

	OpcodeRead  uint8 = 0
	OpcodeWrite uint8 = 1
	OpcodeV2    uint8 = 0x80 // kOpcodeV2Flag

	StatusMagic    uint64 = 0x4D435456 << 32 // "MCTV"
	StatusOK              = StatusMagic | 0
	StatusRejected        = StatusMagic | 1
	StatusSize            = 8

	// ProtoVersion is the tcp_proto_version this package speaks and
	// advertises (v2: acknowledged framing).
	ProtoVersion = 2
)

// kvflow's own data-port op (not Mooncake's; see StridedRead). It is sent
// only to a target whose segment descriptor advertised KvflowOpStridedRead
// in its "kvflow_ops" field, which a kvflow target puts in its reply only
// when the initiator's own descriptor carried the field: a Mooncake engine
// neither receives the op nor finds the field in a reply.
const (
	// OpcodeReadStrided is the strided READ's opcode; it is always sent
	// with the v2 bit (0x82).
	OpcodeReadStrided uint8 = 2
	// StridedHeaderSize is the request: the 24-byte header, then
	// {uint64 row; uint64 pitch} little-endian.
	StridedHeaderSize = HeaderSize + 16
	// KvflowOpStridedRead is the "kvflow_ops" bit of a segment descriptor
	// that says the engine serves OpcodeReadStrided.
	KvflowOpStridedRead uint32 = 1
)

// Errors of the wire decoders.
var (
	ErrFrameTooLarge = errors.New("mooncake: handshake frame exceeds the length cap")
	ErrFrameEmpty    = errors.New("mooncake: handshake frame of length zero")
	ErrFrameType     = errors.New("mooncake: unknown handshake frame type")
	ErrBadSegment    = errors.New("mooncake: malformed segment descriptor")
	ErrBadHeader     = errors.New("mooncake: malformed data header")
	ErrBadStatus     = errors.New("mooncake: malformed status frame (peer speaks legacy framing?)")
	ErrBadStrided    = errors.New("mooncake: malformed strided read")
)

// AppendFrame appends one handshake frame (length, type byte, payload) to
// dst. FrameLegacy frames carry no type byte, as Mooncake writes them.
func AppendFrame(dst []byte, t FrameType, payload []byte) []byte {
	n := uint64(len(payload))
	if t != FrameLegacy {
		n++
	}
	dst = binary.LittleEndian.AppendUint64(dst, n)
	if t != FrameLegacy {
		dst = append(dst, byte(t))
	}
	return append(dst, payload...)
}

// ParseFrameLength validates the 8-byte length prefix of a frame against
// maxLen (DefaultMaxFrame when <= 0) before anything is allocated.
func ParseFrameLength(prefix [8]byte, maxLen int) (int, error) {
	if maxLen <= 0 {
		maxLen = DefaultMaxFrame
	}
	n := binary.LittleEndian.Uint64(prefix[:])
	switch {
	case n == 0:
		return 0, ErrFrameEmpty
	case n > uint64(maxLen):
		return 0, fmt.Errorf("%w: %d > %d bytes", ErrFrameTooLarge, n, maxLen)
	}
	return int(n), nil
}

// ParseFrameBody splits a frame body (everything after the length) into
// its type and JSON payload. A first byte of Probe or less is the type; a
// printable first byte starts a legacy (untyped) JSON payload; anything
// else is refused. The payload aliases body.
func ParseFrameBody(body []byte) (FrameType, []byte, error) {
	if len(body) == 0 {
		return 0, nil, ErrFrameEmpty
	}
	b := body[0]
	switch {
	case b <= byte(FrameProbe):
		return FrameType(b), body[1:], nil
	case b == '{' || b == ' ' || b == '\t' || b == '\r' || b == '\n':
		return FrameLegacy, body, nil
	}
	return 0, nil, fmt.Errorf("%w: first byte 0x%02x", ErrFrameType, b)
}

// ReadFrame reads one handshake frame from r, allocating at most the
// announced length and never more than maxLen bytes.
func ReadFrame(r io.Reader, maxLen int) (FrameType, []byte, error) {
	var prefix [8]byte
	if _, err := io.ReadFull(r, prefix[:]); err != nil {
		return 0, nil, fmt.Errorf("read frame length: %w", err)
	}
	n, err := ParseFrameLength(prefix, maxLen)
	if err != nil {
		return 0, nil, err
	}
	body := make([]byte, n)
	if _, err := io.ReadFull(r, body); err != nil {
		return 0, nil, fmt.Errorf("read frame body (%d bytes): %w", n, err)
	}
	return ParseFrameBody(body)
}

// BufferDesc is one registered buffer of a segment.
type BufferDesc struct {
	Addr   uint64 `json:"addr"`
	Length uint64 `json:"length"`
	Name   string `json:"name"`
}

// SegmentDesc is the TCP segment descriptor exchanged in Metadata frames.
type SegmentDesc struct {
	Buffers         []BufferDesc
	Name            string
	Protocol        string // "tcp"; a multi-protocol list decodes as "a,b"
	TCPDataPort     int
	TCPProtoVersion int // 1 when the field is absent
	Timestamp       string
	// KvflowOps is kvflow's extension (the "kvflow_ops" field, absent when
	// 0): the kvflow-only ops the engine serves (KvflowOpStridedRead).
	// Mooncake never sends it and ignores it.
	KvflowOps uint32
}

// HasProtocol reports whether the descriptor lists protocol p.
func (d *SegmentDesc) HasProtocol(p string) bool {
	for _, s := range strings.Split(d.Protocol, ",") {
		if s == p {
			return true
		}
	}
	return false
}

// segmentWire is the JSON shape. Fields are in the sorted order jsoncpp's
// FastWriter emits, so EncodeSegment is byte-identical to Mooncake's.
type segmentWire struct {
	Buffers         []BufferDesc    `json:"buffers"`
	KvflowOps       json.RawMessage `json:"kvflow_ops,omitempty"`
	Name            string          `json:"name"`
	Protocol        json.RawMessage `json:"protocol"`
	TCPDataPort     json.RawMessage `json:"tcp_data_port"`
	TCPProtoVersion json.RawMessage `json:"tcp_proto_version,omitempty"`
	Timestamp       json.RawMessage `json:"timestamp,omitempty"`
}

// TimestampLayout is Mooncake's getCurrentDateTime format (local time).
const TimestampLayout = "2006-01-02 15:04:05.000000"

// FormatTimestamp renders t as Mooncake does.
func FormatTimestamp(t time.Time) string { return t.Format(TimestampLayout) }

// EncodeSegment renders d as Json::FastWriter would: sorted keys, no
// whitespace, no HTML escaping, a trailing newline, "buffers" never null,
// "kvflow_ops" only when not 0.
func EncodeSegment(d *SegmentDesc) []byte {
	w := struct {
		Buffers         []BufferDesc `json:"buffers"`
		KvflowOps       uint32       `json:"kvflow_ops,omitempty"`
		Name            string       `json:"name"`
		Protocol        string       `json:"protocol"`
		TCPDataPort     int          `json:"tcp_data_port"`
		TCPProtoVersion int          `json:"tcp_proto_version"`
		Timestamp       string       `json:"timestamp"`
	}{d.Buffers, d.KvflowOps, d.Name, d.Protocol, d.TCPDataPort, d.TCPProtoVersion, d.Timestamp}
	if w.Buffers == nil {
		w.Buffers = []BufferDesc{}
	}
	var buf bytes.Buffer
	enc := json.NewEncoder(&buf)
	enc.SetEscapeHTML(false)
	if err := enc.Encode(&w); err != nil { // cannot fail for these types
		panic(err)
	}
	return buf.Bytes()
}

// DecodeSegment parses a TCP segment descriptor. Addresses and lengths are
// decoded as integers (never through float64). Like Mooncake, a buffer
// with an empty name or a zero address or length makes the descriptor
// corrupt; unlike Mooncake, so does a data port outside 1..65535.
func DecodeSegment(data []byte) (*SegmentDesc, error) {
	var w segmentWire
	if err := json.Unmarshal(data, &w); err != nil {
		return nil, fmt.Errorf("%w: %v", ErrBadSegment, err)
	}
	d := &SegmentDesc{Name: w.Name, Buffers: w.Buffers, TCPProtoVersion: 1}
	var err error
	if d.Protocol, err = decodeProtocol(w.Protocol); err != nil {
		return nil, err
	}
	if d.TCPDataPort, err = decodeInt(w.TCPDataPort, "tcp_data_port"); err != nil {
		return nil, err
	}
	if len(w.TCPProtoVersion) > 0 {
		if d.TCPProtoVersion, err = decodeInt(w.TCPProtoVersion, "tcp_proto_version"); err != nil {
			return nil, err
		}
	}
	if len(w.KvflowOps) > 0 {
		if err := json.Unmarshal(w.KvflowOps, &d.KvflowOps); err != nil {
			return nil, fmt.Errorf("%w: kvflow_ops: %v", ErrBadSegment, err)
		}
	}
	if len(w.Timestamp) > 0 {
		if err := json.Unmarshal(w.Timestamp, &d.Timestamp); err != nil {
			return nil, fmt.Errorf("%w: timestamp: %v", ErrBadSegment, err)
		}
	}
	if !d.HasProtocol("tcp") {
		return nil, fmt.Errorf("%w: protocol %q has no tcp", ErrBadSegment, d.Protocol)
	}
	if d.TCPDataPort <= 0 || d.TCPDataPort > 65535 {
		return nil, fmt.Errorf("%w: tcp_data_port %d", ErrBadSegment, d.TCPDataPort)
	}
	for i, b := range d.Buffers {
		if b.Name == "" || b.Addr == 0 || b.Length == 0 || b.Addr+b.Length < b.Addr {
			return nil, fmt.Errorf("%w: buffer %d (name %q addr %#x length %d)",
				ErrBadSegment, i, b.Name, b.Addr, b.Length)
		}
	}
	return d, nil
}

func decodeProtocol(raw json.RawMessage) (string, error) {
	if len(raw) == 0 {
		return "", fmt.Errorf("%w: no protocol", ErrBadSegment)
	}
	var s string
	if err := json.Unmarshal(raw, &s); err == nil {
		return s, nil
	}
	var list []string // multi-protocol builds write an array
	if err := json.Unmarshal(raw, &list); err != nil {
		return "", fmt.Errorf("%w: protocol: %v", ErrBadSegment, err)
	}
	return strings.Join(list, ","), nil
}

func decodeInt(raw json.RawMessage, field string) (int, error) {
	var v int32 // Mooncake stores both as C int
	if err := json.Unmarshal(raw, &v); err != nil {
		return 0, fmt.Errorf("%w: %s: %v", ErrBadSegment, field, err)
	}
	return int(v), nil
}

// Header is a data-port request header.
type Header struct {
	Size   uint64
	Addr   uint64
	Opcode uint8 // OpcodeRead or OpcodeWrite
	V2     bool  // acknowledged framing
}

// PutHeader encodes h into b (HeaderSize bytes; padding zeroed).
func PutHeader(b *[HeaderSize]byte, h Header) {
	binary.LittleEndian.PutUint64(b[0:8], h.Size)
	binary.LittleEndian.PutUint64(b[8:16], h.Addr)
	op := h.Opcode
	if h.V2 {
		op |= OpcodeV2
	}
	b[16] = op
	clear(b[17:])
}

// ParseHeader decodes a data-port header. Padding is ignored (the C++ side
// leaves it uninitialised). Opcodes other than READ and WRITE, with or
// without the v2 bit, are refused, but V2 is still reported so that a v2
// reject status can be sent.
func ParseHeader(b *[HeaderSize]byte) (Header, error) {
	h := Header{
		Size:   binary.LittleEndian.Uint64(b[0:8]),
		Addr:   binary.LittleEndian.Uint64(b[8:16]),
		Opcode: b[16] &^ OpcodeV2,
		V2:     b[16]&OpcodeV2 != 0,
	}
	if h.Opcode != OpcodeRead && h.Opcode != OpcodeWrite {
		return h, fmt.Errorf("%w: opcode 0x%02x", ErrBadHeader, b[16])
	}
	return h, nil
}

// PutStatus encodes a v2 status frame.
func PutStatus(b *[StatusSize]byte, status uint64) { binary.LittleEndian.PutUint64(b[:], status) }

// ParseStatus decodes a v2 status frame: nil for OK, ErrRejected for a
// rejection (any non-zero code), ErrBadStatus without the magic.
func ParseStatus(b *[StatusSize]byte) error {
	v := binary.LittleEndian.Uint64(b[:])
	switch {
	case v&0xFFFFFFFF00000000 != StatusMagic:
		return fmt.Errorf("%w: %#016x", ErrBadStatus, v)
	case v == StatusOK:
		return nil
	}
	return fmt.Errorf("%w (status %d)", ErrRejected, uint32(v))
}

// StridedRead is kvflow's strided READ (OpcodeReadStrided): Rows rows of
// Row bytes each, Pitch bytes apart from Addr, answered like a READ of
// Rows*Row bytes (v2 status, then the rows back to back). A decode rank
// whose TP is above the prefill's reads one slice of every token row of a
// prefill block so, in one request instead of one per row.
type StridedRead struct {
	Addr, Row, Pitch, Rows uint64
}

// Size is the bytes of the answer.
func (s StridedRead) Size() uint64 { return s.Row * s.Rows }

// Span is the bytes from Addr to the last row's end: the range the target
// checks against its registered regions and grants, whole.
func (s StridedRead) Span() uint64 { return (s.Rows-1)*s.Pitch + s.Row }

// PutStrided encodes s (valid: see ParseStrided) into b.
func PutStrided(b *[StridedHeaderSize]byte, s StridedRead) {
	h := (*[HeaderSize]byte)(b[:HeaderSize])
	PutHeader(h, Header{Size: s.Size(), Addr: s.Addr, Opcode: OpcodeReadStrided, V2: true})
	binary.LittleEndian.PutUint64(b[HeaderSize:], s.Row)
	binary.LittleEndian.PutUint64(b[HeaderSize+8:], s.Pitch)
}

// ParseStrided decodes a strided READ request and checks that it is one:
// opcode 0x82 (v2 only), a row of at least one byte, a size of whole rows
// (at least one), rows that do not overlap (pitch >= row), and a span that
// neither overflows nor wraps the address space. Padding is ignored.
func ParseStrided(b *[StridedHeaderSize]byte) (StridedRead, error) {
	size := binary.LittleEndian.Uint64(b[0:8])
	s := StridedRead{
		Addr:  binary.LittleEndian.Uint64(b[8:16]),
		Row:   binary.LittleEndian.Uint64(b[HeaderSize:]),
		Pitch: binary.LittleEndian.Uint64(b[HeaderSize+8:]),
	}
	switch {
	case b[16] != OpcodeReadStrided|OpcodeV2:
		return s, fmt.Errorf("%w: opcode 0x%02x", ErrBadStrided, b[16])
	case s.Row == 0 || size == 0 || size%s.Row != 0:
		return s, fmt.Errorf("%w: %d bytes in rows of %d", ErrBadStrided, size, s.Row)
	case s.Pitch < s.Row:
		return s, fmt.Errorf("%w: rows of %d bytes %d apart overlap", ErrBadStrided, s.Row, s.Pitch)
	}
	s.Rows = size / s.Row
	if s.Rows-1 > (^uint64(0)-s.Row)/s.Pitch {
		return s, fmt.Errorf("%w: %d rows %d bytes apart overflow", ErrBadStrided, s.Rows, s.Pitch)
	}
	if span := s.Span(); s.Addr+span < s.Addr {
		return s, fmt.Errorf("%w: %d bytes from %#x wrap around", ErrBadStrided, span, s.Addr)
	}
	return s, nil
}
