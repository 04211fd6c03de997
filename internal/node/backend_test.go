package node

import (
	"strings"
	"testing"

	"github.com/kvflow/kvflow/internal/config"
)

// node.te_backend mooncake is refused before anything opens, with the
// reason (the node does not drive the cgo binding), not advice to rebuild
// with -tags mooncake, which would not help.
func TestMooncakeBackendRejected(t *testing.T) {
	for _, role := range []string{"prefill", "decode"} {
		t.Run(role, func(t *testing.T) {
			cfg := baseConfig(topo{prefillTP: 1, decodeTP: 1, model: gqa(2)}, role, 20000)
			cfg.Node.TEBackend = config.BackendMooncake
			n, err := Start(cfg, Deps{})
			if err == nil {
				n.Close(t.Context())
				t.Fatal("started with te_backend mooncake")
			}
			msg := err.Error()
			if !strings.Contains(msg, "node.te_backend") || !strings.Contains(msg, "does not drive the cgo binding") ||
				strings.Contains(msg, "build with -tags mooncake") {
				t.Errorf("error %q: want node.te_backend rejected because the node does not drive the cgo binding", msg)
			}
		})
	}
}
