package leasefake

import (
	"context"
	"slices"
	"sync"
	"time"
)

// Call is one RENEW a Renewer was asked to send.
type Call struct {
	At       time.Time // when it was sent (the caller's clock: synctest's in a bubble)
	Endpoint string
	IDs      []string
}

// Renewer is a lease.Renewer that records every call, safe for concurrent
// use. A call to an endpoint in Block waits for its context and returns its
// error (a peer that never answers); any other returns the error set by
// SetErr (nil: acknowledged).
type Renewer struct {
	Block map[string]bool // endpoint → calls wait for their context; set before use

	mu    sync.Mutex
	err   error
	calls []Call
}

// Renew records the call, then blocks or returns the set error.
func (f *Renewer) Renew(ctx context.Context, endpoint string, ids []string) error {
	f.mu.Lock()
	f.calls = append(f.calls, Call{time.Now(), endpoint, slices.Clone(ids)})
	block, err := f.Block[endpoint], f.err
	f.mu.Unlock()
	if block {
		<-ctx.Done()
		return ctx.Err()
	}
	return err
}

// SetErr makes every later call not blocked fail with err (the side
// channel is gone); nil acknowledges them again.
func (f *Renewer) SetErr(err error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.err = err
}

// Calls is every call so far, in the order made.
func (f *Renewer) Calls() []Call {
	f.mu.Lock()
	defer f.mu.Unlock()
	return slices.Clone(f.calls)
}

// To is the calls to endpoint, in the order made.
func (f *Renewer) To(endpoint string) []Call {
	var out []Call
	for _, c := range f.Calls() {
		if c.Endpoint == endpoint {
			out = append(out, c)
		}
	}
	return out
}

// Carried reports whether a call carried request id.
func (f *Renewer) Carried(id string) bool {
	return slices.ContainsFunc(f.Calls(), func(c Call) bool { return slices.Contains(c.IDs, id) })
}
