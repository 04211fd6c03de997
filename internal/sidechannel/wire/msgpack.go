package wire

import (
	"fmt"
	"math"
	"unicode/utf8"
)

// This file is a deliberately small msgpack subset: the writer emits only the
// forms the side channel uses, always in their smallest header (as msgspec and
// msgpack-python do); the reader is strict about the types it is asked for,
// can skip any well-formed msgpack value (so unknown map fields are
// tolerated), never allocates more than the input can back, and bounds
// nesting depth.

// maxSkipDepth bounds the nesting of values skipped inside unknown fields. The
// side channel's own messages nest at most two levels; 32 leaves room for
// future fields while keeping a hostile "[[[[..." input from recursing deeply.
const maxSkipDepth = 32

func appendArrayLen(b []byte, n int) []byte {
	switch {
	case n < 16:
		return append(b, 0x90|byte(n))
	case n <= math.MaxUint16:
		return append(b, 0xdc, byte(n>>8), byte(n))
	default:
		return append(b, 0xdd, byte(n>>24), byte(n>>16), byte(n>>8), byte(n))
	}
}

func appendMapLen(b []byte, n int) []byte {
	switch {
	case n < 16:
		return append(b, 0x80|byte(n))
	case n <= math.MaxUint16:
		return append(b, 0xde, byte(n>>8), byte(n))
	default:
		return append(b, 0xdf, byte(n>>24), byte(n>>16), byte(n>>8), byte(n))
	}
}

func appendStr(b []byte, s string) []byte {
	n := len(s)
	switch {
	case n < 32:
		b = append(b, 0xa0|byte(n))
	case n <= math.MaxUint8:
		b = append(b, 0xd9, byte(n))
	case n <= math.MaxUint16:
		b = append(b, 0xda, byte(n>>8), byte(n))
	default:
		b = append(b, 0xdb, byte(n>>24), byte(n>>16), byte(n>>8), byte(n))
	}
	return append(b, s...)
}

func appendBin(b []byte, s string) []byte {
	n := len(s)
	switch {
	case n <= math.MaxUint8:
		b = append(b, 0xc4, byte(n))
	case n <= math.MaxUint16:
		b = append(b, 0xc5, byte(n>>8), byte(n))
	default:
		b = append(b, 0xc6, byte(n>>24), byte(n>>16), byte(n>>8), byte(n))
	}
	return append(b, s...)
}

func appendUint(b []byte, v uint64) []byte {
	switch {
	case v <= 0x7f:
		return append(b, byte(v))
	case v <= math.MaxUint8:
		return append(b, 0xcc, byte(v))
	case v <= math.MaxUint16:
		return append(b, 0xcd, byte(v>>8), byte(v))
	case v <= math.MaxUint32:
		return append(b, 0xce, byte(v>>24), byte(v>>16), byte(v>>8), byte(v))
	default:
		return append(b, 0xcf, byte(v>>56), byte(v>>48), byte(v>>40), byte(v>>32),
			byte(v>>24), byte(v>>16), byte(v>>8), byte(v))
	}
}

// appendInt writes v as msgpack-python does: non-negative values in the
// unsigned forms, negative ones in the smallest signed form.
func appendInt(b []byte, v int64) []byte {
	switch {
	case v >= 0:
		return appendUint(b, uint64(v))
	case v >= -32:
		return append(b, byte(v))
	case v >= math.MinInt8:
		return append(b, 0xd0, byte(v))
	case v >= math.MinInt16:
		return append(b, 0xd1, byte(v>>8), byte(v))
	case v >= math.MinInt32:
		return append(b, 0xd2, byte(v>>24), byte(v>>16), byte(v>>8), byte(v))
	default:
		u := uint64(v)
		return append(b, 0xd3, byte(u>>56), byte(u>>48), byte(u>>40), byte(u>>32),
			byte(u>>24), byte(u>>16), byte(u>>8), byte(u))
	}
}

// reader decodes msgpack from b, tracking the offset for error messages. field
// names the value being read, for errors ("kv_caches_base_addr[3]").
type reader struct {
	b   []byte
	off int
}

func (r *reader) errf(field, format string, args ...any) error {
	return &DecodeError{Field: field, Offset: r.off, Msg: fmt.Sprintf(format, args...)}
}

func (r *reader) remaining() int { return len(r.b) - r.off }

// peek returns the next type code without consuming it.
func (r *reader) peek(field string) (byte, error) {
	if r.off >= len(r.b) {
		return 0, r.errf(field, "unexpected end of input")
	}
	return r.b[r.off], nil
}

