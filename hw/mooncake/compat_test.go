package mooncake

import (
	"bufio"
	"bytes"
	"encoding/binary"
	"encoding/hex"
	"io"
	"os"
	"path/filepath"
	"reflect"
	"strings"
	"testing"
)

// loadHex reads testdata/frames/name.hex: '#' comment lines, then hex
// bytes separated by spaces (written by testdata/gen_frames.py from the
// Mooncake C++ source, not by this package's encoders).
func loadHex(tb testing.TB, name string) []byte {
	tb.Helper()
	f, err := os.Open(filepath.Join("testdata", "frames", name+".hex"))
	if err != nil {
		tb.Fatal(err)
	}
	defer f.Close()
	var out []byte
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		line := strings.TrimSpace(sc.Text())
		if line == "" || strings.HasPrefix(line, "#") {
			continue
		}
		b, err := hex.DecodeString(strings.ReplaceAll(line, " ", ""))
		if err != nil {
			tb.Fatalf("%s: %v", name, err)
		}
		out = append(out, b...)
	}
	return out
}

func TestCompatSegments(t *testing.T) {
	cases := []struct {
		file   string
		want   SegmentDesc
		parity bool // our encoder reproduces the bytes exactly
	}{
		{"metadata_request", SegmentDesc{
			Buffers: []BufferDesc{{Addr: 0x7f8a4c000000, Length: 64 << 20, Name: "10.0.0.2:17001"}},
			Name:    "10.0.0.2:17001", Protocol: "tcp", TCPDataPort: 15433, TCPProtoVersion: 2,
			Timestamp: "2025-06-01 12:00:00.123456",
		}, true},
		{"metadata_reply", SegmentDesc{
			Buffers: []BufferDesc{
				{Addr: 0x7f8d6a000000, Length: 1 << 20, Name: "10.0.0.1:17000"},
				{Addr: 0x7fffdeadbeef1234, Length: 4096, Name: "10.0.0.1:17000"},
			},
			Name: "10.0.0.1:17000", Protocol: "tcp", TCPDataPort: 15432, TCPProtoVersion: 2,
			Timestamp: "2025-06-01 12:00:00.654321",
		}, true},
		{"metadata_reply_v1", SegmentDesc{
			Buffers: []BufferDesc{}, Name: "10.0.0.3:17000", Protocol: "tcp", TCPDataPort: 16000, TCPProtoVersion: 1,
			Timestamp: "2024-12-24 08:00:00.000001",
		}, false},
		{"metadata_reply_multiproto", SegmentDesc{
			Buffers: []BufferDesc{{Addr: 0x7f8d6a000000, Length: 1 << 20, Name: "10.0.0.4:17000"}},
			Name:    "10.0.0.4:17000", Protocol: "tcp,hip", TCPDataPort: 15500, TCPProtoVersion: 2,
			Timestamp: "2025-06-01 12:00:00.000000",
		}, false},
	}
	for _, tc := range cases {
		t.Run(tc.file, func(t *testing.T) {
			raw := loadHex(t, tc.file)
			typ, payload, err := ReadFrame(bytes.NewReader(raw), DefaultMaxFrame)
			if err != nil || typ != FrameMetadata {
				t.Fatalf("ReadFrame: %v %v", typ, err)
			}
			got, err := DecodeSegment(payload)
			if err != nil {
				t.Fatal(err)
			}
			if !reflect.DeepEqual(*got, tc.want) {
				t.Fatalf("decoded\n%+v\nwant\n%+v", *got, tc.want)
			}
			if tc.parity {
				if enc := AppendFrame(nil, FrameMetadata, EncodeSegment(got)); !bytes.Equal(enc, raw) {
					t.Fatalf("encoding differs from Mooncake's\n got %q\nwant %q", enc, raw)
				}
			}
		})
	}
}

func TestCompatReplies(t *testing.T) {
	for file, want := range map[string][]byte{
		"probe_reply":      AppendFrame(nil, FrameProbe, replyProbe),
		"notify_reply":     AppendFrame(nil, FrameNotify, replyNotify),
		"connection_reply": AppendFrame(nil, FrameConnection, replyConnection),
	} {
		if got := loadHex(t, file); !bytes.Equal(got, want) {
			t.Errorf("%s: ours %q, Mooncake's %q", file, want, got)
		}
	}
	typ, payload, err := ReadFrame(bytes.NewReader(loadHex(t, "legacy_request")), DefaultMaxFrame)
	if err != nil || typ != FrameLegacy || payload[0] != '{' {
		t.Fatalf("legacy: %v %q %v", typ, payload, err)
	}
}

