package wire

import (
	"bytes"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"math"
	"os"
	"path/filepath"
	"reflect"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/vmihailenco/msgpack/v5"

	"github.com/kvflow/kvflow/hw/npu"
)

// vectorFile is the seed's captured side-channel bytes (see its description):
// $KVFLOW_SEEDREF_DIR/wire_bytes.json when that set has one (another vector
// set; scripts/seedref/gen.py does not write this family), else the repo copy.
var vectorFile = func() string {
	if d := os.Getenv("KVFLOW_SEEDREF_DIR"); d != "" {
		if p := filepath.Join(d, "wire_bytes.json"); fileExists(p) {
			return p
		}
	}
	return filepath.Join("..", "..", "..", "testdata", "seedref", "wire_bytes.json")
}()

func fileExists(p string) bool {
	_, err := os.Stat(p)
	return err == nil
}

type vectorCase struct {
	Kind        string          `json:"kind"`
	RequestID   *string         `json:"request_id"`
	PythonValue json.RawMessage `json:"python_value"`
	Metadata    *struct {
		EngineID         string   `json:"engine_id"`
		TERPCPort        int      `json:"te_rpc_port"`
		KVCachesBaseAddr []uint64 `json:"kv_caches_base_addr"`
		NumBlocks        int      `json:"num_blocks"`
	} `json:"metadata"`
	BytesHex string     `json:"bytes_hex"`
	Dialogue string     `json:"dialogue"`
	FramesIn [][]string `json:"frames_in"`
	Replies  [][]string `json:"replies"`
}

func loadVectors(t testing.TB) []vectorCase {
	t.Helper()
	raw, err := os.ReadFile(vectorFile)
	if err != nil {
		t.Fatalf("read vectors: %v", err)
	}
	var f struct {
		Cases []vectorCase `json:"cases"`
	}
	if err := json.Unmarshal(raw, &f); err != nil {
		t.Fatalf("parse vectors: %v", err)
	}
	if len(f.Cases) == 0 {
		t.Fatal("no cases in vectors")
	}
	return f.Cases
}

func unhex(t testing.TB, s string) []byte {
	t.Helper()
	b, err := hex.DecodeString(s)
	if err != nil {
		t.Fatalf("hex %q: %v", s, err)
	}
	return b
}

// TestSeedVectors checks every case of wire_bytes.json: encoders produce the
// seed's bytes, decoders read them back, and the recorded ROUTER dialogues
// decode to what the seed did with them.
func TestSeedVectors(t *testing.T) {
	counts := map[string]int{}
	cases := loadVectors(t)
	dialogueMeta := seedDialogueMetadata(t, cases)
	for i, c := range cases {
		counts[c.Kind]++
		t.Run(fmt.Sprintf("%03d_%s", i, c.Kind), func(t *testing.T) {
			switch c.Kind {
			case "recv_thread_get_meta":
				want := unhex(t, c.BytesHex)
				if got := EncodeGetMeta(); !bytes.Equal(got, want) {
					t.Fatalf("EncodeGetMeta = %x, want %x", got, want)
				}
				req, err := DecodeRequest(want)
				if err != nil || !reflect.DeepEqual(req, Request{Kind: KindGetMeta}) {
					t.Fatalf("DecodeRequest = %+v, %v", req, err)
				}
			case "recv_thread_done_recving":
				if c.RequestID == nil {
					t.Fatal("case without request_id")
				}
				want := unhex(t, c.BytesHex)
				if got := EncodeDoneRecving(*c.RequestID); !bytes.Equal(got, want) {
					t.Fatalf("EncodeDoneRecving(%q) = %x, want %x", *c.RequestID, got, want)
				}
				req, err := DecodeRequest(want)
				if err != nil || !reflect.DeepEqual(req, Request{Kind: KindDoneRecving, RequestID: *c.RequestID}) {
					t.Fatalf("DecodeRequest = %+v, %v", req, err)
				}
			case "agent_metadata":
				if c.Metadata == nil {
					t.Fatal("case without metadata")
				}
				m := Metadata{
					EngineID:         c.Metadata.EngineID,
					TERPCPort:        c.Metadata.TERPCPort,
					KVCachesBaseAddr: c.Metadata.KVCachesBaseAddr,
					NumBlocks:        c.Metadata.NumBlocks,
				}
				if m.KVCachesBaseAddr == nil {
					m.KVCachesBaseAddr = []uint64{}
				}
				want := unhex(t, c.BytesHex)
				if got := EncodeMetadata(m); !bytes.Equal(got, want) {
					t.Fatalf("EncodeMetadata(%+v)\n got %x\nwant %x", m, got, want)
				}
				got, err := DecodeMetadata(want)
				if err != nil {
					t.Fatalf("DecodeMetadata: %v", err)
				}
				if !reflect.DeepEqual(got, m) {
					t.Fatalf("DecodeMetadata = %+v, want %+v", got, m)
				}
			case "send_thread_dialogue":
				checkDialogue(t, c, dialogueMeta)
			default:
				t.Fatalf("unknown vector kind %q: extend this test", c.Kind)
			}
		})
	}
	for _, k := range []string{"recv_thread_get_meta", "recv_thread_done_recving", "agent_metadata", "send_thread_dialogue"} {
		if counts[k] == 0 {
			t.Errorf("no %s cases in vectors", k)
		}
	}
}

