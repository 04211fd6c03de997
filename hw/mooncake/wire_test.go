package mooncake

import (
	"bytes"
	"encoding/binary"
	"errors"
	"io"
	"testing"
)

func TestFrames(t *testing.T) {
	cases := []struct {
		name     string
		in       []byte
		maxLen   int
		wantType FrameType
		wantBody string
		wantErr  error
	}{
		{"metadata", AppendFrame(nil, FrameMetadata, []byte(`{"a":1}`)), 0, FrameMetadata, `{"a":1}`, nil},
		{"probe", AppendFrame(nil, FrameProbe, []byte(`{}`)), 0, FrameProbe, `{}`, nil},
		{"legacy", AppendFrame(nil, FrameLegacy, []byte(`{"x":2}`)), 0, FrameLegacy, `{"x":2}`, nil},
		{"empty typed payload", AppendFrame(nil, FrameNotify, nil), 0, FrameNotify, ``, nil},
		{"zero length", binary.LittleEndian.AppendUint64(nil, 0), 0, 0, "", ErrFrameEmpty},
		{"over default cap", binary.LittleEndian.AppendUint64(nil, DefaultMaxFrame+1), 0, 0, "", ErrFrameTooLarge},
		{"huge", binary.LittleEndian.AppendUint64(nil, ^uint64(0)), 0, 0, "", ErrFrameTooLarge},
		{"over custom cap", AppendFrame(nil, FrameMetadata, make([]byte, 2000)), 1024, 0, "", ErrFrameTooLarge},
		{"unknown type", AppendFrame(nil, FrameType(0x90), []byte(`{}`)), 0, 0, "", ErrFrameType},
		{"type 4", AppendFrame(nil, FrameType(4), []byte(`{}`)), 0, 0, "", ErrFrameType},
		{"short prefix", []byte{1, 0, 0}, 0, 0, "", io.ErrUnexpectedEOF},
		{"short body", AppendFrame(nil, FrameMetadata, []byte(`{"a":1}`))[:12], 0, 0, "", io.ErrUnexpectedEOF},
		{"nothing", nil, 0, 0, "", io.EOF},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			typ, body, err := ReadFrame(bytes.NewReader(tc.in), tc.maxLen)
			if tc.wantErr != nil {
				if !errors.Is(err, tc.wantErr) {
					t.Fatalf("err %v, want %v", err, tc.wantErr)
				}
				return
			}
			if err != nil || typ != tc.wantType || string(body) != tc.wantBody {
				t.Fatalf("got %v %q %v", typ, body, err)
			}
		})
	}
}

func TestDecodeSegment(t *testing.T) {
	good := `{"buffers":[{"addr":18446744073709543424,"length":4096,"name":"b"}],"name":"h:1","protocol":"tcp","tcp_data_port":2}`
	d, err := DecodeSegment([]byte(good))
	if err != nil {
		t.Fatal(err)
	}
	if d.Buffers[0].Addr != 18446744073709543424 || d.TCPProtoVersion != 1 {
		t.Fatalf("%+v", d)
	}
	bad := map[string]string{
		"not json":          `{`,
		"addr as float":     `{"buffers":[{"addr":1.5e10,"length":1,"name":"b"}],"name":"h","protocol":"tcp","tcp_data_port":2}`,
		"addr negative":     `{"buffers":[{"addr":-1,"length":1,"name":"b"}],"name":"h","protocol":"tcp","tcp_data_port":2}`,
		"addr string":       `{"buffers":[{"addr":"1","length":1,"name":"b"}],"name":"h","protocol":"tcp","tcp_data_port":2}`,
		"addr too big":      `{"buffers":[{"addr":18446744073709551616,"length":1,"name":"b"}],"name":"h","protocol":"tcp","tcp_data_port":2}`,
		"zero addr":         `{"buffers":[{"addr":0,"length":1,"name":"b"}],"name":"h","protocol":"tcp","tcp_data_port":2}`,
		"zero length":       `{"buffers":[{"addr":1,"length":0,"name":"b"}],"name":"h","protocol":"tcp","tcp_data_port":2}`,
		"no name":           `{"buffers":[{"addr":1,"length":1,"name":""}],"name":"h","protocol":"tcp","tcp_data_port":2}`,
		"wraps":             `{"buffers":[{"addr":18446744073709551615,"length":2,"name":"b"}],"name":"h","protocol":"tcp","tcp_data_port":2}`,
		"no protocol":       `{"name":"h","tcp_data_port":2}`,
		"rdma":              `{"name":"h","protocol":"rdma","tcp_data_port":2}`,
		"protocol number":   `{"name":"h","protocol":7,"tcp_data_port":2}`,
		"no port":           `{"name":"h","protocol":"tcp"}`,
		"port range":        `{"name":"h","protocol":"tcp","tcp_data_port":70000}`,
		"port string":       `{"name":"h","protocol":"tcp","tcp_data_port":"2"}`,
		"version float":     `{"name":"h","protocol":"tcp","tcp_data_port":2,"tcp_proto_version":2.5}`,
		"timestamp integer": `{"name":"h","protocol":"tcp","tcp_data_port":2,"timestamp":5}`,
		"kvflow_ops string": `{"kvflow_ops":"1","name":"h","protocol":"tcp","tcp_data_port":2}`,
		"kvflow_ops float":  `{"kvflow_ops":1.5,"name":"h","protocol":"tcp","tcp_data_port":2}`,
		"array":             `[]`,
		"null":              `null`,
	}
	for name, in := range bad {
		if _, err := DecodeSegment([]byte(in)); !errors.Is(err, ErrBadSegment) {
			t.Errorf("%s: err %v", name, err)
		}
	}
}

