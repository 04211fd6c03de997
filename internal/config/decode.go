package config

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"reflect"
	"sort"
	"strings"
)

// Load reads the JSON configuration file at path on top of Default. An empty
// path returns Default. Every problem of the file is reported at once
// (errors.Join of *FieldError), each with its position and JSON path:
// syntax errors, unknown fields (except at the top of
// kv_connector_extra_config, whose unknown keys other plugins own: they are
// preserved, see UnknownExtraKeys, unless one is a near miss of prefill or
// decode), duplicate fields and ill-typed values.
// Load does not call Validate.
func Load(path string) (Config, error) {
	if path == "" {
		return Default(), nil
	}
	data, err := os.ReadFile(path)
	if err != nil {
		return Config{}, fmt.Errorf("config: %w", err)
	}
	return decodeDoc(data, path)
}

// FromJSON is Load for a document already in memory: data on top of Default.
func FromJSON(data []byte) (Config, error) { return decodeDoc(data, "") }

func decodeDoc(data []byte, file string) (Config, error) {
	cfg := Default()
	if err := decodeInto(&cfg, data, file); err != nil {
		return Config{}, err
	}
	return cfg, nil
}

// decodeInto decodes the document data into *c, on top of its values.
func decodeInto(c *Config, data []byte, file string) error {
	d := &decoder{data: data, file: file}
	d.root("", reflect.ValueOf(c).Elem())
	return errors.Join(d.errs...)
}

// decodeKVTransfer decodes a kv_transfer_config object (the
// --kv-transfer-config flag) into *kv, on top of its values.
func decodeKVTransfer(kv *KVTransferConfig, data []byte, source string) error {
	d := &decoder{data: data, file: source}
	d.root("kv_transfer_config", reflect.ValueOf(kv).Elem())
	return errors.Join(d.errs...)
}

// decoder walks a JSON document alongside the Go type it decodes into, so
// that every problem is found (encoding/json stops at the first unknown field
// and names neither its parent nor its position).
type decoder struct {
	data []byte
	file string
	errs []error
}

func (d *decoder) root(path string, v reflect.Value) {
	if !json.Valid(d.data) {
		var x any
		err := json.Unmarshal(d.data, &x)
		fe := &FieldError{Msg: "invalid JSON", Err: err}
		var se *json.SyntaxError
		if errors.As(err, &se) {
			fe.Msg = "invalid JSON: " + se.Error()
			off := int(se.Offset)
			if strings.HasPrefix(se.Error(), "invalid character") {
				off-- // point at the offending byte, not past it
			}
			fe.Pos = d.pos(off)
		} else if err != nil {
			fe.Msg = "invalid JSON: " + err.Error()
		}
		d.errs = append(d.errs, fe)
		return
	}
	off := skip(d.data, 0, "")
	end := len(bytes.TrimRight(d.data, " \t\r\n"))
	d.value(path, off, d.data[off:end], v)
}

func (d *decoder) fail(off int, path, msg string, err error) {
	d.errs = append(d.errs, &FieldError{Pos: d.pos(off), Path: path, Msg: msg, Err: err})
}

// pos is "file:line:col" (or "line:col") of byte offset off.
func (d *decoder) pos(off int) string {
	off = min(max(off, 0), len(d.data))
	line := 1 + bytes.Count(d.data[:off], []byte("\n"))
	col := off - bytes.LastIndexByte(d.data[:off], '\n')
	if d.file == "" {
		return fmt.Sprintf("%d:%d", line, col)
	}
	return fmt.Sprintf("%s:%d:%d", d.file, line, col)
}

var unmarshalerType = reflect.TypeFor[json.Unmarshaler]()