// seedDialogueMetadata is what the seed's prefill answered GET_META with in
// the recorded dialogues, taken from the replies themselves (any vector set:
// no engine id, port or address of the public set is assumed). Every such
// reply must be the same metadata.
func seedDialogueMetadata(t *testing.T, cases []vectorCase) Metadata {
	t.Helper()
	var m Metadata
	have := false
	for _, c := range cases {
		if c.Kind != "send_thread_dialogue" {
			continue
		}
		for _, rep := range c.Replies {
			if len(rep) < 3 {
				continue
			}
			b, err := hex.DecodeString(rep[len(rep)-1])
			if err != nil {
				continue
			}
			got, err := DecodeMetadata(b)
			if err != nil {
				continue
			}
			if have && !reflect.DeepEqual(got, m) {
				t.Fatalf("%s: the seed answered GET_META with %+v and elsewhere %+v", c.Dialogue, got, m)
			}
			m, have = got, true
		}
	}
	if !have {
		t.Fatal("vectors: no GET_META reply in the seed's dialogues")
	}
	return m
}

// checkDialogue replays the seed's ROUTER frame handling on the recorded
// frames with the pure decoder: a frame set the seed answered must decode to
// a request whose reply bytes equal the seed's (meta is what the dialogues'
// prefill serves); one it rejected must fail.
func checkDialogue(t *testing.T, c vectorCase, meta Metadata) {
	replies := c.Replies
	for _, frames := range c.FramesIn {
		var payload [][]byte
		for _, f := range frames[min(1, len(frames)):] {
			if f != "" {
				payload = append(payload, unhex(t, f))
			}
		}
		var reply []byte
		if len(frames) >= 2 && len(payload) == 1 {
			req, err := DecodeRequest(payload[0])
			if err == nil {
				switch req.Kind {
				case KindGetMeta:
					reply = EncodeMetadata(meta)
				case KindDoneRecving:
					reply = []byte(AckReply)
				}
			}
		}
		if reply == nil {
			continue // the seed drops it; so must the decoder reject it
		}
		if len(replies) == 0 {
			t.Fatalf("%s: decoder accepted frames %v the seed did not answer", c.Dialogue, frames)
		}
		want := replies[0]
		replies = replies[1:]
		if want[0] != frames[0] || want[1] != "" {
			t.Fatalf("%s: seed reply envelope %v", c.Dialogue, want)
		}
		if got := hex.EncodeToString(reply); got != want[2] {
			t.Fatalf("%s: reply %s, seed %s", c.Dialogue, got, want[2])
		}
	}
	if len(replies) != 0 {
		t.Fatalf("%s: seed answered %d frame sets the decoder rejected", c.Dialogue, len(replies))
	}
}

// TestRenewBytes pins RENEW's bytes: a msgpack array like the seed's
// requests, bin tag "renew_msg", then an array of str ids.
func TestRenewBytes(t *testing.T) {
	b := EncodeRenew([]string{"a", "b"})
	want := "92" + "c409" + hex.EncodeToString([]byte("renew_msg")) + "92" + "a161" + "a162"
	if got := hex.EncodeToString(b); got != want {
		t.Fatalf("renew bytes %s, want %s", got, want)
	}
	// A generic msgpack reader sees [bytes, [str, str]].
	var generic []any
	if err := msgpack.Unmarshal(b, &generic); err != nil {
		t.Fatal(err)
	}
	if len(generic) != 2 || string(generic[0].([]byte)) != MsgRenew || !reflect.DeepEqual(generic[1], []any{"a", "b"}) {
		t.Fatalf("generic decode: %#v", generic)
	}
	ids := make([]string, MaxRenewIDs)
	for i := range ids {
		ids[i] = strings.Repeat("x", 200) + strconv.Itoa(i)
	}
	big := EncodeRenew(ids)
	if len(big) >= 1<<20 {
		t.Fatalf("a full RENEW of 200-byte ids is %d bytes: over the server's 1 MiB limit", len(big))
	}
	got, err := DecodeRequest(big)
	if err != nil || got.Kind != KindRenew || !reflect.DeepEqual(got.RequestIDs, ids) {
		t.Fatalf("round trip of %d ids: %v", len(ids), err)
	}
	if !reflect.DeepEqual(EncodeRequest(got), big) {
		t.Fatal("EncodeRequest(KindRenew) differs")
	}
	if KindRenew.String() != "renew" {
		t.Fatal(KindRenew.String())
	}
}

