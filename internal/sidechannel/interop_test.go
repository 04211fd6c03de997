package sidechannel

import (
	"bufio"
	"context"
	"encoding/hex"
	"encoding/json"
	"os/exec"
	"reflect"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/kvflow/kvflow/hw/npu"
	"github.com/kvflow/kvflow/internal/sidechannel/wire"
)

// seedPython is Debian's interpreter, which has python3-zmq and
// python3-msgpack (the python3 on PATH may be a pyenv build without them).
const seedPython = "/usr/bin/python3"

func needSeedPython(t *testing.T) {
	t.Helper()
	out, err := exec.Command(seedPython, "-c", "import zmq, msgpack").CombinedOutput()
	if err != nil {
		t.Skipf("interop with the seed's side channel needs %s with python3-zmq and python3-msgpack (apt-get install python3-zmq python3-msgpack): %v %s",
			seedPython, err, strings.TrimSpace(string(out)))
	}
}

// TestInteropSeedServer: kvflow's client fetches metadata from and sends
// DONEs to a Python ROUTER that runs the seed's serving loop.
func TestInteropSeedServer(t *testing.T) {
	needSeedPython(t)
	want := Metadata{EngineID: "seed-P", TERPCPort: 17001, KVCachesBaseAddr: []uint64{0x7000_0000, 1<<63 + 1, 1<<64 - 1}, NumBlocks: 4096}
	args := []string{"testdata/seedpeer.py", "serve", want.EngineID, strconv.Itoa(want.TERPCPort), strconv.Itoa(want.NumBlocks)}
	for _, a := range want.KVCachesBaseAddr {
		args = append(args, strconv.FormatUint(a, 10))
	}
	cmd := exec.Command(seedPython, args...)
	stdin, err := cmd.StdinPipe()
	if err != nil {
		t.Fatal(err)
	}
	stdout, err := cmd.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	var stderr strings.Builder
	cmd.Stderr = &stderr
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	pid := cmd.Process.Pid
	exited := make(chan error, 1)
	lines := make(chan string, 64)
	go func() {
		sc := bufio.NewScanner(stdout)
		for sc.Scan() {
			lines <- sc.Text()
		}
		close(lines)
		exited <- cmd.Wait()
	}()
	t.Cleanup(func() {
		_ = stdin.Close() // the peer exits when stdin closes
		select {
		case <-exited:
		case <-time.After(5 * time.Second):
			t.Errorf("python peer (pid %d) did not exit; killing it", pid)
			_ = cmd.Process.Kill()
			<-exited
		}
	})
	next := func() string {
		t.Helper()
		select {
		case l, ok := <-lines:
			if !ok {
				t.Fatalf("python peer exited; stderr: %s", stderr.String())
			}
			return l
		case <-time.After(10 * time.Second):
			t.Fatalf("python peer silent; stderr: %s", stderr.String())
		}
		return ""
	}
	ready := next()
	port, ok := strings.CutPrefix(ready, "READY ")
	if !ok {
		t.Fatalf("python peer: %q; stderr: %s", ready, stderr.String())
	}
	addr := "127.0.0.1:" + port

	e := newEnv(t)
	opts := fastClientOpts()
	opts.AttemptTimeout = 2 * time.Second
	c := e.client(t, opts)
	ctx := context.Background()
	md, err := c.GetMeta(ctx, addr)
	if err != nil {
		t.Fatal(err)
	}
	if !reflect.DeepEqual(md, want) {
		t.Fatalf("metadata from seed peer %+v, want %+v", md, want)
	}
	ids := []string{"req-1", "héllo", "cmpl-359143a23f6db725c026160f3cc404bf-0", strings.Repeat("b", 255)}
	for _, id := range ids {
		if err := c.SendDone(ctx, addr, id); err != nil {
			t.Fatalf("SendDone(%q): %v", id, err)
		}
		l := next()
		js, ok := strings.CutPrefix(l, "DONE ")
		var got string
		if !ok || json.Unmarshal([]byte(js), &got) != nil || got != id {
			t.Fatalf("seed peer logged %q for DONE %q", l, id)
		}
	}
}

