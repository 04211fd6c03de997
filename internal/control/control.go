package control

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"math"
	"reflect"
	"strings"
	"time"

	"github.com/vmihailenco/msgpack/v5"
	"github.com/vmihailenco/msgpack/v5/msgpcode"

	"github.com/kvflow/kvflow/internal/decode"
	"github.com/kvflow/kvflow/internal/prefill"
	"github.com/kvflow/kvflow/internal/sidechannel"
)

// Request is one control message.
type Request struct {
	Op         string                `msgpack:"op"`
	Load       []decode.LoadRequest  `msgpack:"-"`
	Send       []prefill.SendRequest `msgpack:"-"`
	RequestIDs []string              `msgpack:"request_ids"`
}

// Reply is the answer to one control message.
type Reply struct {
	OK            bool             `msgpack:"ok"`
	Error         string           `msgpack:"error,omitempty"`
	Errors        []*string        `msgpack:"errors,omitempty"`
	Aborted       *int             `msgpack:"aborted,omitempty"`
	DoneSending   []string         `msgpack:"done_sending"`
	DoneRecving   []string         `msgpack:"done_recving"`
	FailedRecving []decode.Failure `msgpack:"failed_recving"`
	Role          string           `msgpack:"role,omitempty"`
	Status        map[string]any   `msgpack:"status,omitempty"`
}

// Backend is the worker behind the socket. Load is nil on a prefill
// worker, Send on a decode worker.
type Backend struct {
	Role     string
	Load     func(ctx context.Context, reqs []decode.LoadRequest) []error
	Send     func(reqs []prefill.SendRequest) []error
	Abort    func(ids []string) int
	Finished func() (doneSending, doneRecving []string, failed []decode.Failure)
	Status   func() map[string]any
}

// LoadTimeout bounds how long a load waits for room in a full pipeline
// before the request gets an error (the engine retries it next step).
var LoadTimeout = 5 * time.Second

// background picks the control requests that change a worker's state
// (load, send, abort). The socket serves them one at a time, in arrival
// order, on a goroutine of their own, while finished and status polls are
// answered at once: a load waiting (up to LoadTimeout) for room in a full
// pipeline must not hold up the engine's finished polls, whose replies
// carry the completion times (measured: the last loads of a 512-request
// burst blocked 55-130 ms and every poll behind them waited as long),
// and an abort must still see the loads that arrived before it. Only the
// op is read here (peekOp), so a load is decoded once, by Dispatch; a
// message whose op cannot be read is answered at once (with its error),
// one whose op reads but whose rest is malformed gets its error from the
// background goroutine, in order.
func background(payload []byte) bool {
	switch peekOp(payload) {
	case "load", "send", "abort":
		return true
	}
	return false
}

// peekOp returns the string value of the top-level "op" key of a msgpack
// map (the last one, as Decode reads a repeated key) without decoding the
// other values; "" if b is not such a map.
func peekOp(b []byte) string {
	if len(b) == 0 || !isMap(b[0]) {
		return ""
	}
	d := msgpack.NewDecoder(bytes.NewReader(b))
	n, err := d.DecodeMapLen()
	if err != nil {
		return ""
	}
	op := ""
	for range n {
		c, err := d.PeekCode()
		if err != nil {
			return ""
		}
		if !msgpcode.IsString(c) && !msgpcode.IsBin(c) { // Decode reads bin keys as strings too
			if scanValue(d, 1) != nil || scanValue(d, 1) != nil { // key, value
				return ""
			}
			continue
		}
		k, err := d.DecodeString()
		if err != nil {
			return ""
		}
		if k != "op" {
			if scanValue(d, 1) != nil { // bounded: Skip recurses without limit
				return ""
			}
			continue
		}
		if op, err = d.DecodeString(); err != nil {
			return ""
		}
	}
	return op
}

// MaxRequests bounds the requests of one message.
const MaxRequests = 1 << 16

// ErrBadRequest marks malformed control messages.
var ErrBadRequest = errors.New("control: bad request")

// maxDepth bounds the nesting of maps and arrays in a message, the message
// itself included. A well-formed message nests 5 deep (message, requests,
// request, kv_transfer_params, remote_block_ids); the bound leaves room for
// clients' extra fields. Without it a deeply nested unknown field would
// overflow the decoder's stack (a fatal error, not a recoverable panic)
// well within MaxMessageBytes.
const maxDepth = 16

