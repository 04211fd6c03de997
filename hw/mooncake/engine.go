package mooncake

import (
	"context"
	"errors"
	"fmt"
	"math"
	"strings"
	"unsafe"
)

// Op is one transfer of a batch: Length bytes between the local virtual
// address Local and the remote virtual address Remote (an address the peer
// registered).
type Op struct{ Local, Remote, Length uint64 }

// Stride lays a READ's bytes out in local memory as rows: byte i of an op
// lands at Local + (i/Row)*Pitch + i%Row. Row > 0, Pitch >= Row, and every
// op's Length is a whole number of rows. It fuses a layout change into the
// copy the transfer makes anyway (kvflow's decode side uses it for the
// head transpose between TP sizes, see stages/plan.Reads.Interleave).
type Stride struct{ Row, Pitch uint64 }

// Extent is the local bytes an op of length n spans under s.
func (s Stride) Extent(n uint64) uint64 {
	if n == 0 {
		return 0
	}
	return (n/s.Row-1)*s.Pitch + s.Row
}

// Validate checks s against ops: whole rows, and every op's extent
// representable (no wrap-around: the extent is what gets pinned and
// checked against the registered regions).
func (s Stride) Validate(ops []Op) error {
	if s.Row == 0 || s.Pitch < s.Row || s.Pitch > math.MaxInt32 {
		return fmt.Errorf("mooncake: stride of %d-byte rows %d bytes apart: want 0 < row <= pitch <= 2^31-1", s.Row, s.Pitch)
	}
	for i, op := range ops {
		if op.Length%s.Row != 0 {
			return fmt.Errorf("mooncake: op %d: %d bytes are not whole %d-byte rows", i, op.Length, s.Row)
		}
		if rows := op.Length / s.Row; rows > 0 && (rows-1) > (math.MaxInt64-s.Row)/s.Pitch {
			return fmt.Errorf("mooncake: op %d: %d rows %d bytes apart overflow the address space", i, rows, s.Pitch)
		}
	}
	return nil
}

// StridedReader is an Engine that can scatter READs over strided local
// rows. The TCP engine is one; Mooncake's C API has no such transfer, so
// the cgo engine is not.
type StridedReader interface {
	Engine
	// BatchReadStrided is BatchRead with every op's local bytes laid out
	// by s (s.Validate(ops) must hold).
	BatchReadStrided(ctx context.Context, session string, ops []Op, s Stride) error
}

// GatherReader is an Engine that can read each op's bytes from strided
// remote rows into contiguous local memory: a decode rank whose TP is
// above the prefill's reads one head slice of every token row of a
// prefill block. The TCP engine is one (kvflow's strided READ with peers
// that negotiated it, a READ per row with others); Mooncake's C API has no
// such transfer.
type GatherReader interface {
	Engine
	// BatchReadGather is BatchRead with every op's Length bytes taken
	// from rows of g.Row bytes, g.Pitch apart, from its Remote: byte i
	// of the op comes from Remote + (i/g.Row)*g.Pitch + i%g.Row and lands
	// at Local + i (g.Validate(ops) must hold).
	BatchReadGather(ctx context.Context, session string, ops []Op, g Stride) error
}

// LedgerReader is an Engine that reports, per op, the bytes that landed in
// local memory (Mooncake's transferred_bytes): the cgo engine. A caller
// reconciles them with what it posted (stages/read does), so a transfer
// reported complete but short is caught. The TCP engine's batches are
// all-or-nothing and it is not one.
type LedgerReader interface {
	Engine
	// BatchReadLedger is BatchRead that also sets landed[i] to the bytes
	// of ops[i] that landed; len(landed) == len(ops).
	BatchReadLedger(ctx context.Context, session string, ops []Op, landed []uint64) error
}

// Granter is an Engine that serves peers only the ranges granted to them
// (the TCP engine with TCPConfig.ReadGrants): a prefill worker grants a
// request's blocks from its engine's send until its DONEs.
type Granter interface {
	Engine
	// Grant makes the ranges readable; each Grant needs its own revoke.
	Grant(ranges ...Range) error
	// RevokeAsync drops one grant of each range at once; the channel is
	// closed once no read of the bytes it ungranted is in flight.
	RevokeAsync(ranges ...Range) (<-chan struct{}, error)
	// GrantAll makes every registered range readable until RevokeAll.
	GrantAll()
	RevokeAll() error
}

// PeerAuthenticator is an Engine with kvflow's data-plane authentication
// (doc.go): it issues credentials to the clients its side channel admits,
// and presents the ones it was given to the peers that issued them.
type PeerAuthenticator interface {
	Engine
	// AuthToken is the credential of a client's CURVE public key; nil when
	// the engine requires no authentication.
	AuthToken(key []byte) *[AuthTokenSize]byte
	// SetPeerCredential sets (nil: clears) the credential presented to
	// session.
	SetPeerCredential(session string, cred *Credential) error
}

