//go:build linux

package shm

import (
	"crypto/rand"
	"crypto/sha256"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"os"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"unsafe"
)

// The grant table file (version 1), little-endian, mapped shared:
//
//	off  size  field
//	  0     8  magic "KVFLOWGT"
//	  8     4  version (1)
//	 12     4  header length (64)
//	 16     8  num_blocks
//	 24     8  epoch: random, not 0, set last by the owner at start; 0 while
//	           the owner (re)initialises the table and after it closes
//	 32     8  owner pid
//	 40     8  owner start time (/proc/<pid>/stat field 22, clock ticks since boot)
//	 48     8  the GrantAll word
//	 56     8  request slots S (a power of two)
//	 64  8·nb  one word per block id
//	  …  16·S  request slots: key (8), word (8)
//
// A word is generation<<32 | count: count is the number of outstanding
// grants (Grant/GrantAll, or GrantRequest of the slot's request),
// generation is bumped each time count drops to 0 (the block may be freed
// and reused from then on). A request slot's key is the first 8 bytes of
// SHA-256 of the request id (never 0); slots form an open-addressing
// table probed linearly from key mod S, and a key once written stays until
// its slot is reused by another request after its count dropped to 0, so
// probe chains never break. Words and keys are read and written with
// atomic 64-bit operations only.
// TableSuffix names a cache file's grant table: the cache file's path
// and this suffix. Open refuses a claim whose table is anywhere else.
const TableSuffix = ".grants"

const (
	tableMagic   = "KVFLOWGT"
	tableVersion = 1
	tableHeader  = 64

	offNumBlocks = 16
	offEpoch     = 24
	offPID       = 32
	offStart     = 40
	offAll       = 48
	offSlots     = 56
)

// Table is the prefill side of the grant table: the owner's view, mapped
// read-write. Its methods are safe for concurrent use.
type Table struct {
	path      string
	f         *os.File
	mem       []byte
	numBlocks int
	slots     int
	epoch     uint64
	dev, ino  uint64

	wmu sync.Mutex // serialises request slot updates

	mu     sync.RWMutex // Close exclusive
	closed bool
}

// CreateTable makes (or takes over in place) the grant table at path for a
// cache of numBlocks blocks per tensor, owned by this process. An existing
// file is reused in place, never unlinked: a reader that still maps it sees
// its epoch go to 0 first, then every word reset, then a new epoch, so any
// read that overlaps the takeover fails. A file at path that is not a
// grant table (another magic, not a regular file, a symbolic link) is
// refused and left as it was. The caller must own the cache the table
// guards (npu.CreateShm's lock), so no two live owners share a table.
func CreateTable(path string, numBlocks int, mode os.FileMode) (*Table, error) {
	if numBlocks < 1 || numBlocks > 1<<31 {
		return nil, fmt.Errorf("shm: grant table %s: num_blocks %d out of range", path, numBlocks)
	}
	if mode == 0 {
		mode = 0o600
	}
	f, err := os.OpenFile(path, os.O_RDWR|os.O_CREATE|syscall.O_NOFOLLOW, mode)
	if err != nil {
		return nil, fmt.Errorf("shm: grant table: %w", err)
	}
	keep := false
	defer func() {
		if !keep {
			f.Close()
		}
	}()
	st, err := f.Stat()
	if err != nil {
		return nil, fmt.Errorf("shm: grant table %s: %w", path, err)
	}
	if !st.Mode().IsRegular() {
		return nil, fmt.Errorf("shm: grant table %s: not a regular file; not replacing it", path)
	}
	if st.Size() > 0 {
		head := make([]byte, 8)
		if _, err := f.ReadAt(head, 0); err != nil || string(head) != tableMagic {
			return nil, fmt.Errorf("shm: grant table %s: exists and is not a kvflow grant table; not replacing it", path)
		}
		// Close it to readers first: epoch 0 before anything changes.
		var zero [8]byte
		if _, err := f.WriteAt(zero[:], offEpoch); err != nil {
			return nil, fmt.Errorf("shm: grant table %s: close it to readers: %w", path, err)
		}
	}
	slots := numSlots(numBlocks)
	size := tableSize(numBlocks, slots)
	if st.Size() != size {
		if err := f.Truncate(size); err != nil {
			return nil, fmt.Errorf("shm: grant table %s: size it: %w", path, err)
		}
	}
	mem, err := syscall.Mmap(int(f.Fd()), 0, int(size), syscall.PROT_READ|syscall.PROT_WRITE, syscall.MAP_SHARED)
	if err != nil {
		return nil, fmt.Errorf("shm: grant table %s: mmap: %w", path, err)
	}
	t := &Table{path: path, f: f, mem: mem, numBlocks: numBlocks, slots: slots}
	sys := st.Sys().(*syscall.Stat_t)
	t.dev, t.ino = uint64(sys.Dev), uint64(sys.Ino)
	word(mem, offEpoch).Store(0)
	copy(mem[:8], tableMagic)
	le := binary.LittleEndian
	le.PutUint32(mem[8:], tableVersion)
	le.PutUint32(mem[12:], tableHeader)
	word(mem, offSlots).Store(uint64(slots))
	word(mem, offNumBlocks).Store(uint64(numBlocks))
	start, err := procStart(os.Getpid())
	if err != nil {
		syscall.Munmap(mem)
		return nil, fmt.Errorf("shm: grant table %s: %w", path, err)
	}
	word(mem, offPID).Store(uint64(os.Getpid()))
	word(mem, offStart).Store(start)
	word(mem, offAll).Store(0)
	for b := range numBlocks {
		word(mem, blockOff(b)).Store(0)
	}
	for i := range slots {
		word(mem, slotOff(numBlocks, i)).Store(0)
		word(mem, slotOff(numBlocks, i)+8).Store(0)
	}
	t.epoch = newEpoch()
	word(mem, offEpoch).Store(t.epoch) // last: the table is open to readers
	keep = true
	return t, nil
}

