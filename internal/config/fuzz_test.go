package config

import (
	"bytes"
	"os"
	"path/filepath"
	"testing"
)

// FuzzFromJSON feeds arbitrary bytes to the decoder: it must never panic, an
// accepted document must Print, Validate must not panic either, and the
// printed form must load back to the same printed form.
func FuzzFromJSON(f *testing.F) {
	files, _ := filepath.Glob("testdata/*.json")
	for _, p := range files {
		if b, err := os.ReadFile(p); err == nil {
			f.Add(b)
		}
	}
	for _, s := range []string{
		``, `{}`, `null`, `[]`, `{"model": null}`, `{"kv_transfer_config": {"kv_port": "1"}}`,
		`{"kv_transfer_config": {"kv_connector_extra_config": {"x": {"y": [1, {"z": null}]}, "prefill": {"q": "\u00e9"}}}}`,
		`{"rank": {"tp": 1e400}}`, `{"read": {"timeout": "-5s"}}`, `{"a": 1, "a": 2}`, `{"//": 1, "//x": {}}`,
	} {
		f.Add([]byte(s))
	}
	f.Fuzz(func(t *testing.T, data []byte) {
		c, err := FromJSON(data)
		if err != nil {
			return
		}
		_ = c.Validate()
		_, _ = c.Shape()
		var first bytes.Buffer
		if err := c.Print(&first); err != nil {
			t.Fatalf("accepted document does not print: %v", err)
		}
		back, err := FromJSON(first.Bytes())
		if err != nil {
			t.Fatalf("printed config does not load: %v\n%s", err, first.String())
		}
		var second bytes.Buffer
		if err := back.Print(&second); err != nil {
			t.Fatal(err)
		}
		if !bytes.Equal(first.Bytes(), second.Bytes()) {
			t.Fatalf("print/load is not a fixed point:\n%s\n---\n%s", first.String(), second.String())
		}
	})
}
