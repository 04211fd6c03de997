package mooncake

import (
	"time"

	"github.com/prometheus/client_golang/prometheus"
)

// What an Engine implemented outside this package shares with the TCP
// engine: the registered-memory table (so Register, Unregister and the
// local-range checks of a batch behave the same in every backend), the
// transfer metrics (one set of kvflow_transfer_* series per process,
// whatever the backend) and the session-id syntax. The cgo binding
// (hw/mooncake/mooncakec) is built on these; it lives in its own package
// because Go refuses a package that has both cgo and Go assembly.

// Directions of a batch, as BatchError.Dir and the metrics name them.
const (
	DirRead  = dirRead
	DirWrite = dirWrite
)

// Regions is a table of registered, non-overlapping memory regions. The
// zero value is empty and ready; it is safe for concurrent use.
type Regions struct{ t regionTable }

// Add registers [addr, addr+length) under name, refusing zero-length,
// wrapping, overlapping and duplicate ranges (ErrZeroLength, ErrRange,
// ErrOverlap).
func (r *Regions) Add(addr, length uint64, name string) error { return r.t.add(addr, length, name) }

// Remove takes the region starting at addr out of the table: new pins of
// it fail at once. wait blocks until every pin taken before has been
// released.
func (r *Regions) Remove(addr uint64) (wait func(), err error) {
	reg, err := r.t.remove(addr)
	if err != nil {
		return nil, err
	}
	return func() { <-reg.drained }, nil
}

// Pin checks that [addr, addr+length) lies inside one registered region
// and keeps that region from being removed until unpin is called (once).
func (r *Regions) Pin(addr, length uint64) (unpin func(), err error) {
	reg, err := r.t.pin(addr, length)
	if err != nil {
		return nil, err
	}
	return reg.unpin, nil
}

// Slice returns registered memory as a []byte (ErrNotRegistered when the
// range is not inside one region).
func (r *Regions) Slice(addr, length uint64) ([]byte, error) { return r.t.slice(addr, length) }

// TransferMetrics are the kvflow_transfer_* series of an initiating
// engine: batch durations by direction and outcome, bytes and ops moved.
type TransferMetrics struct{ m *metrics }

// NewTransferMetrics registers the transfer metrics on reg (nil: not
// registered); engines in one process share the series.
func NewTransferMetrics(reg prometheus.Registerer) *TransferMetrics {
	return &TransferMetrics{m: newMetrics(reg)}
}

// Batch records one BatchRead/BatchWrite call of direction dir (DirRead
// or DirWrite) that took d and ended with err.
func (t *TransferMetrics) Batch(dir string, d time.Duration, err error) {
	outcome := "ok"
	if err != nil {
		outcome = "error"
	}
	t.m.batch.WithLabelValues(dir, outcome).Observe(d.Seconds())
}

// Completed records one op of n bytes completed in direction dir.
func (t *TransferMetrics) Completed(dir string, n uint64) {
	bytes, ops := t.m.readBytes, t.m.readOps
	if dir == DirWrite {
		bytes, ops = t.m.writeBytes, t.m.writeOps
	}
	bytes.Add(float64(n))
	ops.Inc()
}

// ParseSession splits a session id "host:port" (ErrSession when it is not
// one).
func ParseSession(session string) (host string, port int, err error) { return parseSession(session) }
