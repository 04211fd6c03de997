package mooncake

import (
	"bytes"
	"encoding/binary"
	"errors"
	"math/bits"
	"testing"
)

// The decoders take peer input: they must never panic, and a frame is
// never allocated beyond the cap.

func FuzzReadFrame(f *testing.F) {
	for _, name := range []string{"metadata_request", "metadata_reply", "probe_reply", "legacy_request", "connection_reply"} {
		f.Add(loadHex(f, name))
	}
	f.Add(binary.LittleEndian.AppendUint64(nil, ^uint64(0)))
	f.Add([]byte{})
	f.Fuzz(func(t *testing.T, data []byte) {
		const maxLen = 4096
		typ, body, err := ReadFrame(bytes.NewReader(data), maxLen)
		if err != nil {
			return
		}
		if len(body) > maxLen {
			t.Fatalf("body of %d bytes past the %d cap", len(body), maxLen)
		}
		if typ > FrameProbe && typ != FrameLegacy {
			t.Fatalf("type %d", typ)
		}
	})
}

func FuzzDecodeSegment(f *testing.F) {
	for _, name := range []string{"metadata_request", "metadata_reply", "metadata_reply_v1", "metadata_reply_multiproto"} {
		f.Add(loadHex(f, name)[9:])
	}
	f.Add([]byte(`{"buffers":[{"addr":1e400}]}`))
	f.Add([]byte(`{"buffers":[],"kvflow_ops":1,"name":"h:1","protocol":"tcp","tcp_data_port":1,"tcp_proto_version":2}`))
	f.Fuzz(func(t *testing.T, data []byte) {
		d, err := DecodeSegment(data)
		if err != nil {
			return
		}
		if !d.HasProtocol("tcp") || d.TCPDataPort <= 0 || d.TCPDataPort > 65535 {
			t.Fatalf("accepted %+v", d)
		}
		for _, b := range d.Buffers {
			if b.Addr == 0 || b.Length == 0 || b.Addr+b.Length < b.Addr {
				t.Fatalf("accepted buffer %+v", b)
			}
		}
		// What we accept, we can re-encode and accept again.
		if _, err := DecodeSegment(EncodeSegment(d)); err != nil {
			t.Fatalf("re-decode: %v", err)
		}
	})
}

func FuzzParseHeader(f *testing.F) {
	for _, name := range []string{"header_read_v2", "header_write_v2", "header_write_v1"} {
		f.Add(loadHex(f, name))
	}
	f.Fuzz(func(t *testing.T, data []byte) {
		var b [HeaderSize]byte
		copy(b[:], data)
		h, err := ParseHeader(&b)
		if err == nil {
			var out [HeaderSize]byte
			PutHeader(&out, h)
			if !bytes.Equal(out[:17], b[:17]) {
				t.Fatalf("round trip % x -> % x", b, out)
			}
		}
		var s [StatusSize]byte
		copy(s[:], data)
		_ = ParseStatus(&s)
	})
}

// FuzzParseStrided: whatever the bytes, ParseStrided never panics, and a
// request it accepts is whole rows whose span neither overflows nor wraps,
// and re-encodes to the same bytes (padding aside).
func FuzzParseStrided(f *testing.F) {
	f.Add(stridedReq(1<<20, 0x7f0000000000, 1024, 2048, OpcodeReadStrided|OpcodeV2))
	f.Add(stridedReq(1<<20, 0x7f0000000000, 1, 1<<45, OpcodeReadStrided|OpcodeV2))
	f.Add(stridedReq(2048, ^uint64(0)-4096, 1024, 1<<20, OpcodeReadStrided|OpcodeV2))
	f.Add(stridedReq(4096, 1, 1024, 512, OpcodeReadStrided))
	f.Fuzz(func(t *testing.T, data []byte) {
		var b [StridedHeaderSize]byte
		copy(b[:], data)
		s, err := ParseStrided(&b)
		if err != nil {
			if !errors.Is(err, ErrBadStrided) {
				t.Fatalf("error %v is not ErrBadStrided", err)
			}
			return
		}
		if s.Row == 0 || s.Rows == 0 || s.Pitch < s.Row || s.Rows > ^uint64(0)/s.Row {
			t.Fatalf("accepted %+v", s)
		}
		hi, lo := bits.Mul64(s.Rows-1, s.Pitch)
		span, carry := bits.Add64(lo, s.Row, 0)
		if hi != 0 || carry != 0 || span != s.Span() || s.Addr+span < s.Addr {
			t.Fatalf("accepted %+v: span overflows or wraps", s)
		}
		var out [StridedHeaderSize]byte
		PutStrided(&out, s)
		if !bytes.Equal(out[:17], b[:17]) || !bytes.Equal(out[HeaderSize:], b[HeaderSize:]) {
			t.Fatalf("round trip % x -> % x", b, out)
		}
	})
}