// TestDoneBatchMsgID pins the optional message id of done_batch_msg: a
// third element, uint; 0 sends the two-element form; a wrongly typed id is
// a bad message, not a skipped one.
func TestDoneBatchMsgID(t *testing.T) {
	b := AppendDoneBatchMsg(nil, []string{"a"}, 0x0102030405060708)
	const golden = "93" + "c40e" + "646f6e655f62617463685f6d7367" + "91" + "a161" + "cf0102030405060708"
	if got := hex.EncodeToString(b); got != golden {
		t.Fatalf("bytes %s, want %s", got, golden)
	}
	got, err := DecodeRequest(b)
	if err != nil || got.Kind != KindDoneBatch || got.MsgID != 0x0102030405060708 || !reflect.DeepEqual(got.RequestIDs, []string{"a"}) {
		t.Fatalf("decode: %+v %v", got, err)
	}
	if !reflect.DeepEqual(EncodeRequest(got), b) {
		t.Fatal("EncodeRequest with MsgID differs")
	}
	if !reflect.DeepEqual(AppendDoneBatchMsg(nil, []string{"a"}, 0), EncodeDoneBatch([]string{"a"})) {
		t.Fatal("msg id 0 must send the two-element form")
	}
	if got, err := DecodeRequest(EncodeDoneBatch([]string{"a"})); err != nil || got.MsgID != 0 {
		t.Fatalf("without an id: %+v %v", got, err)
	}
	for name, tail := range map[string]string{"str": "a178", "negative": "ff", "nil": "c0"} {
		bad, _ := hex.DecodeString("93" + "c40e" + "646f6e655f62617463685f6d7367" + "91" + "a161" + tail)
		if _, err := DecodeRequest(bad); !errors.Is(err, ErrMalformed) || !strings.Contains(err.Error(), "request[2]") {
			t.Errorf("%s msg id: %v", name, err)
		}
	}
}

// TestDoneBatchBytes pins done_batch_msg's bytes (golden): a msgpack array
// like the seed's requests, bin tag "done_batch_msg", then a non-empty array
// of str ids; and the bounds of one message.
func TestDoneBatchBytes(t *testing.T) {
	b := EncodeDoneBatch([]string{"a", "b"})
	const golden = "92" + "c40e" + "646f6e655f62617463685f6d7367" + "92" + "a161" + "a162"
	if got := hex.EncodeToString(b); got != golden {
		t.Fatalf("done_batch bytes %s, want %s", got, golden)
	}
	var generic []any
	if err := msgpack.Unmarshal(b, &generic); err != nil {
		t.Fatal(err)
	}
	if len(generic) != 2 || string(generic[0].([]byte)) != MsgDoneBatch || !reflect.DeepEqual(generic[1], []any{"a", "b"}) {
		t.Fatalf("generic decode: %#v", generic)
	}
	ids := make([]string, MaxDoneBatchIDs)
	for i := range ids {
		ids[i] = strings.Repeat("x", 200) + strconv.Itoa(i)
	}
	big := EncodeDoneBatch(ids)
	if len(big) >= 1<<20 {
		t.Fatalf("a full batch of 200-byte ids is %d bytes: over the server's 1 MiB limit", len(big))
	}
	got, err := DecodeRequest(big)
	if err != nil || got.Kind != KindDoneBatch || !reflect.DeepEqual(got.RequestIDs, ids) {
		t.Fatalf("round trip of %d ids: %v", len(ids), err)
	}
	if !reflect.DeepEqual(EncodeRequest(got), big) {
		t.Fatal("EncodeRequest(KindDoneBatch) differs")
	}
	if KindDoneBatch.String() != "done_batch" {
		t.Fatal(KindDoneBatch.String())
	}
	_, err = DecodeRequest(EncodeDoneBatch(nil))
	if !errors.Is(err, ErrMalformed) || !strings.Contains(err.Error(), "0 request ids") {
		t.Fatalf("empty batch: %v", err)
	}
}

// TestMetadataBatchDone: "batch_done": true in the kvflow map, omitted
// when false; false and non-bool values on the wire.
func TestMetadataBatchDone(t *testing.T) {
	base := Metadata{EngineID: "e", TERPCPort: 1, KVCachesBaseAddr: []uint64{7}, NumBlocks: 2}
	plain := EncodeMetadata(base)
	m := base
	m.Ext = Ext{BootEpoch: 3, LeaseTTL: time.Second, BatchDone: true}
	b := EncodeMetadata(m)
	want := append(append([]byte{0x85}, plain[1:]...), build("kvflow", []byte{0x83}, "boot_epoch", 3, "lease_ttl_ms", 1000, "batch_done", []byte{0xc3})...)
	if !bytes.Equal(b, want) {
		t.Fatalf("%x, want %x", b, want)
	}
	if got, err := DecodeMetadata(b); err != nil || !reflect.DeepEqual(got, m) {
		t.Fatalf("round trip: %+v %v", got, err)
	}
	m.Ext = Ext{BatchDone: true}
	if got := EncodeMetadata(m); !bytes.Equal(got, append(append([]byte{0x85}, plain[1:]...), build("kvflow", []byte{0x81}, "batch_done", []byte{0xc3})...)) {
		t.Fatalf("batch_done only: %x", got)
	}
	head := build([]byte{0x85}, "engine_id", "E", "te_rpc_port", 1, "kv_caches_base_addr", []byte{0x90}, "num_blocks", 1, "kvflow")
	if got, err := DecodeMetadata(build(head, []byte{0x81}, "batch_done", []byte{0xc2})); err != nil || got.Ext.BatchDone {
		t.Fatalf("batch_done false: %+v %v", got.Ext, err)
	}
	for name, tail := range map[string][]byte{
		"int":       build([]byte{0x81}, "batch_done", 1),
		"nil":       build([]byte{0x81}, "batch_done", []byte{0xc0}),
		"duplicate": build([]byte{0x82}, "batch_done", []byte{0xc3}, "batch_done", []byte{0xc3}),
	} {
		if _, err := DecodeMetadata(build(head, tail)); !errors.Is(err, ErrMalformed) || !strings.Contains(err.Error(), "batch_done") {
			t.Errorf("%s: %v", name, err)
		}
	}
}