// take consumes n bytes.
func (r *reader) take(field string, n int) ([]byte, error) {
	if n < 0 || n > r.remaining() {
		return nil, r.errf(field, "truncated: need %d bytes, have %d", n, r.remaining())
	}
	s := r.b[r.off : r.off+n]
	r.off += n
	return s, nil
}

// be reads an n-byte big-endian unsigned integer (n ≤ 8).
func (r *reader) be(field string, n int) (uint64, error) {
	s, err := r.take(field, n)
	if err != nil {
		return 0, err
	}
	var v uint64
	for _, c := range s {
		v = v<<8 | uint64(c)
	}
	return v, nil
}

// length reads the n-byte length that follows a header code and checks that
// the input could hold at least minPer bytes per counted item.
func (r *reader) length(field string, n, minPer int) (int, error) {
	v, err := r.be(field, n)
	if err != nil {
		return 0, err
	}
	if minPer > 0 && v > uint64(r.remaining()/minPer) {
		return 0, r.errf(field, "length %d exceeds the %d bytes left", v, r.remaining())
	}
	return int(v), nil
}

func (r *reader) arrayLen(field string) (int, error) {
	c, err := r.peek(field)
	if err != nil {
		return 0, err
	}
	switch {
	case c >= 0x90 && c <= 0x9f:
		r.off++
		return int(c & 0x0f), nil
	case c == 0xdc:
		r.off++
		return r.length(field, 2, 1)
	case c == 0xdd:
		r.off++
		return r.length(field, 4, 1)
	}
	return 0, r.errf(field, "want array, got %s (0x%02x)", typeName(c), c)
}

func (r *reader) mapLen(field string) (int, error) {
	c, err := r.peek(field)
	if err != nil {
		return 0, err
	}
	switch {
	case c >= 0x80 && c <= 0x8f:
		r.off++
		return int(c & 0x0f), nil
	case c == 0xde:
		r.off++
		return r.length(field, 2, 2)
	case c == 0xdf:
		r.off++
		return r.length(field, 4, 2)
	}
	return 0, r.errf(field, "want map, got %s (0x%02x)", typeName(c), c)
}

// str reads a msgpack str (not bin) holding valid UTF-8, as msgspec requires.
func (r *reader) str(field string) (string, error) {
	c, err := r.peek(field)
	if err != nil {
		return "", err
	}
	var n int
	switch {
	case c >= 0xa0 && c <= 0xbf:
		r.off++
		n = int(c & 0x1f)
	case c == 0xd9:
		r.off++
		n, err = r.length(field, 1, 0)
	case c == 0xda:
		r.off++
		n, err = r.length(field, 2, 0)
	case c == 0xdb:
		r.off++
		n, err = r.length(field, 4, 0)
	default:
		return "", r.errf(field, "want str, got %s (0x%02x)", typeName(c), c)
	}
	if err != nil {
		return "", err
	}
	start := r.off
	s, err := r.take(field, n)
	if err != nil {
		return "", err
	}
	if !utf8.Valid(s) {
		r.off = start
		return "", r.errf(field, "str is not valid UTF-8")
	}
	return string(s), nil
}

// bin reads a msgpack bin (not str). The returned slice aliases the input.
func (r *reader) bin(field string) ([]byte, error) {
	c, err := r.peek(field)
	if err != nil {
		return nil, err
	}
	var n int
	switch c {
	case 0xc4:
		r.off++
		n, err = r.length(field, 1, 0)
	case 0xc5:
		r.off++
		n, err = r.length(field, 2, 0)
	case 0xc6:
		r.off++
		n, err = r.length(field, 4, 0)
	default:
		return nil, r.errf(field, "want bin, got %s (0x%02x)", typeName(c), c)
	}
	if err != nil {
		return nil, err
	}
	return r.take(field, n)
}

// uint reads a non-negative integer in any msgpack integer form (encoders
// other than msgspec may write a positive value in a signed form).
func (r *reader) uint(field string) (uint64, error) {
	c, err := r.peek(field)
	if err != nil {
		return 0, err
	}
	switch {
	case c <= 0x7f:
		r.off++
		return uint64(c), nil
	case c >= 0xcc && c <= 0xcf:
		r.off++
		return r.be(field, 1<<(c-0xcc))
	case c >= 0xd0 && c <= 0xd3:
		start := r.off
		r.off++
		n := 1 << (c - 0xd0)
		u, err := r.be(field, n)
		if err != nil {
			return 0, err
		}
		if u>>(uint(n)*8-1) != 0 { // sign bit set
			r.off = start
			return 0, r.errf(field, "want non-negative integer, got a negative one")
		}
		return u, nil
	case c >= 0xe0:
		return 0, r.errf(field, "want non-negative integer, got a negative one")
	}
	return 0, r.errf(field, "want integer, got %s (0x%02x)", typeName(c), c)
}

