package job

import (
	"errors"
)

// Hops of a job at a remote rank (PeerError.Hop): the stages that talk to
// a prefill rank's side channel or transfer engine.
const (
	HopHandshake = "handshake"
	HopRead      = "read"
	HopNotify    = "notify"
)

// Causes a stage may find in a hop's error (errors.Is) to tell how the
// rank failed; the adapter of the side channel (the handshake's Fetcher)
// marks its errors with them.
var (
	// ErrRefused: the rank's side-channel port refused the connection:
	// nothing listens there, so nothing there holds the request's blocks
	// or will answer a retry.
	ErrRefused = errors.New("job: connection refused by the peer's side channel")
	// ErrNoReply: the rank's side channel accepted (or may have) but gave
	// no reply to any attempt.
	ErrNoReply = errors.New("job: no reply from the peer's side channel")
)

// Mark returns err marked with cause (errors.Is(Mark(err, c), c)), its
// message unchanged: e.g. a side channel's timeout marked ErrNoReply.
func Mark(err, cause error) error {
	if err == nil || errors.Is(err, cause) {
		return err
	}
	return marked{err: err, cause: cause}
}

type marked struct{ err, cause error }

func (m marked) Error() string   { return m.err.Error() }
func (m marked) Unwrap() []error { return []error{m.err, m.cause} }

// PeerError is a job's failure at one remote rank: the hop that failed and
// the rank's side-channel endpoint ("host:handshake_port", the key of peer
// health). A stage wraps the error of the task whose hop failed in it, so
// that the failure is blamed on that rank only, not on every rank the job
// reads from (Blame). Its message is the wrapped error's.
type PeerError struct {
	Hop      string // HopHandshake, HopRead or HopNotify
	Endpoint string
	Err      error
}

func (e *PeerError) Error() string { return e.Err.Error() }
func (e *PeerError) Unwrap() error { return e.Err }

// AtPeer wraps err, the failure of hop at the rank at endpoint, in a
// *PeerError (nil stays nil; an error already blamed on that hop and
// endpoint is returned as it is).
func AtPeer(hop, endpoint string, err error) error {
	if err == nil {
		return nil
	}
	var pe *PeerError
	if errors.As(err, &pe) && pe.Hop == hop && pe.Endpoint == endpoint {
		return err
	}
	return &PeerError{Hop: hop, Endpoint: endpoint, Err: err}
}

// Blame is every *PeerError in err's tree (%w chains and errors.Join), in
// depth-first order, each (hop, endpoint) once. An error with none blames
// no rank: it is the job's or this worker's own (an abort, a shutdown, a
// plan that could not be made, a lease lost here).
func Blame(err error) []*PeerError {
	var out []*PeerError
	var walk func(error)
	walk = func(e error) {
		if e == nil {
			return
		}
		if pe, ok := e.(*PeerError); ok {
			dup := false
			for _, o := range out {
				if o.Hop == pe.Hop && o.Endpoint == pe.Endpoint {
					dup = true
				}
			}
			if !dup {
				out = append(out, pe)
			}
		}
		switch u := e.(type) {
		case interface{ Unwrap() error }:
			walk(u.Unwrap())
		case interface{ Unwrap() []error }:
			for _, x := range u.Unwrap() {
				walk(x)
			}
		}
	}
	walk(err)
	return out
}