func TestMetadataLeaseTTL(t *testing.T) {
	base := Metadata{EngineID: "e", TERPCPort: 1, KVCachesBaseAddr: []uint64{7}, NumBlocks: 2}
	plain := EncodeMetadata(base)
	for _, tc := range []struct {
		ext  Ext
		want Ext    // decoded
		tail []byte // the "kvflow" value's bytes
	}{
		{Ext{LeaseTTL: 10 * time.Second}, Ext{LeaseTTL: 10 * time.Second}, build([]byte{0x81}, "lease_ttl_ms", 10000)},
		{Ext{LeaseTTL: 300 * time.Microsecond}, Ext{LeaseTTL: time.Millisecond}, build([]byte{0x81}, "lease_ttl_ms", 1)},
		{Ext{BootEpoch: 5, LeaseTTL: 1500 * time.Millisecond}, Ext{BootEpoch: 5, LeaseTTL: 1500 * time.Millisecond},
			build([]byte{0x82}, "boot_epoch", 5, "lease_ttl_ms", 1500)},
	} {
		m := base
		m.Ext = tc.ext
		b := EncodeMetadata(m)
		want := append(append([]byte{0x85}, plain[1:]...), build("kvflow", tc.tail)...)
		if !bytes.Equal(b, want) {
			t.Fatalf("%+v: %x, want %x", tc.ext, b, want)
		}
		got, err := DecodeMetadata(b)
		m.Ext = tc.want
		if err != nil || !reflect.DeepEqual(got, m) {
			t.Fatalf("%+v round trip: %+v %v", tc.ext, got, err)
		}
	}
	// Zero (or negative) LeaseTTL and BootEpoch: the seed's bytes exactly.
	for _, e := range []Ext{{}, {LeaseTTL: -time.Second}} {
		m := base
		m.Ext = e
		if b := EncodeMetadata(m); !bytes.Equal(b, plain) || plain[0] != 0x84 {
			t.Fatalf("Ext %+v changed the seed bytes: %x", e, b)
		}
	}
	for name, in := range map[string][]byte{
		"duplicate": build([]byte{0x85}, "engine_id", "E", "te_rpc_port", 1, "kv_caches_base_addr", []byte{0x90}, "num_blocks", 1,
			"kvflow", []byte{0x82}, "lease_ttl_ms", 1, "lease_ttl_ms", 2),
		"str": build([]byte{0x85}, "engine_id", "E", "te_rpc_port", 1, "kv_caches_base_addr", []byte{0x90}, "num_blocks", 1,
			"kvflow", []byte{0x81}, "lease_ttl_ms", "1"),
		"overflow": build([]byte{0x85}, "engine_id", "E", "te_rpc_port", 1, "kv_caches_base_addr", []byte{0x90}, "num_blocks", 1,
			"kvflow", []byte{0x81}, "lease_ttl_ms", uint64(math.MaxUint64)),
	} {
		if _, err := DecodeMetadata(in); !errors.Is(err, ErrMalformed) || !strings.Contains(err.Error(), "lease_ttl_ms") {
			t.Errorf("%s: %v", name, err)
		}
	}
}

func TestMetadataExt(t *testing.T) {
	base := Metadata{EngineID: "e", TERPCPort: 1, KVCachesBaseAddr: []uint64{math.MaxUint64, 1 << 63}, NumBlocks: 2}
	plain := EncodeMetadata(base)
	if plain[0] != 0x84 {
		t.Fatalf("zero Ext must be omitted: header %#x", plain[0])
	}
	ext := base
	ext.Ext.BootEpoch = 1 << 40
	b := EncodeMetadata(ext)
	if b[0] != 0x85 || !bytes.HasPrefix(b[1:], plain[1:]) {
		t.Fatalf("ext encoding must extend the seed's: %x vs %x", b, plain)
	}
	got, err := DecodeMetadata(b)
	if err != nil || !reflect.DeepEqual(got, ext) {
		t.Fatalf("round trip: %+v %v", got, err)
	}
	// A generic msgpack reader (as the seed's msgspec, which ignores unknown
	// fields) sees the four seed fields unchanged.
	var generic map[string]any
	if err := msgpack.Unmarshal(b, &generic); err != nil {
		t.Fatal(err)
	}
	if generic["engine_id"] != "e" || len(generic) != 5 {
		t.Fatalf("generic decode: %v", generic)
	}
}

