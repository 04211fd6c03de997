//go:build mooncake && cgo

package mooncakec

// The binding itself; see doc.go. Built only with -tags mooncake (and
// cgo); hw/mooncake/README.md gives the CGO_CFLAGS/CGO_LDFLAGS of a real
// build, testdata/include the stub header CI compiles it against.

/*
#cgo LDFLAGS: -ltransfer_engine -lstdc++ -lm
#include <stdlib.h>
#include "transfer_engine_c.h"
*/
import "C"

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"strconv"
	"sync"
	"time"
	"unsafe"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/kvflow/kvflow/hw/mooncake"
)

// CgoConfig configures the cgo engine.
type CgoConfig struct {
	// Metadata is the metadata connection string; "P2PHANDSHAKE" (the
	// default) exchanges descriptors peer to peer on the RPC port, as the
	// seed's connector does.
	Metadata string
	// Host is the address peers reach this engine at; RPCPort the handshake
	// port (0: Mooncake picks one).
	Host    string
	RPCPort int
	// Protocol is the transport to install: "rdma", "tcp", "ascend", ...
	Protocol string
	// NICPriorityMatrix is installTransport's argument for "rdma" (a JSON
	// topology matrix); "" lets Mooncake discover the topology.
	NICPriorityMatrix string
	// Location tags registered memory ("cpu:0", "cuda:0", "npu:0").
	Location string
	// LocalOnly registers memory without remote access: with Mooncake's
	// rdma transport peers can then neither read nor write it (no remote
	// rights on the memory region); its tcp transport ignores the flag and
	// serves every registered byte. A kvflow decode worker sets it.
	LocalOnly bool
	// PollMin and PollMax bound the sleep between completion checks: it
	// starts at PollMin and doubles to PollMax, so waiting never spins.
	PollMin, PollMax time.Duration
}

// DefaultCgoConfig returns the defaults.
func DefaultCgoConfig() CgoConfig {
	return CgoConfig{
		Metadata: "P2PHANDSHAKE",
		Host:     "127.0.0.1",
		Protocol: "rdma",
		Location: "cpu:0",
		// A 256 KiB RDMA read completes in ~20 µs: check that soon, then
		// back off to 1 ms so a long batch costs ~1000 wake-ups a second.
		PollMin: 20 * time.Microsecond,
		PollMax: time.Millisecond,
	}
}

// CgoEngine implements Engine over Mooncake's C API.
type CgoEngine struct {
	cfg     CgoConfig
	log     *slog.Logger
	m       *mooncake.TransferMetrics
	eng     C.transfer_engine_t
	regions mooncake.Regions
	session string
	rpcPort int

	mu       sync.Mutex
	closed   bool
	segments map[string]*segment
	inflight sync.WaitGroup
}

// segment is the handle of one peer's segment. A batch with a failed op
// marks it stale: the peer may have restarted (on the same RPC port, so
// under the same name) with other buffers and another data port, which
// Mooncake's cached descriptor does not know; the next batch re-fetches
// the descriptor (openSegmentNoCache) before it submits.
type segment struct {
	mu     sync.Mutex // held while opening; guards the fields
	id     C.int32_t
	opened bool
	stale  bool
}

var _ mooncake.LedgerReader = (*CgoEngine)(nil)

// ErrMooncake wraps a failing Mooncake C call.
var ErrMooncake = errors.New("mooncake: transfer engine call failed")

