package conf

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"strings"
	"time"
)

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
		return fmt.Errorf(`want a duration string such as "30s", got %s`, Describe(b))
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

// Describe names a JSON value's kind for error messages, with a short
// excerpt of scalars.
func Describe(raw []byte) string {
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

// Pool is one stage's worker pool: goroutines running the stage and the
// bounded queue in front of it.
type Pool struct {
	Workers int
	Queue   int
}

// Validate reports a pool that cannot run (FieldErrors "workers", "queue").
func (p Pool) Validate() error {
	var v Problems
	v.AtLeast("workers", p.Workers, 1)
	v.AtLeast("queue", p.Queue, 1)
	return v.Err()
}

// FieldError is one problem of a stage's Config: the field by its JSON key
// within the stage's section ("timeout"), and what is wrong.
type FieldError struct {
	Field string
	Msg   string
}

func (e *FieldError) Error() string {
	if e.Field == "" {
		return e.Msg
	}
	return e.Field + ": " + e.Msg
}

// Problems collects FieldErrors (a Validate's accumulator).
type Problems struct{ errs []error }

// Add records a problem of field.
func (p *Problems) Add(field, format string, args ...any) {
	p.errs = append(p.errs, &FieldError{Field: field, Msg: fmt.Sprintf(format, args...)})
}

// AtLeast records field < lo.
func (p *Problems) AtLeast(field string, got, lo int) {
	if got < lo {
		p.Add(field, "must be >= %d, got %d", lo, got)
	}
}

// Positive records d <= 0.
func (p *Problems) Positive(field string, d Duration) {
	if d <= 0 {
		p.Add(field, "must be > 0, got %s", d.D())
	}
}

// NonNegative records d < 0.
func (p *Problems) NonNegative(field string, d Duration) {
	if d < 0 {
		p.Add(field, "must be >= 0, got %s", d.D())
	}
}

// Err is every problem recorded (errors.Join), or nil.
func (p *Problems) Err() error { return errors.Join(p.errs...) }

// Fields flattens err (joined or wrapped FieldErrors, as a Validate
// returns) into its FieldErrors; errors that are not FieldErrors are
// returned as FieldErrors with an empty Field.
func Fields(err error) []*FieldError {
	switch e := err.(type) {
	case nil:
		return nil
	case *FieldError:
		return []*FieldError{e}
	case interface{ Unwrap() []error }:
		var out []*FieldError
		for _, x := range e.Unwrap() {
			out = append(out, Fields(x)...)
		}
		return out
	case interface{ Unwrap() error }:
		if inner := e.Unwrap(); inner != nil {
			return Fields(inner)
		}
	}
	return []*FieldError{{Msg: err.Error()}}
}

// Key is a field's dotted key for flag usages: the flag prefix as a
// section ("read-" → "read") and the field's JSON key.
func Key(prefix, key string) string {
	s := strings.Trim(prefix, "-")
	if s == "" {
		return key
	}
	return strings.ReplaceAll(s, "-", ".") + "." + key
}
