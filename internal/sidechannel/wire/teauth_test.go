package wire

import (
	"bytes"
	"errors"
	"reflect"
	"strings"
	"testing"
)

// TestMetadataTEAuth: "te_auth" (bin, 32 bytes) in the kvflow map after
// the other fields, omitted when nil, so the seed's bytes never change;
// wrong lengths, types and duplicates are malformed.
func TestMetadataTEAuth(t *testing.T) {
	base := Metadata{EngineID: "e", TERPCPort: 1, KVCachesBaseAddr: []uint64{7}, NumBlocks: 2}
	plain := EncodeMetadata(base)
	tok := bytes.Repeat([]byte{0xab}, TEAuthSize)
	m := base
	m.Ext = Ext{BootEpoch: 3, TEAuth: (*[TEAuthSize]byte)(tok)}
	b := EncodeMetadata(m)
	want := append(append([]byte{0x85}, plain[1:]...), build("kvflow", []byte{0x82}, "boot_epoch", 3, "te_auth", append([]byte{0xc4, 32}, tok...))...)
	if !bytes.Equal(b, want) {
		t.Fatalf("%x, want %x", b, want)
	}
	got, err := DecodeMetadata(b)
	if err != nil || !reflect.DeepEqual(got, m) {
		t.Fatalf("round trip: %+v %v", got, err)
	}
	tok[0] = 0       // m's token is tok itself
	b[len(b)-1] ^= 1 // the decoded token is a copy, not an alias of the input
	if got.Ext.TEAuth[TEAuthSize-1] != 0xab {
		t.Fatal("decoded token aliases the input")
	}
	m.Ext = Ext{}
	if got := EncodeMetadata(m); !bytes.Equal(got, plain) {
		t.Fatalf("no token changed the seed bytes: %x", got)
	}
	head := build([]byte{0x85}, "engine_id", "E", "te_rpc_port", 1, "kv_caches_base_addr", []byte{0x90}, "num_blocks", 1, "kvflow")
	for name, tail := range map[string][]byte{
		"short":     build([]byte{0x81}, "te_auth", append([]byte{0xc4, 31}, tok[:31]...)),
		"long":      build([]byte{0x81}, "te_auth", append([]byte{0xc4, 33}, append(tok, 0)...)),
		"empty":     build([]byte{0x81}, "te_auth", []byte{0xc4, 0}),
		"str":       build([]byte{0x81}, "te_auth", string(tok)),
		"nil":       build([]byte{0x81}, "te_auth", []byte{0xc0}),
		"duplicate": build([]byte{0x82}, "te_auth", append([]byte{0xc4, 32}, tok...), "te_auth", append([]byte{0xc4, 32}, tok...)),
	} {
		if _, err := DecodeMetadata(build(head, tail)); !errors.Is(err, ErrMalformed) || !strings.Contains(err.Error(), "te_auth") {
			t.Errorf("%s: %v", name, err)
		}
	}
}
