package wire

import (
	"bytes"
	"encoding/hex"
	"errors"
	"math"
	"reflect"
	"strings"
	"testing"

	"github.com/vmihailenco/msgpack/v5"

	"github.com/kvflow/kvflow/hw/npu"
)

func testFingerprint() *npu.Fingerprint {
	return &npu.Fingerprint{
		Kind: npu.GQA, DType: npu.BF16, BlockSize: 16, KVHeads: 4, HeadDim: 128,
		Layers: 2, BlockLens: []int{16384, 16384}, NumBlocks: 1024,
		Prefill: npu.Sizes{TP: 2, PP: 1, PCP: 1, DCP: 1}, Decode: npu.Sizes{TP: 1, PP: 1, PCP: 1, DCP: 1},
		Rank: npu.RankPos{TP: 1},
	}
}

// TestMetadataCacheBytes pins the fingerprint's bytes (golden) and checks
// that it extends, never changes, the seed's four fields.
func TestMetadataCacheBytes(t *testing.T) {
	base := Metadata{EngineID: "e", TERPCPort: 1, KVCachesBaseAddr: []uint64{7}, NumBlocks: 1024}
	plain := EncodeMetadata(base)
	m := base
	m.Ext = Ext{Cache: testFingerprint()}
	b := EncodeMetadata(m)
	const golden = "81" + "a5" + "6361636865" + "8b" + // {"cache": map of 11
		"a46b696e64" + "a3677161" + // kind: gqa
		"a56474797065" + "a4626631 36" + // dtype: bf16
		"aa626c6f636b5f73697a65" + "10" + // block_size: 16
		"a86b765f6865616473" + "04" + // kv_heads: 4
		"a8686561645f64696d" + "cc80" + // head_dim: 128
		"a66c6179657273" + "02" + // layers: 2
		"a9626c6f636b5f6c656e" + "92cd4000cd4000" + // block_len: [16384, 16384]
		"aa6e756d5f626c6f636b73" + "cd0400" + // num_blocks: 1024
		"a770726566696c6c" + "94020101 01" + // prefill
		"a66465636f6465" + "9401010101" + // decode
		"a472616e6b" + "93010000" // rank
	want := append(append([]byte{0x85}, plain[1:]...), build("kvflow")...)
	want = append(want, mustHex(t, golden)...)
	if !bytes.Equal(b, want) {
		t.Fatalf("bytes\n%x\nwant\n%x", b, want)
	}
	got, err := DecodeMetadata(b)
	if err != nil || !reflect.DeepEqual(got, m) {
		t.Fatalf("round trip: %+v %v", got, err)
	}
	// A generic msgpack reader (the seed's msgspec ignores unknown fields)
	// sees the seed's four fields unchanged.
	var generic map[string]any
	if err := msgpack.Unmarshal(b, &generic); err != nil || generic["num_blocks"] == nil || len(generic) != 5 {
		t.Fatalf("generic decode: %v %v", generic, err)
	}
	// MLA and sparse caches, without topology: round trip.
	for _, f := range []*npu.Fingerprint{
		{Kind: npu.MLA, DType: npu.FP16, BlockSize: 128, KVHeads: 1, KVLoraRank: 512, QKRopeHeadDim: 64, Layers: 61, BlockLens: []int{131072, 16384}, NumBlocks: 1},
		{Kind: npu.Sparse, DType: npu.INT8, BlockSize: 1, KVHeads: 1, KVLoraRank: 1, QKRopeHeadDim: 1, IndexerDim: 1, Layers: 1, BlockLens: []int{1, 1, 1}, NumBlocks: MaxCacheValue},
	} {
		m.Ext = Ext{BootEpoch: 9, Cache: f}
		if got, err := DecodeMetadata(EncodeMetadata(m)); err != nil || !reflect.DeepEqual(got, m) {
			t.Fatalf("%v round trip: %+v %v", f.Kind, got, err)
		}
	}
}

func mustHex(t *testing.T, s string) []byte {
	t.Helper()
	b, err := hex.DecodeString(strings.ReplaceAll(s, " ", ""))
	if err != nil {
		t.Fatal(err)
	}
	return b
}

