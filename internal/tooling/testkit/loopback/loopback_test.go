package loopback

import (
	"testing"
	"time"

	"github.com/kvflow/kvflow/internal/config"
	"github.com/kvflow/kvflow/internal/node"
)

func worker(role config.Role, kvPort int) config.Config {
	return Config(Worker{Role: role, EngineID: role.String(), KVPort: kvPort, Prefill: TP(2), Decode: TP(1),
		Model:            config.Model{NumLayers: 2, NumKVHeads: 8, HeadDim: 16, BlockSize: 16, DType: "bf16", NumBlocks: 8},
		HandshakeTimeout: 300 * time.Millisecond})
}

func TestConfig(t *testing.T) {
	c := worker(config.Prefill, 23000)
	if err := c.Validate(); err != nil {
		t.Fatal(err)
	}
	kv := c.KVTransfer
	if c.Role() != config.Prefill || kv.KVPort != 23000 || kv.EngineID != "prefill" || kv.KVConnectorExtraConfig.Prefill.TPSize != 2 ||
		c.Node.MetricsAddr != "" || !c.Cache.NoHugePages || c.Handshake.Timeout.D() != 300*time.Millisecond || c.Notify.Timeout.D() != 300*time.Millisecond {
		t.Errorf("prefill config %+v", c)
	}
	d := Config(Worker{Role: config.Decode, Prefill: TP(1), Decode: TP(1)})
	if d.Role() != config.Decode || d.Handshake.Timeout != config.Default().Handshake.Timeout {
		t.Errorf("decode config: role %v, handshake timeout %v (want the default)", d.Role(), d.Handshake.Timeout)
	}
}

// Start brings up an instance's ranks on one kv_port; StartRanks gives up
// with the last error when no attempt can work, leaving nothing running.
func TestStart(t *testing.T) {
	ns, port := Start(t, func(kvPort int) []config.Config {
		var cfgs []config.Config
		for r := range 2 {
			c := worker(config.Prefill, kvPort)
			c.Rank = config.Rank{TP: r}
			cfgs = append(cfgs, c)
		}
		return cfgs
	}, func(int) node.Deps { return node.Deps{} })
	if len(ns) != 2 || port < 10000 {
		t.Fatalf("%d nodes on port %d", len(ns), port)
	}
	for r, n := range ns {
		if n.Config.KVTransfer.KVPort != config.Port(port) || n.Config.Rank.TP != r {
			t.Errorf("rank %d: kv_port %d, tp rank %d", r, n.Config.KVTransfer.KVPort, n.Config.Rank.TP)
		}
	}
	attempts := 0
	_, _, err := StartRanks(nil, func(kvPort int) []config.Config {
		attempts++
		bad := worker(config.Prefill, kvPort)
		bad.Model.NumBlocks = 0
		return []config.Config{worker(config.Decode, kvPort), bad}
	}, func(int) node.Deps { return node.Deps{} })
	if err == nil || attempts != 8 {
		t.Fatalf("invalid second rank: err %v after %d attempts", err, attempts)
	}
}
