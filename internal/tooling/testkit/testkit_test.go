package testkit

import (
	"errors"
	"os"
	"path/filepath"
	"testing"
)

func TestSeedref(t *testing.T) {
	root, err := RepoRoot()
	if err != nil {
		t.Fatal(err)
	}
	if _, err := os.Stat(filepath.Join(root, "go.mod")); err != nil {
		t.Fatalf("root %s: %v", root, err)
	}
	t.Setenv(SeedrefEnv, "")
	if got, want := SeedrefPath(t, "wire_bytes.json"), filepath.Join(root, "testdata", "seedref", "wire_bytes.json"); got != want {
		t.Errorf("SeedrefPath = %s, want %s", got, want)
	}
	var v struct {
		Description string `json:"description"`
	}
	SeedrefJSON(t, "task_tracker.json", &v)
	if v.Description == "" {
		t.Error("task_tracker.json decoded without its description")
	}
	dir := t.TempDir()
	if err := os.WriteFile(filepath.Join(dir, "x.json"), []byte(`{"description":"other salt"}`), 0o644); err != nil {
		t.Fatal(err)
	}
	t.Setenv(SeedrefEnv, dir)
	if got := SeedrefPath(t, "x.json"); got != filepath.Join(dir, "x.json") {
		t.Errorf("with %s set: %s", SeedrefEnv, got)
	}
	SeedrefJSON(t, "x.json", &v)
	if v.Description != "other salt" {
		t.Errorf("with %s set: decoded %q", SeedrefEnv, v.Description)
	}
}

func TestOnFreePort(t *testing.T) {
	busy := errors.New("address in use")
	for _, c := range []struct {
		name  string
		fails int // calls that fail before one succeeds
		ok    bool
	}{
		{"first", 0, true},
		{"after failures", PortAttempts - 1, true},
		{"never", PortAttempts, false},
	} {
		t.Run(c.name, func(t *testing.T) {
			var calls, logged int
			seen := map[int]bool{}
			port, err := OnFreePort(func(string, ...any) { logged++ }, func(p int) error {
				calls++
				if p < 10000 || p >= 30000 {
					t.Errorf("port %d outside [10000, 30000)", p)
				}
				seen[p] = true
				if calls <= c.fails {
					return busy
				}
				return nil
			})
			if c.ok != (err == nil) || (err != nil && !errors.Is(err, busy)) {
				t.Fatalf("err %v, want success %v (wrapping the last failure)", err, c.ok)
			}
			if c.ok && !seen[port] {
				t.Errorf("returned port %d was never tried", port)
			}
			if calls != min(c.fails+1, PortAttempts) || logged != c.fails {
				t.Errorf("%d calls, %d logged, want %d and %d", calls, logged, min(c.fails+1, PortAttempts), c.fails)
			}
		})
	}
}
