//go:build !(mooncake && cgo)

package node

import (
	"strings"
	"testing"

	"github.com/kvflow/kvflow/internal/config"
)

// node.te_backend mooncake in a binary built without -tags mooncake is
// refused before anything opens, saying how to build one that runs it.
func TestMooncakeBackendNotBuilt(t *testing.T) {
	for _, role := range []string{"prefill", "decode"} {
		t.Run(role, func(t *testing.T) {
			cfg := baseConfig(topo{prefillTP: 1, decodeTP: 1, model: gqa(2)}, role, 20000)
			cfg.Node.TEBackend = config.BackendMooncake
			n, err := Start(cfg, Deps{})
			if err == nil {
				n.Close(t.Context())
				t.Fatal("started with te_backend mooncake in a build without the mooncake tag")
			}
			msg := err.Error()
			if !strings.Contains(msg, "node.te_backend") || !strings.Contains(msg, "this binary was built without it") ||
				!strings.Contains(msg, "go build -tags mooncake") {
				t.Errorf("error %q: want node.te_backend refused, naming the missing build tag and how to build", msg)
			}
		})
	}
}

// TestMooncakeBackend stands for the tests with Mooncake's real library
// (mooncake_test.go), which this build does not have.
func TestMooncakeBackend(t *testing.T) {
	t.Skip("the node's tests with Mooncake's transfer engine need -tags mooncake and a Mooncake build " +
		"(../shared/tools/mooncake-build.sh, then make test-mooncake with MOONCAKE_PREFIX set)")
}