// Required keys of each request, as the seed reads them (a KeyError there).
// A list may be nil (a Go client's nil slice: no blocks); the others must
// not be.
type key struct {
	name  string
	nilOK bool
}

var (
	loadKeys   = []key{{"request_id", false}, {"local_block_ids", true}, {"kv_transfer_params", false}}
	paramsKeys = []key{{"remote_block_ids", true}, {"remote_engine_id", false}, {"remote_host", false}, {"remote_port", false}}
	sendKeys   = []key{{"request_id", false}}
)

// Decode parses one control message: exactly one msgpack map (no trailing
// bytes), nested at most maxDepth deep, with no integer above 2^63-1.
func Decode(b []byte) (Request, error) {
	if err := scan(b); err != nil {
		return Request{}, fmt.Errorf("%w: %v", ErrBadRequest, err)
	}
	var raw struct {
		Op         string             `msgpack:"op"`
		Requests   msgpack.RawMessage `msgpack:"requests"`
		RequestIDs []string           `msgpack:"request_ids"`
	}
	if err := msgpack.Unmarshal(b, &raw); err != nil {
		return Request{}, fmt.Errorf("%w: %v", ErrBadRequest, fieldError(b, reflect.TypeOf(raw), "", err))
	}
	r := Request{Op: raw.Op, RequestIDs: raw.RequestIDs}
	if len(r.RequestIDs) > MaxRequests {
		return Request{}, fmt.Errorf("%w: %d request_ids, max %d", ErrBadRequest, len(r.RequestIDs), MaxRequests)
	}
	switch raw.Op {
	case "load":
		if err := decodeList(raw.Requests, &r.Load, loadKeys); err != nil {
			return Request{}, err
		}
	case "send":
		if err := decodeList(raw.Requests, &r.Send, sendKeys); err != nil {
			return Request{}, err
		}
	case "abort":
		if raw.RequestIDs == nil {
			return Request{}, fmt.Errorf("%w: abort: request_ids missing", ErrBadRequest)
		}
	case "finished", "status":
	case "":
		return Request{}, fmt.Errorf("%w: op missing", ErrBadRequest)
	default:
		return Request{}, fmt.Errorf("%w: unknown op %q (want load, send, abort, finished, status)", ErrBadRequest, raw.Op)
	}
	return r, nil
}

// scan checks the structure of a message before it is decoded.
func scan(b []byte) error {
	if len(b) == 0 {
		return errors.New("empty message")
	}
	if !isMap(b[0]) {
		return fmt.Errorf("message is not a msgpack map (first byte %#02x)", b[0])
	}
	rd := bytes.NewReader(b)
	if err := scanValue(msgpack.NewDecoder(rd), 0); err != nil {
		return err
	}
	if rd.Len() > 0 {
		return fmt.Errorf("%d trailing bytes after the message", rd.Len())
	}
	return nil
}

func scanValue(d *msgpack.Decoder, depth int) error {
	c, err := d.PeekCode()
	if err != nil {
		return err
	}
	n := 0
	switch {
	case isMap(c):
		if n, err = d.DecodeMapLen(); err != nil {
			return err
		}
		n *= 2
	case msgpcode.IsFixedArray(c) || c == msgpcode.Array16 || c == msgpcode.Array32:
		if n, err = d.DecodeArrayLen(); err != nil {
			return err
		}
	case c == msgpcode.Uint64:
		v, err := d.DecodeUint64()
		if err == nil && v > math.MaxInt64 {
			err = fmt.Errorf("integer %d out of range", v)
		}
		return err
	default:
		return d.Skip()
	}
	if depth >= maxDepth {
		return fmt.Errorf("nested deeper than %d", maxDepth)
	}
	for range n {
		if err := scanValue(d, depth+1); err != nil {
			return err
		}
	}
	return nil
}

func isMap(c byte) bool { return msgpcode.IsFixedMap(c) || c == msgpcode.Map16 || c == msgpcode.Map32 }