// NewCgoEngine creates a Mooncake transfer engine and installs the
// configured transport.
func NewCgoEngine(cfg CgoConfig, reg prometheus.Registerer, log *slog.Logger) (*CgoEngine, error) {
	if log == nil {
		log = slog.New(slog.DiscardHandler)
	}
	if cfg.PollMin <= 0 || cfg.PollMax < cfg.PollMin {
		return nil, fmt.Errorf("mooncake config: poll interval %v..%v", cfg.PollMin, cfg.PollMax)
	}
	meta := C.CString(cfg.Metadata)
	defer C.free(unsafe.Pointer(meta))
	name := C.CString(cfg.Host) // in P2P mode Mooncake appends the port
	defer C.free(unsafe.Pointer(name))
	host := C.CString(cfg.Host)
	defer C.free(unsafe.Pointer(host))
	eng := C.createTransferEngine(meta, name, host, C.uint64_t(cfg.RPCPort), 0)
	if eng == nil {
		return nil, fmt.Errorf("%w: createTransferEngine(%q, %q, %d)", ErrMooncake, cfg.Metadata, cfg.Host, cfg.RPCPort)
	}
	e := &CgoEngine{cfg: cfg, m: mooncake.NewTransferMetrics(reg), eng: eng, segments: map[string]*segment{}}

	proto := C.CString(cfg.Protocol)
	defer C.free(unsafe.Pointer(proto))
	var args [2]unsafe.Pointer
	if cfg.NICPriorityMatrix != "" {
		m := C.CString(cfg.NICPriorityMatrix)
		defer C.free(unsafe.Pointer(m))
		args[0] = unsafe.Pointer(m)
	}
	// args lives on the Go stack and holds only C pointers: allowed.
	if C.installTransport(eng, proto, &args[0]) == nil {
		C.destroyTransferEngine(eng)
		return nil, fmt.Errorf("%w: installTransport(%q)", ErrMooncake, cfg.Protocol)
	}

	var buf [256]C.char
	if C.getLocalIpAndPort(eng, &buf[0], C.size_t(len(buf))) != 0 {
		C.destroyTransferEngine(eng)
		return nil, fmt.Errorf("%w: getLocalIpAndPort", ErrMooncake)
	}
	e.session = C.GoString(&buf[0])
	if _, port, err := mooncake.ParseSession(e.session); err == nil {
		e.rpcPort = port
	} else {
		e.rpcPort = cfg.RPCPort
		e.session = cfg.Host + ":" + strconv.Itoa(cfg.RPCPort)
	}
	e.log = log.With("component", "hw/mooncake", "backend", "cgo", "session", e.session)
	e.log.Info("mooncake transfer engine ready", "protocol", cfg.Protocol)
	return e, nil
}

func (e *CgoEngine) RPCPort() int      { return e.rpcPort }
func (e *CgoEngine) SessionID() string { return e.session }

// Register registers memory with Mooncake (remote accessible unless
// CgoConfig.LocalOnly). The memory must not be Go-managed: Mooncake keeps
// the pointer.
func (e *CgoEngine) Register(addr, length uint64, name string) error {
	if err := e.regions.Add(addr, length, name); err != nil {
		return err
	}
	loc := C.CString(e.cfg.Location)
	defer C.free(unsafe.Pointer(loc))
	remote := C.int(1)
	if e.cfg.LocalOnly {
		remote = 0
	}
	if rc := C.registerLocalMemory(e.eng, cptr(addr), C.size_t(length), loc, remote); rc != 0 {
		if wait, err := e.regions.Remove(addr); err == nil {
			wait()
		}
		return fmt.Errorf("%w: registerLocalMemory(%#x, %d) = %d", ErrMooncake, addr, length, int(rc))
	}
	return nil
}

// Unregister waits for transfers using the region, then unregisters it.
func (e *CgoEngine) Unregister(addr uint64) error {
	wait, err := e.regions.Remove(addr)
	if err != nil {
		return err
	}
	wait()
	if rc := C.unregisterLocalMemory(e.eng, cptr(addr)); rc != 0 {
		return fmt.Errorf("%w: unregisterLocalMemory(%#x) = %d", ErrMooncake, addr, int(rc))
	}
	return nil
}

func (e *CgoEngine) Slice(addr, length uint64) ([]byte, error) { return e.regions.Slice(addr, length) }