// TestInteropSeedClient: a Python REQ peer doing what the seed's decode side
// does (GET_META, decode as msgspec would, DONE → ACK) against kvflow's
// server, with and without kvflow's metadata extension (a seed decoder
// ignores it, batch_done included, and keeps sending plain DONEs).
func TestInteropSeedClient(t *testing.T) {
	needSeedPython(t)
	e := newEnv(t)
	fp := &npu.Fingerprint{Kind: npu.MLA, DType: npu.BF16, BlockSize: 128, KVHeads: 1, KVLoraRank: 512, QKRopeHeadDim: 64,
		Layers: 1, BlockLens: []int{131072, 16384}, NumBlocks: 8, Prefill: npu.Sizes{TP: 2, PP: 1, PCP: 1, DCP: 1},
		Decode: npu.Sizes{TP: 1, PP: 1, PCP: 1, DCP: 1}, Rank: npu.RankPos{TP: 1}}
	for _, ext := range []Ext{{}, {BootEpoch: 1<<63 + 9}, {BootEpoch: 3, LeaseTTL: time.Second, BatchDone: true},
		{BootEpoch: 4, BatchDone: true, Cache: fp}} {
		md := Metadata{EngineID: "kvflow-P", TERPCPort: 15000, KVCachesBaseAddr: []uint64{0x1000_0000, 1<<64 - 2}, NumBlocks: 8, Ext: ext}
		h := &recorder{md: md}
		opts := ServerOptions{}
		if ext.BootEpoch%2 == 1 { // half of them through the front (the node's setting)
			opts.Limits = &DefaultLimits
		}
		s := e.server(t, h, opts)
		ids := []string{"req-9", "🚀", ""}
		out, err := exec.Command(seedPython, append([]string{"testdata/seedpeer.py", "client", s.Addr()}, ids...)...).CombinedOutput()
		if err != nil {
			t.Fatalf("seed client: %v\n%s", err, out)
		}
		var res struct {
			Metadata struct {
				EngineID         string   `json:"engine_id"`
				TERPCPort        int      `json:"te_rpc_port"`
				KVCachesBaseAddr []uint64 `json:"kv_caches_base_addr"`
				NumBlocks        int      `json:"num_blocks"`
			} `json:"metadata"`
			Extra       []string `json:"extra_fields"`
			Acks        []string `json:"acks"`
			MetadataHex string   `json:"metadata_hex"`
		}
		if err := json.Unmarshal(out, &res); err != nil {
			t.Fatalf("seed client output %q: %v", out, err)
		}
		got := Metadata{EngineID: res.Metadata.EngineID, TERPCPort: res.Metadata.TERPCPort,
			KVCachesBaseAddr: res.Metadata.KVCachesBaseAddr, NumBlocks: res.Metadata.NumBlocks, Ext: ext}
		if !reflect.DeepEqual(got, md) {
			t.Fatalf("seed client read %+v, want %+v", got, md)
		}
		if res.MetadataHex != hex.EncodeToString(wire.EncodeMetadata(md)) {
			t.Fatalf("bytes on the wire %s", res.MetadataHex)
		}
		if wantExtra := ext != (Ext{}); (len(res.Extra) == 1 && res.Extra[0] == "kvflow") != wantExtra || (!wantExtra && len(res.Extra) != 0) {
			t.Fatalf("extra fields %q", res.Extra)
		}
		if !reflect.DeepEqual(res.Acks, []string{"ACK", "ACK", "ACK"}) {
			t.Fatalf("acks %q", res.Acks)
		}
		if !reflect.DeepEqual(h.doneIDs(), ids) {
			t.Fatalf("server saw DONEs %q, want %q", h.doneIDs(), ids)
		}
	}
}