// skip consumes one complete msgpack value of any type.
func (r *reader) skip(field string, depth int) error {
	if depth > maxSkipDepth {
		return r.errf(field, "nested deeper than %d levels", maxSkipDepth)
	}
	c, err := r.peek(field)
	if err != nil {
		return err
	}
	r.off++
	var n int // bytes to skip after the header
	switch {
	case c <= 0x7f, c >= 0xe0, c == 0xc0, c == 0xc2, c == 0xc3:
		return nil
	case c >= 0x80 && c <= 0x8f:
		return r.skipItems(field, 2*int(c&0x0f), depth)
	case c >= 0x90 && c <= 0x9f:
		return r.skipItems(field, int(c&0x0f), depth)
	case c >= 0xa0 && c <= 0xbf:
		n = int(c & 0x1f)
	case c == 0xc1:
		r.off--
		return r.errf(field, "invalid msgpack code 0xc1")
	case c == 0xc4, c == 0xd9:
		n, err = r.length(field, 1, 0)
	case c == 0xc5, c == 0xda:
		n, err = r.length(field, 2, 0)
	case c == 0xc6, c == 0xdb:
		n, err = r.length(field, 4, 0)
	case c == 0xc7:
		n, err = r.length(field, 1, 0)
		n++ // ext type byte
	case c == 0xc8:
		n, err = r.length(field, 2, 0)
		n++
	case c == 0xc9:
		n, err = r.length(field, 4, 0)
		n++
	case c == 0xca:
		n = 4
	case c == 0xcb:
		n = 8
	case c >= 0xcc && c <= 0xcf:
		n = 1 << (c - 0xcc)
	case c >= 0xd0 && c <= 0xd3:
		n = 1 << (c - 0xd0)
	case c >= 0xd4 && c <= 0xd8:
		n = 1 + 1<<(c-0xd4)
	case c == 0xdc:
		if n, err = r.length(field, 2, 1); err != nil {
			return err
		}
		return r.skipItems(field, n, depth)
	case c == 0xdd:
		if n, err = r.length(field, 4, 1); err != nil {
			return err
		}
		return r.skipItems(field, n, depth)
	case c == 0xde:
		if n, err = r.length(field, 2, 2); err != nil {
			return err
		}
		return r.skipItems(field, 2*n, depth)
	case c == 0xdf:
		if n, err = r.length(field, 4, 2); err != nil {
			return err
		}
		return r.skipItems(field, 2*n, depth)
	}
	if err != nil {
		return err
	}
	_, err = r.take(field, n)
	return err
}

func (r *reader) skipItems(field string, n, depth int) error {
	for i := 0; i < n; i++ {
		if err := r.skip(field, depth+1); err != nil {
			return err
		}
	}
	return nil
}

// typeName names the msgpack family of code c, for error messages.
func typeName(c byte) string {
	switch {
	case c <= 0x7f, c >= 0xe0, c >= 0xcc && c <= 0xd3:
		return "int"
	case c >= 0x80 && c <= 0x8f, c == 0xde, c == 0xdf:
		return "map"
	case c >= 0x90 && c <= 0x9f, c == 0xdc, c == 0xdd:
		return "array"
	case c >= 0xa0 && c <= 0xbf, c >= 0xd9 && c <= 0xdb:
		return "str"
	case c == 0xc0:
		return "nil"
	case c == 0xc2, c == 0xc3:
		return "bool"
	case c >= 0xc4 && c <= 0xc6:
		return "bin"
	case c == 0xca, c == 0xcb:
		return "float"
	case c >= 0xc7 && c <= 0xc9, c >= 0xd4 && c <= 0xd8:
		return "ext"
	}
	return "invalid"
}

// bool reads a msgpack bool (nil and integers are not bools).
func (r *reader) bool(field string) (bool, error) {
	c, err := r.peek(field)
	if err != nil {
		return false, err
	}
	switch c {
	case 0xc2:
		r.off++
		return false, nil
	case 0xc3:
		r.off++
		return true, nil
	}
	return false, r.errf(field, "want bool, got %s (0x%02x)", typeName(c), c)
}