// BatchReadLedger implements mooncake.LedgerReader: landed[i] is the
// transferred_bytes Mooncake reports for op i once it completed (0 for an
// op that did not).
func (e *CgoEngine) BatchReadLedger(ctx context.Context, session string, ops []mooncake.Op, landed []uint64) error {
	if len(landed) != len(ops) {
		return fmt.Errorf("mooncakec: %d ledger entries for %d ops", len(landed), len(ops))
	}
	clear(landed)
	return e.batch(ctx, session, ops, C.OPCODE_READ, landed)
}

func (e *CgoEngine) BatchRead(ctx context.Context, session string, ops []mooncake.Op) error {
	return e.batch(ctx, session, ops, C.OPCODE_READ, nil)
}

func (e *CgoEngine) BatchWrite(ctx context.Context, session string, ops []mooncake.Op) error {
	return e.batch(ctx, session, ops, C.OPCODE_WRITE, nil)
}

// segment returns session's segment id, opening it on first use and
// re-fetching its descriptor when a failed batch marked it stale. Only
// the batches to session wait for its handshake.
func (e *CgoEngine) segment(session string) (C.int32_t, error) {
	e.mu.Lock()
	sg, ok := e.segments[session]
	if !ok {
		sg = &segment{}
		e.segments[session] = sg
	}
	e.mu.Unlock()
	sg.mu.Lock()
	defer sg.mu.Unlock()
	if sg.opened && !sg.stale {
		return sg.id, nil
	}
	cs := C.CString(session)
	defer C.free(unsafe.Pointer(cs))
	var id C.int32_t
	if sg.opened {
		id = C.openSegmentNoCache(e.eng, cs)
	} else {
		id = C.openSegment(e.eng, cs)
	}
	if id < 0 {
		return 0, fmt.Errorf("%w: openSegment(%q) = %d", ErrMooncake, session, int(id))
	}
	if sg.opened {
		e.log.Info("mooncake segment re-fetched after a failed batch", "peer", session)
	}
	sg.id, sg.opened, sg.stale = id, true, false
	return id, nil
}

// markStale makes the next batch to session re-fetch its descriptor.
func (e *CgoEngine) markStale(session string) {
	e.mu.Lock()
	sg := e.segments[session]
	e.mu.Unlock()
	if sg != nil {
		sg.mu.Lock()
		sg.stale = sg.opened
		sg.mu.Unlock()
	}
}

