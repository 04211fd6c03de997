package control

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/vmihailenco/msgpack/v5"

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

// MaxRequests bounds the requests of one message.
const MaxRequests = 1 << 16

// ErrBadRequest marks malformed control messages.
var ErrBadRequest = errors.New("control: bad request")

// Decode parses one control message.
func Decode(b []byte) (Request, error) {
	var raw struct {
		Op         string             `msgpack:"op"`
		Requests   msgpack.RawMessage `msgpack:"requests"`
		RequestIDs []string           `msgpack:"request_ids"`
	}
	dec := msgpack.NewDecoder(bytes.NewReader(b))
	if err := dec.Decode(&raw); err != nil {
		return Request{}, fmt.Errorf("%w: %v", ErrBadRequest, err)
	}
	if dec.Buffered().(*bytes.Reader).Len() > 0 {
		return Request{}, fmt.Errorf("%w: trailing bytes after the message", ErrBadRequest)
	}
	r := Request{Op: raw.Op, RequestIDs: raw.RequestIDs}
	if len(r.RequestIDs) > MaxRequests {
		return Request{}, fmt.Errorf("%w: %d request_ids, max %d", ErrBadRequest, len(r.RequestIDs), MaxRequests)
	}
	switch raw.Op {
	case "load":
		if err := decodeList(raw.Requests, &r.Load); err != nil {
			return Request{}, err
		}
	case "send":
		if err := decodeList(raw.Requests, &r.Send); err != nil {
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

func decodeList[T any](b msgpack.RawMessage, out *[]T) error {
	if len(b) == 0 {
		return fmt.Errorf("%w: requests missing", ErrBadRequest)
	}
	if err := msgpack.Unmarshal(b, out); err != nil {
		return fmt.Errorf("%w: requests: %v", ErrBadRequest, err)
	}
	if len(*out) > MaxRequests {
		return fmt.Errorf("%w: %d requests, max %d", ErrBadRequest, len(*out), MaxRequests)
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

// Dispatch runs one message against b.
func Dispatch(ctx context.Context, b Backend, payload []byte) Reply {
	req, err := Decode(payload)
	if err != nil {
		return Reply{Error: err.Error()}
	}
	switch req.Op {
	case "load":
		if b.Load == nil {
			return Reply{Error: fmt.Sprintf("op load: not supported by a %s worker", b.Role)}
		}
		ctx, cancel := context.WithTimeout(ctx, LoadTimeout)
		defer cancel()
		return Reply{OK: true, Errors: errStrings(b.Load(ctx, req.Load))}
	case "send":
		if b.Send == nil {
			return Reply{Error: fmt.Sprintf("op send: not supported by a %s worker", b.Role)}
		}
		return Reply{OK: true, Errors: errStrings(b.Send(req.Send))}
	case "abort":
		n := b.Abort(req.RequestIDs)
		return Reply{OK: true, Aborted: &n}
	case "finished":
		ds, dr, f := b.Finished()
		return Reply{OK: true, DoneSending: nonNil(ds), DoneRecving: nonNil(dr), FailedRecving: nonNilF(f)}
	case "status":
		return Reply{OK: true, Role: b.Role, Status: b.Status()}
	}
	return Reply{Error: "unreachable"}
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

// Serve binds the control socket at endpoint on zctx.
func Serve(ctx context.Context, zctx *sidechannel.Context, endpoint string, b Backend) (*sidechannel.Server, error) {
	srv, err := sidechannel.NewRouter(zctx, sidechannel.ServerOptions{Addr: endpoint, MaxMessageBytes: 64 << 20},
		func(p []byte) []byte { return Encode(Dispatch(ctx, b, p)) })
	if err != nil {
		return nil, fmt.Errorf("control socket %s: %w", endpoint, err)
	}
	return srv, nil
}