// Path is the table's file.
func (t *Table) Path() string { return t.path }

// Epoch is the table's epoch, which readers' claims carry.
func (t *Table) Epoch() uint64 { return t.epoch }

// Identity is the table file's device and inode.
func (t *Table) Identity() (dev, ino uint64) { return t.dev, t.ino }

// Grant makes blocks readable (counted: each Grant needs its Revoke).
// Block ids outside [0, num_blocks) are an error and nothing is granted.
func (t *Table) Grant(blocks []int) error { return t.each(blocks, grantWord) }

func grantWord(w *atomic.Uint64) error {
	for {
		v := w.Load()
		if uint32(v) == ^uint32(0) {
			return errors.New("shm: grant count overflow")
		}
		if w.CompareAndSwap(v, v+1) {
			return nil
		}
	}
}

// Revoke ends one Grant of blocks, at once: a block whose count drops to
// 0 gets a new generation before Revoke returns, so a reader's copy that
// overlaps the block's reuse fails its check. A block not granted is an
// error (and is left alone).
func (t *Table) Revoke(blocks []int) error { return t.each(blocks, release) }

// GrantAll makes every block readable until the matching RevokeAll.
func (t *Table) GrantAll() error {
	return t.checked(nil, func() error {
		word(t.mem, offAll).Add(1)
		return nil
	})
}

// RevokeAll ends one GrantAll.
func (t *Table) RevokeAll() error {
	return t.checked(nil, func() error { return release(word(t.mem, offAll)) })
}

func release(w *atomic.Uint64) error {
	for {
		v := w.Load()
		n := uint32(v)
		if n == 0 {
			return errors.New("shm: revoke of a block not granted")
		}
		nv := v - 1
		if n == 1 {
			nv = (v>>32 + 1) << 32 // count 0, next generation
		}
		if w.CompareAndSwap(v, nv) {
			return nil
		}
	}
}

func (t *Table) each(blocks []int, f func(*atomic.Uint64) error) error {
	return t.checked(blocks, func() error { return t.eachLocked(blocks, f) })
}

// checked runs f with t.mu read-held, once the table is known to be open
// and every block id in range (ErrClosed, or the range error, otherwise;
// f does not run).
func (t *Table) checked(blocks []int, f func() error) error {
	t.mu.RLock()
	defer t.mu.RUnlock()
	if t.closed {
		return ErrClosed
	}
	if err := t.checkBlocks(blocks); err != nil {
		return err
	}
	return f()
}

func (t *Table) checkBlocks(blocks []int) error {
	for _, b := range blocks {
		if b < 0 || b >= t.numBlocks {
			return fmt.Errorf("shm: block id %d out of range [0, %d)", b, t.numBlocks)
		}
	}
	return nil
}

// eachLocked applies f to every block's word (t.mu held).
func (t *Table) eachLocked(blocks []int, f func(*atomic.Uint64) error) error {
	var errs []error
	for _, b := range blocks {
		if err := f(word(t.mem, blockOff(b))); err != nil {
			errs = append(errs, fmt.Errorf("block %d: %w", b, err))
		}
	}
	return errors.Join(errs...)
}

// Close closes the table to readers (epoch 0, every block a new
// generation) and unmaps it; with remove, it removes the file too. It is
// idempotent.
func (t *Table) Close(remove bool) error {
	t.mu.Lock()
	defer t.mu.Unlock()
	if t.closed {
		return nil
	}
	t.closed = true
	word(t.mem, offEpoch).Store(0)
	var errs []error
	if err := syscall.Munmap(t.mem); err != nil {
		errs = append(errs, fmt.Errorf("shm: grant table munmap: %w", err))
	}
	t.mem = nil
	if remove {
		if err := os.Remove(t.path); err != nil {
			errs = append(errs, fmt.Errorf("shm: remove grant table: %w", err))
		}
	}
	if err := t.f.Close(); err != nil {
		errs = append(errs, fmt.Errorf("shm: grant table close: %w", err))
	}
	return errors.Join(errs...)
}

// numSlots is the request slots of a table for numBlocks blocks: twice
// the blocks, at least 4096 (far above the requests a prefill worker
// holds at once: its engine's running requests), a power of two. 16 bytes
// each: 64 KiB for small caches, 4 MiB for 131,072 blocks.
func numSlots(numBlocks int) int {
	n := 4096
	for n < 2*numBlocks {
		n *= 2
	}
	return n
}