// batch runs ops; landed, when not nil, gets each completed op's
// transferred_bytes.
func (e *CgoEngine) batch(ctx context.Context, session string, ops []mooncake.Op, opcode C.int, landed []uint64) (err error) {
	dir := mooncake.DirRead
	if opcode == C.OPCODE_WRITE {
		dir = mooncake.DirWrite
	}
	start := time.Now()
	defer func() { e.m.Batch(dir, time.Since(start), err) }()
	if len(ops) == 0 {
		return nil
	}
	errs := make([]error, len(ops))
	fail := func(err error) error {
		for i := range errs {
			if errs[i] == nil {
				errs[i] = err
			}
		}
		return &mooncake.BatchError{Session: session, Dir: dir, Ops: ops, Errs: errs}
	}

	e.mu.Lock()
	if e.closed {
		e.mu.Unlock()
		return fail(mooncake.ErrClosed)
	}
	e.inflight.Add(1)
	e.mu.Unlock()
	defer e.inflight.Done()

	var unpins []func()
	defer func() {
		for _, unpin := range unpins {
			unpin()
		}
	}()
	bad := false
	for i, op := range ops {
		unpin, err := e.regions.Pin(op.Local, op.Length)
		if err != nil {
			errs[i], bad = fmt.Errorf("local: %w", err), true
			continue
		}
		unpins = append(unpins, unpin)
	}
	if bad {
		return fail(mooncake.ErrNotAttempted)
	}
	if err := ctx.Err(); err != nil {
		return fail(err)
	}
	seg, err := e.segment(session)
	if err != nil {
		return fail(err)
	}

	bid := C.allocateBatchID(e.eng, C.size_t(len(ops)))
	if bid == C.uint64_t(^uint64(0)) {
		return fail(fmt.Errorf("%w: allocateBatchID(%d)", ErrMooncake, len(ops)))
	}
	defer C.freeBatchID(e.eng, bid)

	// The request array lives in C memory; its pointers are to registered
	// (non-Go) memory.
	reqs := (*[1 << 28]C.transfer_request_t)(C.calloc(C.size_t(len(ops)), C.size_t(unsafe.Sizeof(C.transfer_request_t{}))))[:len(ops):len(ops)]
	defer C.free(unsafe.Pointer(&reqs[0]))
	for i, op := range ops {
		reqs[i] = C.transfer_request_t{
			opcode:        opcode,
			source:        cptr(op.Local),
			target_id:     seg,
			target_offset: C.uint64_t(op.Remote),
			length:        C.uint64_t(op.Length),
		}
	}
	if rc := C.submitTransfer(e.eng, bid, &reqs[0], C.size_t(len(ops))); rc != 0 {
		return fail(fmt.Errorf("%w: submitTransfer = %d", ErrMooncake, int(rc)))
	}

	// Wait for every task to reach a final state, sleeping between checks
	// with exponential backoff. Mooncake cannot cancel submitted tasks, so
	// a cancelled context is recorded but the wait goes on: returning
	// earlier would let the caller reuse memory Mooncake still writes.
	// Mooncake's own transport timeouts bound the wait.
	done := make([]bool, len(ops))
	left := len(ops)
	failed := false
	defer func() {
		if failed {
			e.markStale(session)
		}
	}()
	sleep := e.cfg.PollMin
	timer := time.NewTimer(0)
	defer timer.Stop()
	<-timer.C
	for left > 0 {
		for i := range ops {
			if done[i] {
				continue
			}
			var st C.transfer_status_t
			if rc := C.getTransferStatus(e.eng, bid, C.size_t(i), &st); rc != 0 {
				errs[i], done[i] = fmt.Errorf("%w: getTransferStatus = %d", ErrMooncake, int(rc)), true
				left--
				continue
			}
			switch st.status {
			case C.STATUS_COMPLETED:
				done[i] = true
				left--
				e.m.Completed(dir, ops[i].Length)
				if landed != nil {
					landed[i] = uint64(st.transferred_bytes)
				}
			case C.STATUS_FAILED, C.STATUS_CANCELED, C.STATUS_INVALID, C.STATUS_TIMEOUT:
				errs[i], done[i] = fmt.Errorf("mooncake: %s: transfer status %d", session, int(st.status)), true
				left--
				failed = true
			}
		}
		if left == 0 {
			break
		}
		timer.Reset(sleep)
		select {
		case <-timer.C:
		case <-ctx.Done():
			<-timer.C // keep waiting: see above
		}
		sleep = min(2*sleep, e.cfg.PollMax)
	}
	if ctx.Err() != nil {
		for i := range errs {
			if errs[i] == nil && !done[i] {
				errs[i] = ctx.Err()
			}
		}
	}
	for _, err := range errs {
		if err != nil {
			return &mooncake.BatchError{Session: session, Dir: dir, Ops: ops, Errs: errs}
		}
	}
	return nil
}

// Close waits for batches in flight, closes segments and destroys the
// engine.
func (e *CgoEngine) Close() error {
	e.mu.Lock()
	if e.closed {
		e.mu.Unlock()
		return nil
	}
	e.closed = true
	e.mu.Unlock()
	e.inflight.Wait()
	for _, sg := range e.segments {
		if sg.opened {
			C.closeSegment(e.eng, sg.id)
		}
	}
	C.destroyTransferEngine(e.eng)
	return nil
}

// cptr converts a registered address for C.
func cptr(addr uint64) unsafe.Pointer {
	a := uintptr(addr)
	return *(*unsafe.Pointer)(unsafe.Pointer(&a))
}
