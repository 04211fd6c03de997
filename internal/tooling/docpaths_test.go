package tooling

import (
	"io/fs"
	"os"
	"path/filepath"
	"regexp"
	"strings"
	"testing"
)

// docRoots are the repository's top-level directories; a doc that names a
// path under one of them names a file or directory that must exist.
var docRoots = []string{"internal", "stages", "hw", "pipeline", "cmd", "deploy", "clients", "docs", "bench", "scripts", "testdata"}

// docPathRE finds "root/…" path mentions that do not continue another path
// or a module path (github.com/kvflow/kvflow/hw/npu is a Go import path).
var docPathRE = regexp.MustCompile(`(?:^|[^A-Za-z0-9_./-])((?:` + strings.Join(docRoots, "|") + `)/[A-Za-z0-9_./{},*-]*)`)

// docFiles are the documentation files whose path mentions are checked:
// every Markdown file and every package's doc.go.
func docFiles(t *testing.T, root string) []string {
	t.Helper()
	var files []string
	err := filepath.WalkDir(root, func(p string, d fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		name := d.Name()
		if d.IsDir() {
			if p != root && (strings.HasPrefix(name, ".") || name == "bin" || name == "node_modules") {
				return filepath.SkipDir
			}
			return nil
		}
		if strings.HasSuffix(name, ".md") || name == "doc.go" {
			files = append(files, p)
		}
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	return files
}

// expandBraces turns "a/{b,c}/d" into "a/b/d" and "a/c/d" (one level, as
// the docs write them).
func expandBraces(p string) []string {
	i := strings.Index(p, "{")
	j := strings.Index(p, "}")
	if i < 0 || j < i {
		return []string{p}
	}
	var out []string
	for _, alt := range strings.Split(p[i+1:j], ",") {
		out = append(out, expandBraces(p[:i]+alt+p[j+1:])...)
	}
	return out
}

// docPathExists reports whether the mention p names something under root
// or under dir (a doc.go names its package's testdata/ relative to it). A
// trailing Go symbol (hw/npu.Device, hw/shm.Reader.Read, a benchmark name
// pipeline/BenchmarkChain), "/..." and punctuation are not part of the path.
func docPathExists(root, dir, p string) bool {
	p = strings.TrimSuffix(p, "/...")
	p = strings.TrimRight(p, ".,-")
	exists := func(q string) bool {
		for _, base := range []string{root, dir} {
			if _, err := os.Stat(filepath.Join(base, q)); err == nil {
				return true
			}
		}
		return false
	}
	if exists(p) {
		return true
	}
	// Go symbol after a package path: cut at the first ".X" of the last
	// segment, or drop a last segment that starts with an upper-case letter.
	last := p[strings.LastIndex(p, "/")+1:]
	if k := strings.Index(last, "."); k >= 0 && k+1 < len(last) && last[k+1] >= 'A' && last[k+1] <= 'Z' {
		return exists(p[:len(p)-len(last)+k])
	}
	if last != "" && last[0] >= 'A' && last[0] <= 'Z' && !strings.Contains(last, ".") {
		return exists(p[:len(p)-len(last)])
	}
	return false
}

// TestDocPathsExist checks that every repository path a README, a doc under
// docs/ or bench/, or a package's doc.go names exists: files move (the
// tooling moved under internal/tooling) and the docs must follow.
func TestDocPathsExist(t *testing.T) {
	root, err := filepath.Abs("../..")
	if err != nil {
		t.Fatal(err)
	}
	files := docFiles(t, root)
	if len(files) < 10 {
		t.Fatalf("found only %d doc files under %s", len(files), root)
	}
	checked := 0
	for _, f := range files {
		b, err := os.ReadFile(f)
		if err != nil {
			t.Fatal(err)
		}
		rel, _ := filepath.Rel(root, f)
		for n, line := range strings.Split(string(b), "\n") {
			for _, m := range docPathRE.FindAllStringSubmatch(line, -1) {
				if strings.Contains(m[1], "*") {
					continue
				}
				for _, p := range expandBraces(m[1]) {
					checked++
					if !docPathExists(root, filepath.Dir(f), p) {
						t.Errorf("%s:%d names %q, which does not exist", rel, n+1, p)
					}
				}
			}
		}
	}
	if checked < 50 {
		t.Fatalf("checked only %d path mentions: is the pattern broken?", checked)
	}
}

func TestDocPathExistsCatches(t *testing.T) {
	root, err := filepath.Abs("../..")
	if err != nil {
		t.Fatal(err)
	}
	for p, want := range map[string]bool{
		"internal/tooling/demo/":         true,
		"hw/npu.Device":                  true,
		"hw/shm.Reader.Read":             true,
		"pipeline/BenchmarkChain":        true,
		"internal/config/testdata/x.md":  false,
		"internal/demo/":                 false,
		"internal/tooling/benche2e/...":  true,
		"stages/plan/doc.go.":            true,
		"internal/nosuch.Thing":          false,
		"internal/tooling/workers/nope/": false,
	} {
		if got := docPathExists(root, root, p); got != want {
			t.Errorf("docPathExists(%q) = %v, want %v", p, got, want)
		}
	}
	if got := expandBraces("stages/{plan,read}/doc.go"); len(got) != 2 || got[1] != "stages/read/doc.go" {
		t.Errorf("expandBraces = %q", got)
	}
}

// TestReadmeNamesEveryPackageRoot checks that the README's layout names each
// directory under hw/ and internal/ (a new package a reader cannot place is
// how the layout table went stale).
func TestReadmeNamesEveryPackageRoot(t *testing.T) {
	root, err := filepath.Abs("../..")
	if err != nil {
		t.Fatal(err)
	}
	readme, err := os.ReadFile(filepath.Join(root, "README.md"))
	if err != nil {
		t.Fatal(err)
	}
	for _, top := range []string{"hw", "internal"} {
		entries, err := os.ReadDir(filepath.Join(root, top))
		if err != nil {
			t.Fatal(err)
		}
		for _, e := range entries {
			if e.IsDir() && !strings.Contains(string(readme), "`"+top+"/"+e.Name()) {
				t.Errorf("README.md does not name %s/%s (add it to the layout table)", top, e.Name())
			}
		}
	}
}
