package wire

import (
	"bytes"
	"errors"
	"reflect"
	"strings"
	"testing"
)

func testSameHost() *SameHost {
	return &SameHost{
		HostID: "boot:b", Path: "/dev/shm/c", Dev: 5, Ino: 300, Size: 1 << 21,
		Header: []byte{1, 2, 3}, Grants: "/dev/shm/c.grants", GrantsDev: 5, GrantsIno: 301, Epoch: 0x1122334455667788,
	}
}

// TestMetadataSameHost: "same_host" (a map) last in the kvflow map, every
// field in its order; omitted when nil, so the seed's bytes never change;
// bad types, values, missing and duplicate fields are malformed, naming
// the field.
func TestMetadataSameHost(t *testing.T) {
	base := Metadata{EngineID: "e", TERPCPort: 1, KVCachesBaseAddr: []uint64{7}, NumBlocks: 2}
	plain := EncodeMetadata(base)
	m := base
	m.Ext = Ext{BootEpoch: 3, SameHost: testSameHost()}
	b := EncodeMetadata(m)
	sh := build([]byte{0x8a}, "host", "boot:b", "path", "/dev/shm/c", "dev", 5, "ino", []byte{0xcd, 0x01, 0x2c}, "size", []byte{0xce, 0, 0x20, 0, 0},
		"header", []byte{0xc4, 3, 1, 2, 3}, "grants", "/dev/shm/c.grants", "grants_dev", 5, "grants_ino", []byte{0xcd, 0x01, 0x2d},
		"epoch", []byte{0xcf, 0x11, 0x22, 0x33, 0x44, 0x55, 0x66, 0x77, 0x88})
	want := append(append([]byte{0x85}, plain[1:]...), build("kvflow", []byte{0x82}, "boot_epoch", 3, "same_host", sh)...)
	if !bytes.Equal(b, want) {
		t.Fatalf("%x\nwant %x", b, want)
	}
	got, err := DecodeMetadata(b)
	if err != nil || !reflect.DeepEqual(got, m) {
		t.Fatalf("round trip: %+v %v", got, err)
	}
	b[bytes.Index(b, []byte{0xc4, 3, 1, 2, 3})+2] = 9
	if got.Ext.SameHost.Header[0] != 1 {
		t.Fatal("decoded header aliases the input")
	}
	m.Ext = Ext{}
	if got := EncodeMetadata(m); !bytes.Equal(got, plain) {
		t.Fatalf("no claim changed the seed bytes: %x", got)
	}

	head := build([]byte{0x85}, "engine_id", "E", "te_rpc_port", 1, "kv_caches_base_addr", []byte{0x90}, "num_blocks", 1, "kvflow", []byte{0x81}, "same_host")
	fields := func(skip string, extra ...any) []byte {
		kv := []any{"host", "h", "path", "/p", "dev", 1, "ino", 2, "size", 3, "header", []byte{0xc4, 1, 0}, "grants", "/g", "grants_dev", 1, "grants_ino", 4, "epoch", 9}
		var out []any
		n := 0
		for i := 0; i < len(kv); i += 2 {
			if kv[i] == skip {
				continue
			}
			out = append(out, kv[i], kv[i+1])
			n++
		}
		out = append(out, extra...)
		n += len(extra) / 2
		return build(append([]any{[]byte{0x80 | byte(n)}}, out...)...)
	}
	if _, err := DecodeMetadata(build(head, fields("", "future", "x"))); err != nil {
		t.Fatalf("unknown key not skipped: %v", err)
	}
	for _, tc := range []struct {
		name, field string
		b           []byte
	}{
		{"not a map", "same_host", []byte{0x91, 1}},
		{"missing host", "same_host", fields("host")},
		{"missing epoch", "same_host", fields("epoch")},
		{"missing header", "same_host", fields("header")},
		{"empty host", "same_host.host", fields("host", "host", "")},
		{"long path", "same_host.path", fields("path", "path", strings.Repeat("a", 4097))},
		{"path bin", "same_host.path", fields("path", "path", []byte{0xc4, 1, 'a'})},
		{"dev str", "same_host.dev", fields("dev", "dev", "1")},
		{"dev negative", "same_host.dev", fields("dev", "dev", []byte{0xff})},
		{"size zero", "same_host.size", fields("size", "size", 0)},
		{"epoch zero", "same_host.epoch", fields("epoch", "epoch", 0)},
		{"header str", "same_host.header", fields("header", "header", "x")},
		{"header empty", "same_host.header", fields("header", "header", []byte{0xc4, 0})},
		{"header long", "same_host.header", fields("header", "header", append([]byte{0xc5, 0x10, 0x01}, make([]byte, 4097)...))},
		{"duplicate", "same_host.ino", fields("", "ino", 2)},
	} {
		_, err := DecodeMetadata(build(head, tc.b))
		if !errors.Is(err, ErrMalformed) || !strings.Contains(err.Error(), tc.field) {
			t.Errorf("%s: %v", tc.name, err)
		}
	}
	dup := build([]byte{0x85}, "engine_id", "E", "te_rpc_port", 1, "kv_caches_base_addr", []byte{0x90}, "num_blocks", 1, "kvflow", []byte{0x82},
		"same_host", fields(""), "same_host", fields(""))
	if _, err := DecodeMetadata(dup); !errors.Is(err, ErrMalformed) {
		t.Errorf("duplicate same_host: %v", err)
	}
}

// FuzzDecodeSameHost: any bytes in the same_host map decode or fail as
// malformed; what decodes re-encodes to the same claim and obeys the
// bounds.
func FuzzDecodeSameHost(f *testing.F) {
	m := Metadata{EngineID: "e", TERPCPort: 1, KVCachesBaseAddr: []uint64{7}, NumBlocks: 2, Ext: Ext{SameHost: testSameHost()}}
	f.Add(EncodeMetadata(m))
	m.Ext.BootEpoch = 9
	f.Add(EncodeMetadata(m))
	f.Add(build([]byte{0x85}, "engine_id", "E", "te_rpc_port", 1, "kv_caches_base_addr", []byte{0x90}, "num_blocks", 1, "kvflow", []byte{0x81}, "same_host", []byte{0x81}, "host", ""))
	f.Fuzz(func(t *testing.T, b []byte) {
		m, err := DecodeMetadata(b)
		if err != nil {
			var re *RemoteError
			if !errors.Is(err, ErrMalformed) && !errors.As(err, &re) {
				t.Fatalf("unclassified error %v", err)
			}
			return
		}
		if s := m.Ext.SameHost; s != nil {
			if s.HostID == "" || s.Path == "" || s.Grants == "" || len(s.Header) == 0 || s.Size == 0 || s.Epoch == 0 ||
				len(s.Path) > maxSHString || len(s.Header) > maxSHHeader {
				t.Fatalf("accepted a claim out of bounds: %+v", s)
			}
		}
		again, err := DecodeMetadata(EncodeMetadata(m))
		if err != nil || !reflect.DeepEqual(again, m) {
			t.Fatalf("re-encode of %+v: %+v %v", m, again, err)
		}
	})
}