// build is a tiny helper to write msgpack test inputs by hand.
func build(parts ...any) []byte {
	var b []byte
	for _, p := range parts {
		switch v := p.(type) {
		case string:
			b = appendStr(b, v)
		case []byte:
			b = append(b, v...)
		case int:
			b = appendInt(b, int64(v))
		case uint64:
			b = appendUint(b, v)
		}
	}
	return b
}

func TestDecodeMetadataTolerance(t *testing.T) {
	// Unknown fields anywhere (including nested, ext types, floats, nil) are skipped.
	b := build([]byte{0x87},
		"future", []byte{0x82, 0xa1, 'a', 0x93, 0xc0, 0xc3, 0xcb, 0, 0, 0, 0, 0, 0, 0, 0, 0xa1, 'b', 0xd4, 1, 2},
		"engine_id", "E",
		"te_rpc_port", []byte{0xd3, 0, 0, 0, 0, 0, 0, 0x3a, 0x98}, // int64 form of 15000 (non-msgspec encoders)
		"kv_caches_base_addr", []byte{0x92, 0xcf, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xd0, 0x05},
		"num_blocks", 7,
		"kvflow", []byte{0x82}, "boot_epoch", 9, "lease", []byte{0x81, 0xa1, 'x', 0x90},
		"zzz", []byte{0xc7, 0x02, 0x05, 0xaa, 0xbb},
	)
	m, err := DecodeMetadata(b)
	if err != nil {
		t.Fatal(err)
	}
	want := Metadata{EngineID: "E", TERPCPort: 15000, KVCachesBaseAddr: []uint64{math.MaxUint64, 5}, NumBlocks: 7, Ext: Ext{BootEpoch: 9}}
	if !reflect.DeepEqual(m, want) {
		t.Fatalf("got %+v want %+v", m, want)
	}
}

func TestDecodeErrors(t *testing.T) {
	good := EncodeMetadata(Metadata{EngineID: "E", TERPCPort: 1, KVCachesBaseAddr: []uint64{1}, NumBlocks: 1})
	cases := []struct {
		name string
		in   []byte
		want string // substring of the error
		is   error
	}{
		{"empty", nil, "unexpected end", ErrMalformed},
		{"truncated", good[:len(good)-3], "", ErrMalformed},
		{"not a map", []byte{0x92, 0x01, 0x02}, "want map, got array", ErrMalformed},
		{"missing field", build([]byte{0x83}, "engine_id", "E", "te_rpc_port", 1, "num_blocks", 1), `missing required field "kv_caches_base_addr"`, ErrMalformed},
		{"bin engine id", build([]byte{0x84}, "engine_id", []byte{0xc4, 1, 'E'}, "te_rpc_port", 1, "kv_caches_base_addr", []byte{0x90}, "num_blocks", 1), "engine_id at byte", ErrMalformed},
		{"str port", build([]byte{0x84}, "engine_id", "E", "te_rpc_port", "1", "kv_caches_base_addr", []byte{0x90}, "num_blocks", 1), "te_rpc_port", ErrMalformed},
		{"negative blocks", build([]byte{0x84}, "engine_id", "E", "te_rpc_port", 1, "kv_caches_base_addr", []byte{0x90}, "num_blocks", -1), "negative", ErrMalformed},
		{"port too big", build([]byte{0x84}, "engine_id", "E", "te_rpc_port", uint64(math.MaxUint64), "kv_caches_base_addr", []byte{0x90}, "num_blocks", 1), "int64", ErrMalformed},
		{"float addr", build([]byte{0x84}, "engine_id", "E", "te_rpc_port", 1, "kv_caches_base_addr", []byte{0x91, 0xca, 0, 0, 0, 0}, "num_blocks", 1), "kv_caches_base_addr[0]", ErrMalformed},
		{"duplicate", build([]byte{0x85}, "engine_id", "E", "engine_id", "F", "te_rpc_port", 1, "kv_caches_base_addr", []byte{0x90}, "num_blocks", 1), "duplicate", ErrMalformed},
		{"int key", append([]byte{0x81, 0x01}, 0x01), "metadata key", ErrMalformed},
		{"trailing", append(append([]byte{}, good...), 0x00), "trailing", ErrMalformed},
		{"bad utf8", build([]byte{0x84}, "engine_id", []byte{0xa1, 0xff}, "te_rpc_port", 1, "kv_caches_base_addr", []byte{0x90}, "num_blocks", 1), "UTF-8", ErrMalformed},
		{"huge array", build([]byte{0x84}, "engine_id", "E", "te_rpc_port", 1, "kv_caches_base_addr", []byte{0xdd, 0xff, 0xff, 0xff, 0xff}), "exceeds", ErrMalformed},
		{"ext not map", build([]byte{0x85}, "engine_id", "E", "te_rpc_port", 1, "kv_caches_base_addr", []byte{0x90}, "num_blocks", 1, "kvflow", 3), "kvflow", ErrMalformed},
		{"deep nesting", build([]byte{0x81}, "x", bytes.Repeat([]byte{0x91}, 100), []byte{0x01}), "nested", ErrMalformed},
		{"error reply", []byte("ERR busy"), "busy", nil},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			_, err := DecodeMetadata(c.in)
			if err == nil {
				t.Fatal("no error")
			}
			if c.is != nil && !errors.Is(err, c.is) {
				t.Fatalf("error %v is not %v", err, c.is)
			}
			if c.is == nil {
				var re *RemoteError
				if !errors.As(err, &re) {
					t.Fatalf("want RemoteError, got %v", err)
				}
			}
			if !strings.Contains(err.Error(), c.want) {
				t.Fatalf("error %q lacks %q", err, c.want)
			}
		})
	}
}