// decodeList decodes the requests of a load or send: an array of maps, each
// with the keys required (present and not nil).
func decodeList[T any](b msgpack.RawMessage, out *[]T, required []key) error {
	if len(b) == 0 || b[0] == msgpcode.Nil {
		return fmt.Errorf("%w: requests missing", ErrBadRequest)
	}
	var elems []msgpack.RawMessage
	if err := msgpack.Unmarshal(b, &elems); err != nil {
		return fmt.Errorf("%w: requests: %v", ErrBadRequest, err)
	}
	if len(elems) > MaxRequests {
		return fmt.Errorf("%w: %d requests, max %d", ErrBadRequest, len(elems), MaxRequests)
	}
	*out = make([]T, len(elems))
	for i, e := range elems {
		if err := checkKeys(e, required, ""); err != nil {
			return fmt.Errorf("%w: requests[%d]: %v", ErrBadRequest, i, err)
		}
		if err := msgpack.Unmarshal(e, &(*out)[i]); err != nil {
			return fmt.Errorf("%w: %v", ErrBadRequest, fieldError(e, reflect.TypeFor[T](), fmt.Sprintf("requests[%d].", i), err))
		}
	}
	return nil
}

// fieldError names the field of a message that failed to decode into t
// (err is the decoder's, which names only the types): it decodes each
// field of the map b on its own, recursing into structs, and reports the
// first that fails as "path: want T, got K (err)". Without a culprit it
// returns prefix and err.
func fieldError(b []byte, t reflect.Type, prefix string, err error) error {
	if path, want, got, ok := findField(b, t, prefix); ok {
		return fmt.Errorf("%s: want %s, got %s (%v)", path, want, got, err)
	}
	return fmt.Errorf("%s%v", prefix, err)
}

func findField(b []byte, t reflect.Type, prefix string) (path, want, got string, ok bool) {
	if t.Kind() != reflect.Struct || len(b) == 0 || !isMap(b[0]) {
		return "", "", "", false
	}
	var m map[string]msgpack.RawMessage
	if msgpack.Unmarshal(b, &m) != nil {
		return "", "", "", false
	}
	for i := range t.NumField() {
		f := t.Field(i)
		name, _, _ := strings.Cut(f.Tag.Get("msgpack"), ",")
		if name == "-" || !f.IsExported() {
			continue
		}
		if name == "" {
			name = f.Name
		}
		raw, present := m[name]
		if !present {
			continue
		}
		if msgpack.Unmarshal(raw, reflect.New(f.Type).Interface()) == nil {
			continue
		}
		if p, w, g, ok := findField(raw, f.Type, prefix+name+"."); ok {
			return p, w, g, true
		}
		return prefix + name, kindName(f.Type), codeName(raw), true
	}
	return "", "", "", false
}

// kindName names what a Go type accepts, for error messages.
func kindName(t reflect.Type) string {
	switch t.Kind() {
	case reflect.String:
		return "a string"
	case reflect.Int, reflect.Int8, reflect.Int16, reflect.Int32, reflect.Int64,
		reflect.Uint, reflect.Uint8, reflect.Uint16, reflect.Uint32, reflect.Uint64:
		return "an integer"
	case reflect.Float32, reflect.Float64:
		return "a number"
	case reflect.Bool:
		return "a boolean"
	case reflect.Slice, reflect.Array:
		if t.Elem().Kind() == reflect.Uint8 {
			return "bytes"
		}
		return "an array of " + strings.TrimPrefix(strings.TrimPrefix(kindName(t.Elem()), "an "), "a ") + "s"
	case reflect.Struct, reflect.Map:
		return "a map"
	}
	return t.String()
}

// codeName names the msgpack type of the value starting at raw[0].
func codeName(raw []byte) string {
	if len(raw) == 0 {
		return "nothing"
	}
	c := raw[0]
	switch {
	case c == msgpcode.Nil:
		return "nil"
	case c == msgpcode.True || c == msgpcode.False:
		return "a boolean"
	case msgpcode.IsFixedNum(c) || (c >= msgpcode.Uint8 && c <= msgpcode.Int64):
		return "an integer"
	case c == msgpcode.Float || c == msgpcode.Double:
		return "a float"
	case msgpcode.IsString(c):
		return "a string"
	case msgpcode.IsBin(c):
		return "bytes"
	case msgpcode.IsFixedArray(c) || c == msgpcode.Array16 || c == msgpcode.Array32:
		return "an array"
	case isMap(c):
		return "a map"
	}
	return fmt.Sprintf("msgpack code %#02x", c)
}

