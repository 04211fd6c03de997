// Package fakes is recording fakes of the stage interfaces that tests wrap
// or drive: the read stage's Transfer and the notify stage's Sender and
// BatchSender. They move no bytes and send nothing; they record each call,
// safe for concurrent use, and hold their callers to the interfaces'
// contracts (a batch asks only for what Capabilities offers).
//
// # Never
//
// Product code never imports it (internal/tooling's rule).
package fakes

import (
	"cmp"
	"context"
	"errors"
	"slices"
	"sync"

	"github.com/kvflow/kvflow/stages/plan"
	"github.com/kvflow/kvflow/stages/read"
)

// Read is one BatchRead call as a Transfer saw it.
type Read struct {
	Session string
	Ops     []plan.Op // the batch's ops, expanded (Batch.AppendTo)
	Compact bool      // the batch came as compact reads (Batch.Reads)
	// Row and Pitch are the batch's local stride (0: none).
	Row, Pitch uint64
}

// Transfer is a read.Transfer that records every batch and returns Err.
// Without a ledger it fails a batch that asks for one (Batch.Landed), and
// unless Strided it fails a strided batch: a caller must not ask what
// Capabilities does not offer.
type Transfer struct {
	Err     error // returned by every BatchRead that is recorded
	Strided bool  // Capabilities().LocalStride

	mu    sync.Mutex
	reads []Read
}

// BatchRead records b and returns f.Err.
func (f *Transfer) BatchRead(_ context.Context, session string, b *read.Batch) error {
	if b.Landed != nil {
		return errors.New("fakes: ledger asked of a transfer without one")
	}
	if b.Row > 0 && !f.Strided {
		return errors.New("fakes: strided read asked of a transfer without LocalStride")
	}
	r := Read{Session: session, Ops: b.AppendTo(nil), Compact: b.Reads != nil, Row: b.Row, Pitch: b.Pitch}
	f.mu.Lock()
	defer f.mu.Unlock()
	f.reads = append(f.reads, r)
	return f.Err
}

// Capabilities offers LocalStride when f.Strided, nothing else.
func (f *Transfer) Capabilities() read.Capabilities {
	return read.Capabilities{LocalStride: f.Strided}
}

// Reads is every call so far, in order.
func (f *Transfer) Reads() []Read {
	f.mu.Lock()
	defer f.mu.Unlock()
	return slices.Clone(f.reads)
}

// Ops is every call's op list, in order.
func (f *Transfer) Ops() [][]plan.Op {
	f.mu.Lock()
	defer f.mu.Unlock()
	out := make([][]plan.Op, len(f.reads))
	for i, r := range f.reads {
		out[i] = r.Ops
	}
	return out
}

// ErrNoAck is what a Sender returns for an endpoint in its Fail set.
var ErrNoAck = errors.New("no ACK")

// Done is one DONE a Sender was asked to send.
type Done struct {
	Endpoint, ID string
	Batched      bool // through SendDoneBatched
}

// Sender is a notify.Sender (SendDone only) that records every DONE and
// fails those to an endpoint in Fail with ErrNoAck.
type Sender struct {
	Fail map[string]bool // endpoint → no ACK

	mu    sync.Mutex
	dones []Done
}

func (s *Sender) record(d Done) error {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.dones = append(s.dones, d)
	if s.Fail[d.Endpoint] {
		return ErrNoAck
	}
	return nil
}

// SendDone records a plain DONE.
func (s *Sender) SendDone(_ context.Context, endpoint, id string) error {
	return s.record(Done{Endpoint: endpoint, ID: id})
}

// Dones is every DONE so far, in the order sent.
func (s *Sender) Dones() []Done {
	s.mu.Lock()
	defer s.mu.Unlock()
	return slices.Clone(s.dones)
}

// ByEndpoint is Dones sorted by endpoint (stable: one endpoint's DONEs stay
// in the order sent).
func (s *Sender) ByEndpoint() []Done {
	out := s.Dones()
	slices.SortStableFunc(out, func(a, b Done) int { return cmp.Compare(a.Endpoint, b.Endpoint) })
	return out
}

// BatchSender is a Sender that also has the batched path
// (notify.BatchSender), recorded with Batched set.
type BatchSender struct{ Sender }

// SendDoneBatched records a batched DONE.
func (s *BatchSender) SendDoneBatched(_ context.Context, endpoint, id string) error {
	return s.record(Done{Endpoint: endpoint, ID: id, Batched: true})
}
