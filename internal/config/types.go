package config

import (
	"bytes"
	"encoding/json"
	"fmt"
	"github.com/kvflow/kvflow/stages/conf"
	"sort"
	"strconv"
	"strings"
)

// Port is a TCP port that decodes from a JSON number or a string holding one
// (vLLM configs often carry "kv_port": "20001"). It encodes as a number.
type Port int

// UnmarshalJSON implements json.Unmarshaler.
func (p *Port) UnmarshalJSON(b []byte) error {
	s := string(bytes.TrimSpace(b))
	if s == "null" {
		return nil
	}
	if strings.HasPrefix(s, `"`) {
		var str string
		if err := json.Unmarshal(b, &str); err != nil {
			return err
		}
		s = strings.TrimSpace(str)
		if s == "" {
			return fmt.Errorf("want a port number or a string holding one, got an empty string")
		}
	}
	v, err := strconv.Atoi(s)
	if err != nil {
		return fmt.Errorf("want a port number or a string holding one, got %s", describe(b))
	}
	*p = Port(v)
	return nil
}

// MarshalJSON implements json.Marshaler.
func (p Port) MarshalJSON() ([]byte, error) { return strconv.AppendInt(nil, int64(p), 10), nil }

// String implements flag.Value.
func (p *Port) String() string {
	if p == nil {
		return "0"
	}
	return strconv.Itoa(int(*p))
}

// Set implements flag.Value.
func (p *Port) Set(s string) error {
	v, err := strconv.Atoi(strings.TrimSpace(s))
	if err != nil {
		return fmt.Errorf("want a port number, got %q", s)
	}
	*p = Port(v)
	return nil
}

// MarshalJSON writes prefill and decode, then the preserved unknown keys in
// sorted order.
func (e ExtraConfig) MarshalJSON() ([]byte, error) {
	type plain ExtraConfig
	b, err := json.Marshal(plain(e))
	if err != nil {
		return nil, err
	}
	return appendExtra(b, e.Extra)
}

// appendExtra splices extra's members into the encoded object obj.
func appendExtra(obj []byte, extra map[string]json.RawMessage) ([]byte, error) {
	if len(extra) == 0 {
		return obj, nil
	}
	keys := make([]string, 0, len(extra))
	for k := range extra {
		keys = append(keys, k)
	}
	sort.Strings(keys)
	out := bytes.TrimSuffix(obj, []byte("}"))
	for _, k := range keys {
		v := extra[k]
		if !json.Valid(v) {
			return nil, fmt.Errorf("preserved key %q holds invalid JSON", k)
		}
		kb, _ := json.Marshal(k)
		if len(out) > 1 {
			out = append(out, ',')
		}
		out = append(out, kb...)
		out = append(out, ':')
		out = append(out, v...)
	}
	return append(out, '}'), nil
}

// FieldError is one configuration problem: the field's JSON path (dotted,
// e.g. "kv_transfer_config.kv_connector_extra_config.decode.tp_size"), what
// is wrong, and, for problems found while decoding a file, the position
// ("file:line:col").
type FieldError struct {
	Pos  string // "file:line:col" or "line:col" when decoding; "" otherwise
	Path string // JSON path; "" for the document itself
	Msg  string
	Err  error // the underlying error, if any
}

func (e *FieldError) Error() string {
	var b strings.Builder
	if e.Pos != "" {
		b.WriteString(e.Pos)
		b.WriteString(": ")
	}
	if e.Path != "" {
		b.WriteString(e.Path)
		b.WriteString(": ")
	}
	b.WriteString(e.Msg)
	return b.String()
}

// Unwrap returns the underlying error.
func (e *FieldError) Unwrap() error { return e.Err }

// describe names a JSON value's kind for error messages, with a short
// excerpt of scalars.
func describe(raw []byte) string { return conf.Describe(raw) }

// UnknownExtraKeys lists, sorted, the keys of kv_connector_extra_config
// other than prefill and decode: other plugins' settings, which kvflow
// keeps but never reads. serve logs them once at warn, so that a key meant
// for kvflow in the wrong place is seen.
func (e ExtraConfig) UnknownExtraKeys() []string {
	keys := make([]string, 0, len(e.Extra))
	for k := range e.Extra {
		keys = append(keys, k)
	}
	sort.Strings(keys)
	return keys
}