func TestDecodeRequest(t *testing.T) {
	cases := []struct {
		name string
		in   []byte
		want Request
		is   error
	}{
		{"get_meta", EncodeGetMeta(), Request{Kind: KindGetMeta}, nil},
		{"get_meta one element", build([]byte{0x91, 0xc4, 12}, []byte("get_meta_msg")), Request{Kind: KindGetMeta}, nil},
		{"get_meta extra", build([]byte{0x93, 0xc4, 12}, []byte("get_meta_msg"), "", []byte{0x80}), Request{Kind: KindGetMeta}, nil},
		{"done", EncodeDoneRecving("r"), Request{Kind: KindDoneRecving, RequestID: "r"}, nil},
		{"done extra", build([]byte{0x93, 0xc4, 16}, []byte("done_recving_msg"), "r", []byte{0x81, 0xa1, 'a', 0x01}), Request{Kind: KindDoneRecving, RequestID: "r"}, nil},
		{"done no id", build([]byte{0x91, 0xc4, 16}, []byte("done_recving_msg")), Request{}, ErrMalformed},
		{"done bin id", build([]byte{0x92, 0xc4, 16}, []byte("done_recving_msg"), []byte{0xc4, 1, 'r'}), Request{}, ErrMalformed},
		{"done int id", build([]byte{0x92, 0xc4, 16}, []byte("done_recving_msg"), 5), Request{}, ErrMalformed},
		{"str tag (seed: unexpected)", build([]byte{0x92}, "get_meta_msg", ""), Request{}, ErrMalformed},
		{"unknown tag", build([]byte{0x92, 0xc4, 3}, []byte("foo"), ""), Request{}, ErrUnknownMessage},
		{"empty array", []byte{0x90}, Request{}, ErrMalformed},
		{"map (seed: not_a_tuple)", []byte{0x81, 0xa1, 0x61, 0x01}, Request{}, ErrMalformed},
		{"garbage", []byte{0xc1, 0xff}, Request{}, ErrMalformed},
		{"trailing", append(EncodeGetMeta(), 0xc0), Request{}, ErrMalformed},
		{"truncated", EncodeDoneRecving("abcdef")[:20], Request{}, ErrMalformed},
		{"empty", nil, Request{}, ErrMalformed},
		{"renew", EncodeRenew([]string{"a", "b"}), Request{Kind: KindRenew, RequestIDs: []string{"a", "b"}}, nil},
		{"renew none", EncodeRenew(nil), Request{Kind: KindRenew, RequestIDs: []string{}}, nil},
		{"renew extra", build([]byte{0x93, 0xc4, 9}, []byte("renew_msg"), []byte{0x91}, "r", 7), Request{Kind: KindRenew, RequestIDs: []string{"r"}}, nil},
		{"renew no ids", build([]byte{0x91, 0xc4, 9}, []byte("renew_msg")), Request{}, ErrMalformed},
		{"renew str ids", build([]byte{0x92, 0xc4, 9}, []byte("renew_msg"), "r"), Request{}, ErrMalformed},
		{"renew int id", build([]byte{0x92, 0xc4, 9}, []byte("renew_msg"), []byte{0x92}, "r", 5), Request{}, ErrMalformed},
		{"renew too many", EncodeRenew(make([]string, MaxRenewIDs+1)), Request{}, ErrMalformed},
		{"done_batch", EncodeDoneBatch([]string{"a", "b", "a"}), Request{Kind: KindDoneBatch, RequestIDs: []string{"a", "b", "a"}}, nil},
		{"done_batch empty id", EncodeDoneBatch([]string{""}), Request{Kind: KindDoneBatch, RequestIDs: []string{""}}, nil},
		{"done_batch msg id", build([]byte{0x93, 0xc4, 14}, []byte("done_batch_msg"), []byte{0x91}, "r", 7), Request{Kind: KindDoneBatch, RequestIDs: []string{"r"}, MsgID: 7}, nil},
		{"done_batch extra", build([]byte{0x94, 0xc4, 14}, []byte("done_batch_msg"), []byte{0x91}, "r", 7, []byte{0x80}), Request{Kind: KindDoneBatch, RequestIDs: []string{"r"}, MsgID: 7}, nil},
		{"done_batch str msg id", build([]byte{0x93, 0xc4, 14}, []byte("done_batch_msg"), []byte{0x91}, "r", "7"), Request{}, ErrMalformed},
		{"done_batch none", EncodeDoneBatch(nil), Request{}, ErrMalformed},
		{"done_batch no ids", build([]byte{0x91, 0xc4, 14}, []byte("done_batch_msg")), Request{}, ErrMalformed},
		{"done_batch str ids", build([]byte{0x92, 0xc4, 14}, []byte("done_batch_msg"), "r"), Request{}, ErrMalformed},
		{"done_batch int id", build([]byte{0x92, 0xc4, 14}, []byte("done_batch_msg"), []byte{0x92}, "r", 5), Request{}, ErrMalformed},
		{"done_batch bin id", build([]byte{0x92, 0xc4, 14}, []byte("done_batch_msg"), []byte{0x91, 0xc4, 1, 'r'}), Request{}, ErrMalformed},
		{"done_batch nil ids", build([]byte{0x92, 0xc4, 14}, []byte("done_batch_msg"), []byte{0xc0}), Request{}, ErrMalformed},
		{"done_batch too many", EncodeDoneBatch(make([]string, MaxDoneBatchIDs+1)), Request{}, ErrMalformed},
		{"done_batch truncated", EncodeDoneBatch([]string{"abc"})[:19], Request{}, ErrMalformed},
		{"done_batch huge count", build([]byte{0x92, 0xc4, 14}, []byte("done_batch_msg"), []byte{0xdd, 0, 0, 0x10, 0x01}), Request{}, ErrMalformed},
		{"renew truncated", EncodeRenew([]string{"abc"})[:14], Request{}, ErrMalformed},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			got, err := DecodeRequest(c.in)
			if c.is == nil {
				if err != nil || !reflect.DeepEqual(got, c.want) {
					t.Fatalf("got %+v, %v; want %+v", got, err, c.want)
				}
				return
			}
			if !errors.Is(err, c.is) {
				t.Fatalf("error %v, want %v", err, c.is)
			}
		})
	}
}