func TestEncodeSegment(t *testing.T) {
	got := string(EncodeSegment(&SegmentDesc{Name: "a<b>&", Protocol: "tcp", TCPDataPort: 1, TCPProtoVersion: 2, Timestamp: "t"}))
	want := `{"buffers":[],"name":"a<b>&","protocol":"tcp","tcp_data_port":1,"tcp_proto_version":2,"timestamp":"t"}` + "\n"
	if got != want {
		t.Fatalf("got  %s\nwant %s", got, want)
	}
	// kvflow's extension, in its sorted place, and back.
	d := &SegmentDesc{Name: "h:1", Protocol: "tcp", TCPDataPort: 1, TCPProtoVersion: 2, Timestamp: "t", KvflowOps: KvflowOpStridedRead}
	got = string(EncodeSegment(d))
	want = `{"buffers":[],"kvflow_ops":1,"name":"h:1","protocol":"tcp","tcp_data_port":1,"tcp_proto_version":2,"timestamp":"t"}` + "\n"
	if got != want {
		t.Fatalf("got  %s\nwant %s", got, want)
	}
	back, err := DecodeSegment([]byte(got))
	if err != nil || back.KvflowOps != KvflowOpStridedRead {
		t.Fatalf("decoded %+v %v", back, err)
	}
}

func TestHeaderAndStatus(t *testing.T) {
	for _, h := range []Header{
		{Size: 1, Addr: 2, Opcode: OpcodeRead},
		{Size: ^uint64(0), Addr: ^uint64(0), Opcode: OpcodeWrite, V2: true},
	} {
		var b [HeaderSize]byte
		PutHeader(&b, h)
		if got, err := ParseHeader(&b); err != nil || got != h {
			t.Fatalf("%+v: %+v %v", h, got, err)
		}
	}
	for _, op := range []byte{2, 0x7f, 0x82, 0xff} {
		var b [HeaderSize]byte
		b[16] = op
		h, err := ParseHeader(&b)
		if !errors.Is(err, ErrBadHeader) || h.V2 != (op&0x80 != 0) {
			t.Fatalf("opcode %#x: %+v %v", op, h, err)
		}
	}
	var s [StatusSize]byte
	for v, want := range map[uint64]error{
		StatusOK: nil, StatusRejected: ErrRejected, StatusMagic | 7: ErrRejected,
		0: ErrBadStatus, 1: ErrBadStatus, 0x4D43545700000000: ErrBadStatus,
	} {
		PutStatus(&s, v)
		if err := ParseStatus(&s); !errors.Is(err, want) || (want == nil) != (err == nil) {
			t.Errorf("%#x: %v, want %v", v, err, want)
		}
	}
}
