package main

import (
	"bytes"
	"encoding/json"
	"errors"
	"strings"
	"testing"
	"time"
)

// keysOnce decodes one JSON object and fails on a key written twice.
func keysOnce(t *testing.T, line string) map[string]any {
	t.Helper()
	dec := json.NewDecoder(strings.NewReader(line))
	var walk func(path string) any
	walk = func(path string) any {
		tok, err := dec.Token()
		if err != nil {
			t.Fatalf("%q: %v", line, err)
		}
		if tok != json.Delim('{') {
			if tok == json.Delim('[') {
				var arr []any
				for dec.More() {
					arr = append(arr, walk(path))
				}
				dec.Token()
				return arr
			}
			return tok
		}
		obj := map[string]any{}
		for dec.More() {
			k, _ := dec.Token()
			key := k.(string)
			if _, dup := obj[key]; dup {
				t.Errorf("key %s%s twice in %s", path, key, line)
			}
			obj[key] = walk(path + key + ".")
		}
		dec.Token()
		return obj
	}
	return walk("").(map[string]any)
}

// JSON logs carry each key once, however many components add it with
// With, and durations as strings.
func TestJSONLogKeysOnceDurationsStrings(t *testing.T) {
	var buf bytes.Buffer
	log, err := newLogger(&buf, "debug", "json")
	if err != nil {
		t.Fatal(err)
	}
	node := log.With("role", "prefill", "engine_id", "p0", "component", "node")
	sc := node.With("component", "sidechannel", "side", "server")
	sc.Info("side channel listening", "addr", "127.0.0.1:1", "role", "prefill")
	node.Info("shutting down", "deadline", 25*time.Second, "err", errors.New("x"))
	node.WithGroup("g").Info("grouped", "role", "inner", "wait", time.Millisecond)
	lines := strings.Split(strings.TrimSpace(buf.String()), "\n")
	if len(lines) != 3 {
		t.Fatalf("%d lines:\n%s", len(lines), buf.String())
	}
	first := keysOnce(t, lines[0])
	if first["role"] != "prefill" || first["component"] != "sidechannel" || first["side"] != "server" || first["engine_id"] != "p0" {
		t.Errorf("merged attrs wrong: %v", first)
	}
	if d := keysOnce(t, lines[1])["deadline"]; d != "25s" {
		t.Errorf("deadline = %#v, want \"25s\"", d)
	}
	g := keysOnce(t, lines[2])
	if inner, _ := g["g"].(map[string]any); inner["role"] != "inner" || inner["wait"] != "1ms" || g["role"] != "prefill" {
		t.Errorf("group: %v", g)
	}
}

func TestTextLogKeysOnce(t *testing.T) {
	var buf bytes.Buffer
	log, err := newLogger(&buf, "info", "text")
	if err != nil {
		t.Fatal(err)
	}
	log.With("role", "decode").With("role", "client").Info("m", "deadline", 2*time.Second)
	if out := buf.String(); strings.Count(out, "role=") != 1 || !strings.Contains(out, "role=client") || !strings.Contains(out, "deadline=2s") {
		t.Errorf("text log %q", out)
	}
}
