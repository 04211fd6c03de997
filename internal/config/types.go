package config

import (
	"bytes"
	"encoding/json"
	"fmt"
	"sort"
	"strconv"
	"strings"
	"time"
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

// Duration is a time.Duration written in JSON as a Go duration string
// ("30s", "1m30s", "250ms").
type Duration time.Duration

// D is the value as a time.Duration.
func (d Duration) D() time.Duration { return time.Duration(d) }

// UnmarshalJSON implements json.Unmarshaler.
func (d *Duration) UnmarshalJSON(b []byte) error {
	if string(bytes.TrimSpace(b)) == "null" {
		return nil
	}
	var s string
	if err := json.Unmarshal(b, &s); err != nil {
		return fmt.Errorf(`want a duration string such as "30s", got %s`, describe(b))
	}
	v, err := time.ParseDuration(strings.TrimSpace(s))
	if err != nil {
		return fmt.Errorf(`want a duration such as "30s" or "250ms", got %q`, s)
	}
	*d = Duration(v)
	return nil
}

// MarshalJSON implements json.Marshaler.
func (d Duration) MarshalJSON() ([]byte, error) { return json.Marshal(time.Duration(d).String()) }

// String implements flag.Value.
func (d *Duration) String() string {
	if d == nil {
		return "0s"
	}
	return time.Duration(*d).String()
}

// Set implements flag.Value.
func (d *Duration) Set(s string) error {
	v, err := time.ParseDuration(strings.TrimSpace(s))
	if err != nil {
		return fmt.Errorf(`want a duration such as "30s" or "250ms", got %q`, s)
	}
	*d = Duration(v)
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
func describe(raw []byte) string {
	raw = bytes.TrimSpace(raw)
	if len(raw) == 0 {
		return "nothing"
	}
	excerpt := func(kind string) string {
		s := string(raw)
		if len(s) > 40 {
			s = s[:37] + "..."
		}
		return kind + " " + s
	}
	switch raw[0] {
	case '{':
		return "an object"
	case '[':
		return "an array"
	case '"':
		return excerpt("string")
	case 't', 'f':
		return excerpt("boolean")
	case 'n':
		return "null"
	}
	return excerpt("number")
}

// GrantsMode is read.grants: which reads a prefill worker's transfer
// engine serves. JSON: "auto", "on" or "off" (true and false read as "on"
// and "off", the setting's earlier boolean form).
type GrantsMode string

const (
	// GrantsAuto, the default: a held request whose send carries block
	// ids (kvflow's connector always sends them) has exactly those blocks
	// readable while it is held; one whose send carries none (an engine
	// that cannot name them) opens every block while it is held, with a
	// warning the first time. With no request held nothing is readable.
	GrantsAuto GrantsMode = "auto"
	// GrantsOn: only blocks named by a held request's send are readable;
	// a send without block ids makes nothing readable (its decode's reads
	// are refused).
	GrantsOn GrantsMode = "on"
	// GrantsOff: every registered byte is readable by any peer that
	// reaches the data port, at any time (Mooncake's behaviour).
	GrantsOff GrantsMode = "off"
)

// UnmarshalJSON implements json.Unmarshaler.
func (g *GrantsMode) UnmarshalJSON(b []byte) error {
	switch s := string(bytes.TrimSpace(b)); s {
	case "null":
		return nil
	case "true":
		*g = GrantsOn
		return nil
	case "false":
		*g = GrantsOff
		return nil
	}
	var s string
	if err := json.Unmarshal(b, &s); err != nil {
		return fmt.Errorf(`want "auto", "on" or "off", got %s`, describe(b))
	}
	return g.Set(s)
}

// String implements flag.Value.
func (g *GrantsMode) String() string {
	if g == nil || *g == "" {
		return string(GrantsAuto)
	}
	return string(*g)
}

// Set implements flag.Value (auto, on, off; true and false as on and off).
func (g *GrantsMode) Set(s string) error {
	switch v := strings.ToLower(strings.TrimSpace(s)); v {
	case "auto", "on", "off":
		*g = GrantsMode(v)
	case "true", "1":
		*g = GrantsOn
	case "false", "0":
		*g = GrantsOff
	default:
		return fmt.Errorf(`want auto, on or off, got %q`, s)
	}
	return nil
}

// IsBoolFlag lets --read-grants alone mean on.
func (g *GrantsMode) IsBoolFlag() bool { return true }

// Valid reports whether g is one of the modes ("" reads as auto).
func (g GrantsMode) Valid() bool {
	return g == "" || g == GrantsAuto || g == GrantsOn || g == GrantsOff
}

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
