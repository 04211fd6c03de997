package testkit

import (
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"sync"
	"testing"
)

// SeedrefEnv names the directory of another set of seed vectors (absolute),
// e.g. one made by scripts/seedref/gen.py with another salt; the repository's
// testdata/seedref when unset.
const SeedrefEnv = "KVFLOW_SEEDREF_DIR"

var root = sync.OnceValues(func() (string, error) {
	dir, err := os.Getwd()
	if err != nil {
		return "", fmt.Errorf("repository root: %w", err)
	}
	for {
		if _, err := os.Stat(filepath.Join(dir, "go.mod")); err == nil {
			return dir, nil
		}
		parent := filepath.Dir(dir)
		if parent == dir {
			return "", errors.New("repository root: no go.mod above the working directory")
		}
		dir = parent
	}
})

// RepoRoot is the module's root directory: the nearest directory holding
// go.mod at or above the working directory (a test's package directory).
func RepoRoot() (string, error) { return root() }

// SeedrefPath is the path of the seed vector file name: under $KVFLOW_SEEDREF_DIR
// when set, else under the repository's testdata/seedref.
func SeedrefPath(t testing.TB, name string) string {
	t.Helper()
	if d := os.Getenv(SeedrefEnv); d != "" {
		return filepath.Join(d, name)
	}
	r, err := RepoRoot()
	if err != nil {
		t.Fatal(err)
	}
	return filepath.Join(r, "testdata", "seedref", name)
}

// SeedrefJSON decodes the seed vector file name (SeedrefPath) into v, failing
// t when it cannot be read or decoded.
func SeedrefJSON(t testing.TB, name string, v any) {
	t.Helper()
	b, err := os.ReadFile(SeedrefPath(t, name))
	if err != nil {
		t.Fatal(err)
	}
	if err := json.Unmarshal(b, v); err != nil {
		t.Fatalf("%s: %v", name, err)
	}
}
