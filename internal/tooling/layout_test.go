package tooling

import (
	"bufio"
	"bytes"
	"os/exec"
	"path/filepath"
	"runtime"
	"strings"
	"testing"

	"github.com/kvflow/kvflow/internal/tooling/testkit"
)

const module = "github.com/kvflow/kvflow/"

// product reports whether pkg (a module path without the module prefix) is
// product code: pipeline/, stages/, hw/ and internal/ outside
// internal/tooling.
func product(pkg string) bool {
	if tooling(pkg) {
		return false
	}
	for _, root := range []string{"pipeline", "stages", "hw", "internal"} {
		if pkg == root || strings.HasPrefix(pkg, root+"/") {
			return true
		}
	}
	return false
}

// tooling reports whether pkg is under internal/tooling.
func tooling(pkg string) bool {
	return pkg == "internal/tooling" || strings.HasPrefix(pkg, "internal/tooling/")
}

// imports lists the module's packages with their non-test imports, as the
// build sees them with tags.
func imports(t *testing.T, tags string) map[string][]string {
	t.Helper()
	root, err := testkit.RepoRoot()
	if err != nil {
		t.Fatal(err)
	}
	args := []string{"list", "-e", "-f", "{{.ImportPath}} {{join .Imports \" \"}}"}
	if tags != "" {
		args = append(args, "-tags", tags)
	}
	cmd := exec.Command(filepath.Join(runtime.GOROOT(), "bin", "go"), append(args, "./...")...)
	cmd.Dir = root
	var stderr bytes.Buffer
	cmd.Stderr = &stderr
	out, err := cmd.Output()
	if err != nil {
		t.Fatalf("go list: %v\n%s", err, stderr.Bytes())
	}
	pkgs := map[string][]string{}
	sc := bufio.NewScanner(bytes.NewReader(out))
	for sc.Scan() {
		f := strings.Fields(sc.Text())
		if len(f) == 0 || !strings.HasPrefix(f[0], module) {
			continue
		}
		pkgs[strings.TrimPrefix(f[0], module)] = f[1:]
	}
	return pkgs
}

// TestProductDoesNotImportTooling: no product package's non-test code
// imports a tooling package (with and without the mooncake tag), and
// testkit itself imports only the standard library, so that any package's
// tests can use it without an import cycle or cgo.
func TestProductDoesNotImportTooling(t *testing.T) {
	for _, tags := range []string{"", "mooncake"} {
		pkgs := imports(t, tags)
		var nProduct int
		for pkg, imps := range pkgs {
			if !product(pkg) {
				continue
			}
			nProduct++
			for _, imp := range imps {
				if rel, ok := strings.CutPrefix(imp, module); ok && tooling(rel) {
					t.Errorf("tags %q: product package %s imports tooling package %s", tags, pkg, rel)
				}
			}
		}
		// The checks above saw the tree, not an empty list.
		for _, want := range []string{"pipeline", "internal/node", "internal/decode", "stages/read", "hw/npu"} {
			if _, ok := pkgs[want]; !ok || !product(want) {
				t.Errorf("tags %q: %s not listed as a product package (%d product packages)", tags, want, nProduct)
			}
		}
		for _, imp := range pkgs["internal/tooling/testkit"] {
			if strings.Contains(strings.SplitN(imp, "/", 2)[0], ".") {
				t.Errorf("tags %q: testkit imports %s: it must stay standard library only", tags, imp)
			}
		}
	}
}

// The classification itself.
func TestProduct(t *testing.T) {
	for pkg, want := range map[string]bool{
		"pipeline": true, "stages/read": true, "hw/mooncake/mooncakec": true, "internal/node": true,
		"internal/cli/clierr": true, "internal/tooling": false, "internal/tooling/soak": false,
		"internal/toolingx": true, "cmd/kvflow": false, "bench": false, "deploy": false,
	} {
		if got := product(pkg); got != want {
			t.Errorf("product(%q) = %v, want %v", pkg, got, want)
		}
	}
}