// checkKeys checks that e is a map holding every required key (and, for a
// load, that kv_transfer_params holds the seed's).
func checkKeys(e msgpack.RawMessage, required []key, prefix string) error {
	if len(e) == 0 || !isMap(e[0]) {
		return fmt.Errorf("%snot a map", prefix)
	}
	var m map[string]msgpack.RawMessage
	if err := msgpack.Unmarshal(e, &m); err != nil {
		return fmt.Errorf("%s%v", prefix, err)
	}
	for _, k := range required {
		v, ok := m[k.name]
		isNil := len(v) == 0 || v[0] == msgpcode.Nil // the decoder leaves nil empty
		if !ok || (isNil && !k.nilOK) {
			return fmt.Errorf("%s%s missing", prefix, k.name)
		}
		if k.name == "kv_transfer_params" {
			if err := checkKeys(v, paramsKeys, "kv_transfer_params."); err != nil {
				return err
			}
		}
	}
	return nil
}

// Encode writes a reply.
func Encode(r Reply) []byte {
	b, err := msgpack.Marshal(r)
	if err != nil { // only a programming error can get here
		b, _ = msgpack.Marshal(Reply{Error: "encode reply: " + err.Error()})
	}
	return b
}

// Dispatch runs one message against b. It always returns a reply: a
// malformed message, an op the backend does not implement (a nil func), a
// backend that returns the wrong number of errors, or one that panics each
// get an error reply.
func Dispatch(ctx context.Context, b Backend, payload []byte) (rep Reply) {
	req, err := Decode(payload)
	if err != nil {
		return Reply{Error: err.Error()}
	}
	defer func() {
		if v := recover(); v != nil {
			rep = Reply{Error: fmt.Sprintf("op %s: internal error: %v", req.Op, v)}
		}
	}()
	unsupported := func() Reply {
		return Reply{Error: fmt.Sprintf("op %s: not supported by a %s worker", req.Op, role(b))}
	}
	switch req.Op {
	case "load":
		if b.Load == nil {
			return unsupported()
		}
		ctx, cancel := context.WithTimeout(ctx, LoadTimeout)
		defer cancel()
		return perRequest(req.Op, len(req.Load), b.Load(ctx, req.Load))
	case "send":
		if b.Send == nil {
			return unsupported()
		}
		return perRequest(req.Op, len(req.Send), b.Send(req.Send))
	case "abort":
		if b.Abort == nil {
			return unsupported()
		}
		n := b.Abort(req.RequestIDs)
		return Reply{OK: true, Aborted: &n}
	case "finished":
		if b.Finished == nil {
			return unsupported()
		}
		ds, dr, f := b.Finished()
		return Reply{OK: true, DoneSending: nonNil(ds), DoneRecving: nonNil(dr), FailedRecving: nonNilF(f)}
	case "status":
		var st map[string]any
		if b.Status != nil {
			st = b.Status()
		}
		return Reply{OK: true, Role: b.Role, Status: st}
	}
	return Reply{Error: "unreachable"}
}

func role(b Backend) string {
	if b.Role == "" {
		return "this"
	}
	return b.Role
}

// perRequest is the reply of a load or send of n requests.
func perRequest(op string, n int, errs []error) Reply {
	if len(errs) != n {
		return Reply{Error: fmt.Sprintf("op %s: internal error: %d results for %d requests", op, len(errs), n)}
	}
	return Reply{OK: true, Errors: errStrings(errs)}
}

func errStrings(errs []error) []*string {
	out := make([]*string, len(errs))
	for i, e := range errs {
		if e != nil {
			s := e.Error()
			out[i] = &s
		}
	}
	return out
}

func nonNil(s []string) []string {
	if s == nil {
		return []string{}
	}
	return s
}

func nonNilF(s []decode.Failure) []decode.Failure {
	if s == nil {
		return []decode.Failure{}
	}
	return s
}

// Serve binds the control socket at endpoint on zctx. curve, if set,
// authenticates tcp:// endpoints (an ipc:// socket is guarded by its file's
// permissions and stays plain, so a local engine needs no keys).
func Serve(ctx context.Context, zctx *sidechannel.Context, endpoint string, b Backend, curve *sidechannel.Curve) (*sidechannel.Server, error) {
	if !strings.HasPrefix(endpoint, "tcp://") {
		curve = nil
	}
	srv, err := sidechannel.NewRouter(zctx, sidechannel.ServerOptions{Addr: endpoint, Name: "control socket", MaxMessageBytes: 64 << 20, Curve: curve, Background: background},
		func(p []byte) []byte { return Encode(Dispatch(ctx, b, p)) })
	if err != nil {
		return nil, fmt.Errorf("control socket %s: %w", endpoint, err)
	}
	return srv, nil
}