func TestCompatHeaders(t *testing.T) {
	cases := []struct {
		file string
		want Header
	}{
		{"header_read_v2", Header{Size: 262144, Addr: 0x7f8a4c100000, Opcode: OpcodeRead, V2: true}},
		{"header_write_v2", Header{Size: 1 << 20, Addr: 0x7f8a4c200000, Opcode: OpcodeWrite, V2: true}},
		{"header_write_v1", Header{Size: 4096, Addr: 0x7f8a4c300000, Opcode: OpcodeWrite}},
	}
	for _, tc := range cases {
		raw := loadHex(t, tc.file)
		if len(raw) != HeaderSize {
			t.Fatalf("%s: %d bytes", tc.file, len(raw))
		}
		got, err := ParseHeader((*[HeaderSize]byte)(raw))
		if err != nil || got != tc.want {
			t.Fatalf("%s: %+v %v", tc.file, got, err)
		}
		var enc [HeaderSize]byte
		PutHeader(&enc, got)
		if !bytes.Equal(enc[:17], raw[:17]) {
			t.Fatalf("%s: encoded % x", tc.file, enc)
		}
	}
	for file, want := range map[string]uint64{"status_ok": StatusOK, "status_rejected": StatusRejected} {
		raw := loadHex(t, file)
		var enc [StatusSize]byte
		PutStatus(&enc, want)
		if !bytes.Equal(enc[:], raw) {
			t.Fatalf("%s: ours % x, Mooncake's % x", file, enc, raw)
		}
	}
	if ParseStatus((*[StatusSize]byte)(loadHex(t, "status_ok"))) != nil {
		t.Fatal("status_ok not OK")
	}
}

// TestCompatServer replays a Mooncake initiator's recorded bytes against
// a serving engine and checks the answers.
func TestCompatServer(t *testing.T) {
	srv, _ := newEngine(t, testConfig())
	rem := register(t, srv, 1<<20, 7)

	exchange := func(file string) []byte {
		c := dial(t, srv.RPCPort())
		c.Write(loadHex(t, file))
		b, err := io.ReadAll(c)
		if err != nil {
			t.Fatalf("%s: %v", file, err)
		}
		return b
	}
	for file, want := range map[string]string{"probe_request": "probe_reply", "notify_request": "notify_reply"} {
		if got := exchange(file); !bytes.Equal(got, loadHex(t, want)) {
			t.Errorf("%s: got %q", file, got)
		}
	}
	if got := exchange("legacy_request"); !bytes.Equal(got, AppendFrame(nil, FrameLegacy, replyConnection)) {
		t.Errorf("legacy: got %q", got)
	}
	typ, payload, err := ReadFrame(bytes.NewReader(exchange("metadata_request")), DefaultMaxFrame)
	if err != nil || typ != FrameMetadata {
		t.Fatalf("metadata: %v %v", typ, err)
	}
	d, err := DecodeSegment(payload)
	if err != nil {
		t.Fatal(err)
	}
	if d.Name != srv.SessionID() || d.TCPDataPort != srv.DataPort() || d.TCPProtoVersion != 2 ||
		len(d.Buffers) != 1 || d.Buffers[0].Addr != AddrOf(rem) || d.Buffers[0].Length != 1<<20 {
		t.Fatalf("segment %+v", d)
	}

	// The recorded v2 READ header, garbage padding and all, pointed at
	// registered memory.
	hdr := loadHex(t, "header_read_v2")
	binary.LittleEndian.PutUint64(hdr[8:], AddrOf(rem[4096:]))
	c := dial(t, srv.DataPort())
	c.Write(hdr)
	resp := make([]byte, StatusSize+262144)
	if _, err := io.ReadFull(c, resp); err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(resp[:StatusSize], loadHex(t, "status_ok")) || !bytes.Equal(resp[StatusSize:], rem[4096:4096+262144]) {
		t.Fatal("READ answer differs")
	}
	// And the recorded v2 WRITE header: payload, then the ack.
	hdr = loadHex(t, "header_write_v2")
	binary.LittleEndian.PutUint64(hdr[8:], AddrOf(rem))
	payloadW := bytes.Repeat([]byte{0xa5}, 1<<20)
	c.Write(append(hdr, payloadW...))
	var st [StatusSize]byte
	if _, err := io.ReadFull(c, st[:]); err != nil || !bytes.Equal(st[:], loadHex(t, "status_ok")) {
		t.Fatalf("WRITE ack % x %v", st, err)
	}
	if !bytes.Equal(rem, payloadW) {
		t.Fatal("WRITE not applied")
	}
}