func TestDecodeAck(t *testing.T) {
	if err := DecodeAck([]byte("ACK")); err != nil {
		t.Fatal(err)
	}
	for _, b := range [][]byte{nil, []byte("ack"), []byte("ACK\x00"), []byte("NACK")} {
		if err := DecodeAck(b); !errors.Is(err, ErrUnexpectedReply) {
			t.Fatalf("DecodeAck(%q) = %v", b, err)
		}
	}
	var re *RemoteError
	if err := DecodeAck(EncodeErrorReply("no")); !errors.As(err, &re) || re.Reason != "no" {
		t.Fatalf("error reply: %v", err)
	}
}

// TestCompactIntsAgreeWithMsgpackV5 pins the integer forms against
// msgpack/v5 with UseCompactInts(true) (the encoder other kvflow packages use).
func TestCompactIntsAgreeWithMsgpackV5(t *testing.T) {
	vals := []uint64{0, 1, 127, 128, 255, 256, 65535, 65536, 1<<32 - 1, 1 << 32, 1<<63 - 1, 1 << 63, math.MaxUint64}
	for _, v := range vals {
		var buf bytes.Buffer
		enc := msgpack.NewEncoder(&buf)
		enc.UseCompactInts(true)
		if err := enc.EncodeUint(v); err != nil {
			t.Fatal(err)
		}
		if got := appendUint(nil, v); !bytes.Equal(got, buf.Bytes()) {
			t.Errorf("appendUint(%d) = %x, msgpack/v5 %x", v, got, buf.Bytes())
		}
	}
	for _, v := range []int64{-1, -32, -33, -128, -129, -32768, -32769, math.MinInt32, math.MinInt32 - 1, math.MinInt64} {
		var buf bytes.Buffer
		enc := msgpack.NewEncoder(&buf)
		enc.UseCompactInts(true)
		if err := enc.EncodeInt(v); err != nil {
			t.Fatal(err)
		}
		if got := appendInt(nil, v); !bytes.Equal(got, buf.Bytes()) {
			t.Errorf("appendInt(%d) = %x, msgpack/v5 %x", v, got, buf.Bytes())
		}
	}
}