// value decodes raw (which starts at byte off of the document) into v.
func (d *decoder) value(path string, off int, raw []byte, v reflect.Value) {
	if v.Kind() != reflect.Struct || reflect.PointerTo(v.Type()).Implements(unmarshalerType) {
		if err := json.Unmarshal(raw, v.Addr().Interface()); err != nil {
			var te *json.UnmarshalTypeError
			if errors.As(err, &te) {
				d.fail(off, path, fmt.Sprintf("want %s, got %s", want(v.Type()), describe(raw)), err)
			} else {
				d.fail(off, path, err.Error(), err)
			}
		}
		return
	}
	if string(raw) == "null" {
		return // as encoding/json: null leaves a struct unchanged
	}
	if raw[0] != '{' {
		d.fail(off, path, fmt.Sprintf("want an object, got %s", describe(raw)), nil)
		return
	}
	fields, extra := structFields(v.Type())
	dec := json.NewDecoder(bytes.NewReader(raw))
	if _, err := dec.Token(); err != nil { // '{'
		d.fail(off, path, err.Error(), err)
		return
	}
	seen := map[string]bool{}
	for dec.More() {
		keyOff := off + skip(raw, int(dec.InputOffset()), ",")
		tok, err := dec.Token()
		if err != nil {
			d.fail(keyOff, path, err.Error(), err)
			return
		}
		key, _ := tok.(string)
		valOff := off + skip(raw, int(dec.InputOffset()), ":")
		var val json.RawMessage
		if err := dec.Decode(&val); err != nil {
			d.fail(valOff, path, err.Error(), err)
			return
		}
		if strings.HasPrefix(key, "//") {
			continue // a comment
		}
		sub := key
		if path != "" {
			sub = path + "." + key
		}
		if seen[key] {
			d.fail(keyOff, sub, "duplicate field", nil)
			continue
		}
		seen[key] = true
		idx, ok := fields[key]
		switch {
		case ok:
			d.value(sub, valOff, val, v.Field(idx))
		case extra >= 0 && suggest(key, fields) != "":
			// A key kept for other plugins that is one or two edits
			// from a known one is a typo ("prefil"): the setting would
			// silently keep its default.
			d.fail(keyOff, sub, fmt.Sprintf("unknown field (did you mean %q?)", suggest(key, fields)), nil)
		case extra >= 0:
			m := v.Field(extra)
			if m.IsNil() {
				m.Set(reflect.MakeMap(m.Type()))
			}
			m.SetMapIndex(reflect.ValueOf(key), reflect.ValueOf(json.RawMessage(bytes.Clone(val))))
		default:
			msg := "unknown field"
			if s := suggest(key, fields); s != "" {
				msg += fmt.Sprintf(" (did you mean %q?)", s)
			}
			d.fail(keyOff, sub, msg, nil)
		}
	}
}

// structFields maps t's JSON names to field indexes; extra is the index of
// the field tagged kvflow:"extra" (a map keeping unknown keys) or -1.
func structFields(t reflect.Type) (fields map[string]int, extra int) {
	fields, extra = map[string]int{}, -1
	for i := range t.NumField() {
		f := t.Field(i)
		if f.Tag.Get("kvflow") == "extra" {
			extra = i
			continue
		}
		name, _, _ := strings.Cut(f.Tag.Get("json"), ",")
		if name == "-" || !f.IsExported() {
			continue
		}
		if name == "" {
			name = f.Name
		}
		fields[name] = i
	}
	return fields, extra
}

// skip returns the offset of the first byte of b at or after i that is
// neither JSON whitespace nor one of seps.
func skip(b []byte, i int, seps string) int {
	for i < len(b) && (strings.IndexByte(" \t\r\n", b[i]) >= 0 || strings.IndexByte(seps, b[i]) >= 0) {
		i++
	}
	return i
}

// want names what a Go type accepts, for error messages.
func want(t reflect.Type) string {
	switch t {
	case reflect.TypeFor[Port]():
		return "a port number"
	case reflect.TypeFor[Duration]():
		return `a duration string such as "30s"`
	}
	switch t.Kind() {
	case reflect.Pointer:
		return want(t.Elem())
	case reflect.Int, reflect.Int8, reflect.Int16, reflect.Int32, reflect.Int64,
		reflect.Uint, reflect.Uint8, reflect.Uint16, reflect.Uint32, reflect.Uint64:
		return "an integer"
	case reflect.Float32, reflect.Float64:
		return "a number"
	case reflect.String:
		return "a string"
	case reflect.Bool:
		return "true or false"
	case reflect.Struct, reflect.Map:
		return "an object"
	case reflect.Slice, reflect.Array:
		return "an array"
	}
	return t.String()
}

// suggest returns the known field closest to key (edit distance <= 2).
func suggest(key string, fields map[string]int) string {
	names := make([]string, 0, len(fields))
	for name := range fields {
		names = append(names, name)
	}
	sort.Strings(names)
	best, bestD := "", 3
	for _, name := range names {
		if dist := editDistance(key, name, bestD); dist < bestD {
			best, bestD = name, dist
		}
	}
	return best
}

// editDistance is the Levenshtein distance of a and b, or limit when it is
// at least limit.
func editDistance(a, b string, limit int) int {
	if d := len(a) - len(b); d >= limit || -d >= limit {
		return limit
	}
	prev := make([]int, len(b)+1)
	cur := make([]int, len(b)+1)
	for j := range prev {
		prev[j] = j
	}
	for i := 1; i <= len(a); i++ {
		cur[0] = i
		for j := 1; j <= len(b); j++ {
			cost := 1
			if a[i-1] == b[j-1] {
				cost = 0
			}
			cur[j] = min(prev[j]+1, cur[j-1]+1, prev[j-1]+cost)
		}
		prev, cur = cur, prev
	}
	return min(prev[len(b)], limit)
}