func tableSize(numBlocks, slots int) int64 {
	n := int64(tableHeader + 8*numBlocks + 16*slots)
	return (n + 4095) &^ 4095
}

func blockOff(b int) int { return tableHeader + 8*b }

// slotOff is the offset of request slot i's key (its word follows).
func slotOff(numBlocks, i int) int { return tableHeader + 8*numBlocks + 16*i }

// requestKey is a request id's slot key: the first 8 bytes of its SHA-256
// (never 0: 0 marks a slot never used).
func requestKey(id string) uint64 {
	sum := sha256.Sum256([]byte(id))
	k := binary.LittleEndian.Uint64(sum[:8])
	if k == 0 {
		k = 1
	}
	return k
}

// GrantRequest is Grant that also binds the grant to request id: a reader
// that names the request (Reader.Read) then checks that this request was
// held during its whole copy, so a block freed and already granted to
// another request is never read as id's. A request with no blocks needs
// no slot. With every slot held by a live request it fails (and grants
// nothing).
func (t *Table) GrantRequest(id string, blocks []int) error {
	return t.request("grant", id, blocks, true, grantWord)
}

// RevokeRequest ends one GrantRequest of id and blocks, at once.
func (t *Table) RevokeRequest(id string, blocks []int) error {
	return t.request("revoke", id, blocks, false, release)
}

// request is GrantRequest and RevokeRequest (op names which in errors):
// f (grantWord or release) on id's slot word, taken when insert and id
// has none, then, only if that succeeded, on every block's word. A
// request with no blocks is a no-op, even on a closed table.
func (t *Table) request(op, id string, blocks []int, insert bool, f func(*atomic.Uint64) error) error {
	if len(blocks) == 0 {
		return nil
	}
	return t.checked(blocks, func() error {
		t.wmu.Lock()
		w, err := t.slot(requestKey(id), insert)
		if err == nil {
			err = f(w)
		}
		t.wmu.Unlock()
		if err != nil {
			// Revoking a request not held: its blocks' counts are other
			// requests', left alone.
			return fmt.Errorf("shm: %s request %q: %w", op, id, err)
		}
		return t.eachLocked(blocks, f)
	})
}

// slot finds key's slot word (t.wmu held); with insert, it takes the
// first slot of its probe chain whose count is 0 when key has none.
func (t *Table) slot(key uint64, insert bool) (*atomic.Uint64, error) {
	mask := t.slots - 1
	free := -1
	for n, i := 0, int(key)&mask; n < t.slots; n, i = n+1, (i+1)&mask {
		off := slotOff(t.numBlocks, i)
		k := word(t.mem, off).Load()
		if k == key {
			return word(t.mem, off+8), nil
		}
		if free < 0 && uint32(word(t.mem, off+8).Load()) == 0 {
			free = i
		}
		if k == 0 {
			break
		}
	}
	switch {
	case !insert:
		return nil, errors.New("request not granted")
	case free < 0:
		return nil, fmt.Errorf("all %d request slots held", t.slots)
	}
	off := slotOff(t.numBlocks, free)
	// The slot's count is 0: a reader that finds the new key sees it
	// ungranted until the caller counts the grant; one that had
	// snapshotted the old key sees the key change.
	word(t.mem, off).Store(key)
	return word(t.mem, off+8), nil
}

// word is the 8-byte-aligned word at off of a mapping (page-aligned, so
// every 8-aligned offset is 8-aligned in memory).
func word(mem []byte, off int) *atomic.Uint64 {
	return (*atomic.Uint64)(unsafe.Pointer(&mem[off]))
}

func newEpoch() uint64 {
	var b [8]byte
	for {
		rand.Read(b[:])
		if e := binary.LittleEndian.Uint64(b[:]); e != 0 {
			return e
		}
	}
}

// procStart is the start time of process pid (field 22 of /proc/<pid>/stat,
// clock ticks since boot): with the pid, it names one process for the
// lifetime of the boot.
func procStart(pid int) (uint64, error) {
	f, err := os.Open("/proc/" + strconv.Itoa(pid) + "/stat")
	if err != nil {
		return 0, fmt.Errorf("process start time: %w", err)
	}
	defer f.Close()
	b, err := io.ReadAll(io.LimitReader(f, 4096))
	if err != nil {
		return 0, fmt.Errorf("process start time: %w", err)
	}
	// The command name (field 2) is in parentheses and may hold spaces.
	i := strings.LastIndexByte(string(b), ')')
	if i < 0 {
		return 0, errors.New("process start time: unparsable /proc stat")
	}
	fields := strings.Fields(string(b[i+1:]))
	// fields[0] is field 3 (state), so field 22 is fields[19].
	if len(fields) < 20 {
		return 0, errors.New("process start time: short /proc stat")
	}
	v, err := strconv.ParseUint(fields[19], 10, 64)
	if err != nil {
		return 0, fmt.Errorf("process start time: %w", err)
	}
	return v, nil
}