func seedCorpus(f *testing.F) {
	for _, c := range loadVectors(f) {
		if c.BytesHex != "" {
			f.Add(unhex(f, c.BytesHex))
		}
		for _, frames := range c.FramesIn {
			for _, fr := range frames {
				f.Add(unhex(f, fr))
			}
		}
	}
	f.Add(EncodeMetadata(Metadata{EngineID: "e", KVCachesBaseAddr: []uint64{1}, Ext: Ext{BootEpoch: 3}}))
	f.Add(EncodeMetadata(Metadata{EngineID: "e", KVCachesBaseAddr: []uint64{1}, Ext: Ext{LeaseTTL: time.Second}}))
	f.Add(EncodeRenew([]string{"a", "bc"}))
	f.Add(EncodeDoneBatch([]string{"a", "bc", "a"}))
	f.Add(EncodeDoneBatch(nil))
	f.Add(EncodeMetadata(Metadata{EngineID: "e", KVCachesBaseAddr: []uint64{1}, Ext: Ext{BootEpoch: 1, LeaseTTL: time.Second, BatchDone: true}}))
	f.Add(EncodeMetadata(Metadata{EngineID: "e", KVCachesBaseAddr: []uint64{1}, Ext: Ext{BootEpoch: 1, Cache: testFingerprint()}}))
	f.Add(EncodeMetadata(Metadata{EngineID: "e", KVCachesBaseAddr: []uint64{1}, Ext: Ext{Cache: &npu.Fingerprint{Kind: npu.Sparse, DType: npu.FP8,
		BlockSize: 1, KVHeads: 1, KVLoraRank: 2, QKRopeHeadDim: 3, IndexerDim: 4, Layers: 5, BlockLens: []int{6, 7, 8}, NumBlocks: 9}}}))
	f.Add(EncodeMetadata(Metadata{EngineID: "e", KVCachesBaseAddr: []uint64{1}, Ext: Ext{BootEpoch: 1, TEAuth: (*[TEAuthSize]byte)(bytes.Repeat([]byte{7}, TEAuthSize))}}))
	f.Add([]byte("ACK"))
	f.Add([]byte("ERR x"))
}

func FuzzDecodeRequest(f *testing.F) {
	seedCorpus(f)
	f.Fuzz(func(t *testing.T, b []byte) {
		req, err := DecodeRequest(b)
		if err != nil {
			if !errors.Is(err, ErrMalformed) && !errors.Is(err, ErrUnknownMessage) {
				t.Fatalf("unclassified error %v", err)
			}
			return
		}
		if req.Kind == KindDoneBatch && (len(req.RequestIDs) < 1 || len(req.RequestIDs) > MaxDoneBatchIDs) {
			t.Fatalf("accepted a done_batch_msg of %d ids", len(req.RequestIDs))
		}
		// Re-encoding gives the canonical form, which decodes to the same request.
		again, err := DecodeRequest(EncodeRequest(req))
		if err != nil || !reflect.DeepEqual(again, req) {
			t.Fatalf("re-encode of %+v: %+v %v", req, again, err)
		}
	})
}

func FuzzDecodeMetadata(f *testing.F) {
	seedCorpus(f)
	f.Fuzz(func(t *testing.T, b []byte) {
		m, err := DecodeMetadata(b)
		if err != nil {
			var re *RemoteError
			if !errors.Is(err, ErrMalformed) && !errors.As(err, &re) {
				t.Fatalf("unclassified error %v", err)
			}
			return
		}
		enc := EncodeMetadata(m)
		again, err := DecodeMetadata(enc)
		if err != nil || !reflect.DeepEqual(again, m) {
			t.Fatalf("re-encode of %+v: %+v %v", m, again, err)
		}
		// Whatever we accept is one valid msgpack value to a generic
		// decoder (walked, not built: maps nested in unknown extension
		// fields may have keys of any type, maps included).
		r := bytes.NewReader(b) // an io.ByteScanner: read directly, unbuffered
		if err := msgpack.NewDecoder(r).Skip(); err != nil {
			t.Fatalf("accepted input msgpack/v5 rejects: %v", err)
		}
		if rest := r.Len(); rest != 0 {
			t.Fatalf("accepted input has %d bytes after its value", rest)
		}
	})
}

func FuzzDecodeAck(f *testing.F) {
	seedCorpus(f)
	f.Fuzz(func(t *testing.T, b []byte) {
		err := DecodeAck(b)
		if (err == nil) != (string(b) == "ACK") {
			t.Fatalf("DecodeAck(%q) = %v", b, err)
		}
	})
}

// FuzzSkip checks the skipper against msgpack/v5's Skip: any value one
// accepts the other accepts, consuming the same bytes.
func FuzzSkip(f *testing.F) {
	seedCorpus(f)
	f.Fuzz(func(t *testing.T, b []byte) {
		r := &reader{b: b}
		err := r.skip("v", 0)
		dec := msgpack.NewDecoder(bytes.NewReader(b))
		err2 := dec.Skip()
		if err != nil {
			return // deeper nesting or invalid code: we may be stricter
		}
		if err2 != nil {
			t.Fatalf("we skipped %d bytes of %x, msgpack/v5 fails: %v", r.off, b, err2)
		}
	})
}