// TestMetadataCacheBadInput: a fingerprint of the wrong type or with an
// absurd value is malformed metadata, with an error naming the field.
func TestMetadataCacheBadInput(t *testing.T) {
	head := build([]byte{0x85}, "engine_id", "E", "te_rpc_port", 1, "kv_caches_base_addr", []byte{0x90}, "num_blocks", 1, "kvflow", []byte{0x81}, "cache")
	// fields builds a cache map from key, value pairs (values: build parts).
	fields := func(kv ...any) []byte {
		return build(append([]any{[]byte{byte(0x80 | len(kv)/2)}}, kv...)...)
	}
	good := []any{"kind", "gqa", "dtype", "bf16", "block_size", 16, "layers", 2, "block_len", []byte{0x92, 0x01, 0x01}, "num_blocks", 8}
	with := func(key string, v any) []byte {
		kv := append([]any(nil), good...)
		for i := 0; i < len(kv); i += 2 {
			if kv[i] == key {
				kv[i+1] = v
				return fields(kv...)
			}
		}
		return fields(append(kv, key, v)...)
	}
	without := func(key string) []byte {
		var kv []any
		for i := 0; i < len(good); i += 2 {
			if good[i] != key {
				kv = append(kv, good[i], good[i+1])
			}
		}
		return fields(kv...)
	}
	if m, err := DecodeMetadata(build(head, fields(good...))); err != nil || m.Ext.Cache == nil || m.Ext.Cache.BlockSize != 16 {
		t.Fatalf("good fingerprint: %+v %v", m.Ext.Cache, err)
	}
	for _, tc := range []struct {
		name, field string
		cache       []byte
	}{
		{"not a map", "kvflow.cache", build([]byte{0x93, 1, 2, 3})},
		{"block_size str", "kvflow.cache.block_size", with("block_size", "16")},
		{"block_size zero", "kvflow.cache.block_size", with("block_size", 0)},
		{"block_size huge", "kvflow.cache.block_size", with("block_size", uint64(1)<<40)},
		{"block_size negative", "kvflow.cache.block_size", with("block_size", []byte{0xff})},
		{"block_size float", "kvflow.cache.block_size", with("block_size", []byte{0xcb, 0x40, 0x30, 0, 0, 0, 0, 0, 0})},
		{"layers nil", "kvflow.cache.layers", with("layers", []byte{0xc0})},
		{"num_blocks max uint64", "kvflow.cache.num_blocks", with("num_blocks", uint64(math.MaxUint64))},
		{"kind unknown", "kvflow.cache.kind", with("kind", "mamba")},
		{"kind int", "kvflow.cache.kind", with("kind", 1)},
		{"dtype unknown", "kvflow.cache.dtype", with("dtype", "fp4")},
		{"block_len map", "kvflow.cache.block_len", with("block_len", []byte{0x80})},
		{"block_len empty", "kvflow.cache.block_len", with("block_len", []byte{0x90})},
		{"block_len too many", "kvflow.cache.block_len", with("block_len", []byte{0x94, 1, 1, 1, 1})},
		{"block_len wrong for kind", "kvflow.cache.block_len", with("block_len", []byte{0x93, 1, 1, 1})},
		{"block_len zero", "kvflow.cache.block_len[1]", with("block_len", []byte{0x92, 1, 0})},
		{"kv_heads huge", "kvflow.cache.kv_heads", with("kv_heads", uint64(1)<<32)},
		{"prefill short", "kvflow.cache.prefill", with("prefill", []byte{0x92, 1, 1})},
		{"rank str", "kvflow.cache.rank[0]", with("rank", build([]byte{0x93}, "a", 0, 0))},
		{"missing block_size", "kvflow.cache", without("block_size")},
		{"missing kind", "kvflow.cache", without("kind")},
		{"duplicate", "kvflow.cache.layers", fields(append(append([]any(nil), good...), "layers", 2)...)},
	} {
		t.Run(tc.name, func(t *testing.T) {
			_, err := DecodeMetadata(build(head, tc.cache))
			var de *DecodeError
			if !errors.Is(err, ErrMalformed) || !errors.As(err, &de) || de.Field != tc.field {
				t.Fatalf("error %v, want a DecodeError on %s", err, tc.field)
			}
		})
	}
	// Unknown keys inside the fingerprint are skipped (room for more).
	if _, err := DecodeMetadata(build(head, with("future", []byte{0x81, 0xa1, 'x', 0x90}))); err != nil {
		t.Fatalf("unknown key: %v", err)
	}
}