// SegmentReader is an Engine that can list a peer's registered buffers from
// the segment descriptor of its handshake (the TCP engine): a decode worker
// checks a peer whose side channel sends no cache fingerprint against it.
type SegmentReader interface {
	Engine
	// PeerBuffers returns the buffers session's segment descriptor lists,
	// handshaking first when the session is new or stale. The slice is
	// shared: do not modify it.
	PeerBuffers(ctx context.Context, session string) ([]BufferDesc, error)
}

// Engine is a transfer engine with Mooncake's semantics. Implementations
// are safe for concurrent use.
type Engine interface {
	// Register makes [addr, addr+length) usable as local memory of a batch
	// and, for peers, readable and writable. Regions may not overlap.
	Register(addr, length uint64, name string) error
	// Unregister removes the region starting at addr, waiting for transfers
	// that are using it to finish.
	Unregister(addr uint64) error
	// Slice returns registered memory as a []byte, checking that the range
	// lies inside one registered region.
	Slice(addr, length uint64) ([]byte, error)
	// BatchRead copies every op's remote range of the peer session
	// ("host:rpc_port") into its local range. It returns nil only when
	// every op succeeded; otherwise a *BatchError with one error per op.
	// It never returns while the engine still touches the local memory.
	BatchRead(ctx context.Context, session string, ops []Op) error
	// BatchWrite is BatchRead in the other direction.
	BatchWrite(ctx context.Context, session string, ops []Op) error
	// RPCPort is the port of the handshake (RPC) listener.
	RPCPort() int
	// SessionID is "host:rpc_port", the name peers use for this engine.
	SessionID() string
	// Close stops serving, fails batches in flight and waits for every
	// goroutine the engine started.
	Close() error
}

// Sentinel errors, checked with errors.Is.
var (
	ErrClosed        = errors.New("mooncake: engine closed")
	ErrNotRegistered = errors.New("mooncake: range not inside a registered region")
	ErrOverlap       = errors.New("mooncake: region overlaps a registered region")
	ErrZeroLength    = errors.New("mooncake: zero length")
	ErrRange         = errors.New("mooncake: address range wraps around")
	ErrRejected      = errors.New("mooncake: request rejected by peer")
	ErrPeerClosed    = errors.New("mooncake: peer closed the connection")
	ErrNotAttempted  = errors.New("mooncake: op not attempted (batch failed)")
	ErrSession       = errors.New("mooncake: bad session id")
)

// BatchError reports a failed batch: Errs has one entry per op of the
// batch, nil for ops that completed.
type BatchError struct {
	Session string
	Dir     string // "read" or "write"
	Ops     []Op
	Errs    []error
}

// Failed counts the ops that did not complete.
func (e *BatchError) Failed() int {
	n := 0
	for _, err := range e.Errs {
		if err != nil {
			n++
		}
	}
	return n
}

func (e *BatchError) Error() string {
	var b strings.Builder
	fmt.Fprintf(&b, "mooncake: batch %s %s: %d of %d ops failed", e.Dir, e.Session, e.Failed(), len(e.Errs))
	for i, err := range e.Errs {
		if err != nil && !errors.Is(err, ErrNotAttempted) {
			op := e.Ops[i]
			fmt.Fprintf(&b, "; first: op %d (local %#x remote %#x length %d): %v", i, op.Local, op.Remote, op.Length, err)
			break
		}
	}
	return b.String()
}

// Unwrap exposes the distinct op errors to errors.Is and errors.As.
func (e *BatchError) Unwrap() []error {
	var out []error
	seen := map[error]bool{}
	for _, err := range e.Errs {
		if err != nil && !seen[err] {
			seen[err] = true
			out = append(out, err)
		}
	}
	return out
}

// AddrOf is the virtual address of b's first byte (0 for an empty slice).
// The memory must not move or be freed while registered: use mmap'd or
// C-allocated memory, or Go heap memory the caller keeps referenced.
func AddrOf(b []byte) uint64 {
	if len(b) == 0 {
		return 0
	}
	return uint64(uintptr(unsafe.Pointer(unsafe.SliceData(b))))
}

// bytesAt turns a registered address into a slice. The address must have
// been checked against the region table and the region pinned. It copies
// the integer into an unsafe.Pointer by reinterpretation, the one place
// the package turns an integer into a pointer.
func bytesAt(addr, length uint64) []byte {
	a := uintptr(addr)
	p := *(*unsafe.Pointer)(unsafe.Pointer(&a))
	return unsafe.Slice((*byte)(p), int(length))
}
