//go:build linux

package npu

import (
	"errors"
	"fmt"
	"io"
	"io/fs"
	"os"
	"strconv"
	"syscall"
	"time"
	"unsafe"

	"golang.org/x/sys/unix"

	"github.com/kvflow/kvflow/internal/pidlock"
)

const hugePage = 2 << 20

// NewHost allocates anonymous, zeroed, private memory for layout l. With
// huge pages allowed it first asks for MAP_HUGETLB pages (reserved in
// /proc/sys/vm/nr_hugepages), then for transparent huge pages.
func NewHost(l Layout, opts HostOptions) (*Host, error) {
	if l.NumCaches() == 0 {
		return nil, fmt.Errorf("%w: zero Layout", ErrInvalidShape)
	}
	size := int(l.Size())
	prot := syscall.PROT_READ | syscall.PROT_WRITE
	flags := syscall.MAP_PRIVATE | syscall.MAP_ANONYMOUS
	var mem []byte
	huge := false
	if !opts.NoHugePages {
		if m, err := syscall.Mmap(-1, 0, int(alignUp(int64(size), hugePage)), prot, flags|syscall.MAP_HUGETLB); err == nil {
			mem, huge = m, true
		}
	}
	if mem == nil {
		m, err := syscall.Mmap(-1, 0, size, prot, flags)
		if err != nil {
			return nil, fmt.Errorf("npu: mmap %d bytes: %w", size, err)
		}
		mem = m
		if !opts.NoHugePages {
			_ = syscall.Madvise(mem, syscall.MADV_HUGEPAGE) // advice only
		}
	}
	return newHost(l, mem, 0, "", false, huge, opts), nil
}

// CreateShm creates a shared-memory cache file at path (typically under
// /dev/shm) for layout l: a self-describing header page, then zeroed caches
// at a huge-page-aligned offset. The file appears atomically, complete. The
// memory is fully allocated up front, so a too-small tmpfs fails here
// rather than faulting later.
//
// The Host owns the file for its lifetime: it holds an exclusive flock on
// it (internal/pidlock), taken before the file appears and dropped by the
// kernel when this process exits, however it exits. A file already at path
// is:
//   - owned by a live process: refused, with an error wrapping ErrInUse
//     that names the owner's pid (when /proc/locks shows it);
//   - left by a dead owner, with a valid header of shape l: reclaimed in
//     place (same file, contents kept, no zeroing), so a serving engine
//     that still maps it keeps seeing the memory this Host reads into and
//     serves from; Reclaimed says so;
//   - left by a dead owner, a valid kvflow cache file of another shape:
//     removed, and a new file created; Reclaimed says so;
//   - anything else (not a regular file, not a kvflow cache file, a bad
//     header): refused with an error wrapping ErrBadFile, and left as it
//     was.
//
// An engine that maps the file (OpenShm, the Python client's attach_cache)
// takes no lock and is not an owner: the file's owner is the kvflow worker
// that created it, and a restarted worker takes it back in place.
func CreateShm(path string, l Layout, opts HostOptions) (*Host, error) {
	if l.NumCaches() == 0 {
		return nil, fmt.Errorf("%w: zero Layout", ErrInvalidShape)
	}
	if path == "" {
		return nil, errors.New("npu: create cache file: empty path")
	}
	// Each round either ends or saw the name change under it (another
	// process created, reclaimed or removed it just then).
	for range 4 {
		if _, err := os.Lstat(path); errors.Is(err, fs.ErrNotExist) {
			h, err := createShm(path, l, opts)
			if !errors.Is(err, fs.ErrExist) {
				return h, err
			}
		} else if err != nil {
			return nil, fmt.Errorf("npu: create cache file %s: %w", path, err)
		}
		h, err := reclaimShm(path, l, opts)
		if !errors.Is(err, errRetry) {
			return h, err
		}
	}
	return nil, fmt.Errorf("npu: create cache file %s: the name kept changing (processes racing for it?)", path)
}

// errRetry: the file at the path changed while CreateShm looked at it.
var errRetry = errors.New("npu: cache file changed, retry")

// createShm makes a new file under a temporary name, locks it and
// publishes it at path with link(2), which never replaces a name: an
// existing path is an error wrapping fs.ErrExist.
func createShm(path string, l Layout, opts HostOptions) (*Host, error) {
	mode := opts.Mode
	if mode == 0 {
		mode = 0o600
	}
	hd := newHeader(l)
	tmp := path + ".tmp." + strconv.Itoa(os.Getpid()) + "." + strconv.FormatInt(time.Now().UnixNano(), 36)
	f, err := os.OpenFile(tmp, os.O_RDWR|os.O_CREATE|os.O_EXCL, mode)
	if err != nil {
		return nil, fmt.Errorf("npu: create cache file: %w", err)
	}
	published := false
	defer func() {
		if !published {
			f.Close()
			os.Remove(tmp)
		}
	}()
	fail := func(what string, err error) (*Host, error) {
		return nil, fmt.Errorf("npu: create cache file %s: %s: %w", path, what, err)
	}
	if err := pidlock.TryLock(f); err != nil {
		return fail("lock", err)
	}
	if err := f.Truncate(int64(hd.fileSize)); err != nil {
		return fail("truncate", err)
	}
	if err := syscall.Fallocate(int(f.Fd()), 0, int64(hd.dataOffset), int64(hd.dataSize)); err != nil &&
		!errors.Is(err, syscall.EOPNOTSUPP) && !errors.Is(err, syscall.ENOSYS) {
		return fail("allocate", err)
	}
	if _, err := f.WriteAt(hd.encode(), 0); err != nil {
		return fail("write header", err)
	}
	mem, huge, err := mapShared(f, hd, opts)
	if err != nil {
		return fail("mmap", err)
	}
	// Publish: link is atomic and never replaces an existing name.
	if err := os.Link(tmp, path); err != nil {
		syscall.Munmap(mem)
		return fail("publish", err)
	}
	published = true
	os.Remove(tmp)
	h := newHost(l, mem, int(hd.dataOffset), path, opts.RemoveOnClose, huge, opts)
	h.ownerLock = f
	return h, nil
}

// reclaimShm takes over the file at path if its owner is dead (see
// CreateShm); errRetry if the name changed meanwhile.
func reclaimShm(path string, l Layout, opts HostOptions) (_ *Host, err error) {
	notOurs := func(what string) (*Host, error) {
		return nil, fmt.Errorf("%w: %s: exists and is %s; not replacing it", ErrBadFile, path, what)
	}
	lst, err := os.Lstat(path)
	switch {
	case errors.Is(err, fs.ErrNotExist):
		return nil, errRetry
	case err != nil:
		return nil, fmt.Errorf("npu: create cache file %s: %w", path, err)
	case lst.Mode()&fs.ModeSymlink != 0:
		return notOurs("a symbolic link")
	case !lst.Mode().IsRegular():
		return notOurs("not a regular file")
	}
	f, err := os.OpenFile(path, os.O_RDWR|syscall.O_NOFOLLOW, 0)
	switch {
	case errors.Is(err, fs.ErrNotExist), errors.Is(err, syscall.ELOOP), errors.Is(err, syscall.EISDIR):
		return nil, errRetry // replaced since Lstat
	case err != nil:
		return nil, fmt.Errorf("npu: create cache file %s: exists; open it: %w", path, err)
	}
	keep := false
	defer func() {
		if !keep {
			f.Close()
		}
	}()
	st, err := f.Stat()
	if err != nil {
		return nil, fmt.Errorf("npu: create cache file %s: %w", path, err)
	}
	if !st.Mode().IsRegular() {
		return notOurs("not a regular file")
	}
	if err := pidlock.TryLock(f); err != nil {
		var held *pidlock.HeldError
		if !errors.As(err, &held) {
			return nil, fmt.Errorf("npu: create cache file %s: %w", path, err)
		}
		owner := "pid unknown"
		if held.PID > 0 {
			owner = "pid " + strconv.Itoa(held.PID)
		}
		return nil, fmt.Errorf("%w: %s (%s): another kvflow worker with this cache path is running", ErrInUse, path, owner)
	}
	// Locked, so its owner is dead (or it never had one). Make sure the
	// lock is on the file the name still refers to.
	if cur, err := os.Lstat(path); err != nil || !os.SameFile(st, cur) {
		return nil, errRetry
	}
	buf := make([]byte, headerSize)
	n, err := f.ReadAt(buf, 0)
	if err != nil && !errors.Is(err, io.EOF) {
		return nil, fmt.Errorf("npu: create cache file %s: read the header of the file a dead owner left: %w", path, err)
	}
	hd, fl, err := decodeHeader(path, buf[:n], st.Size())
	if err != nil {
		return nil, fmt.Errorf("npu: create cache file %s: exists without a live owner, and is not a kvflow cache file to reuse (remove it if it is stale): %w", path, err)
	}
	if hd.shape != l.shape {
		// A kvflow file of another shape: this worker's configuration
		// changed. Replace it (the name, while locked, then a new file).
		if err := os.Remove(path); err != nil {
			return nil, fmt.Errorf("npu: create cache file %s: remove a dead owner's file of another shape: %w", path, err)
		}
		h, err := createShm(path, l, opts)
		if errors.Is(err, fs.ErrExist) {
			return nil, errRetry
		}
		if h != nil {
			h.reclaimed = fmt.Sprintf("replaced a dead owner's cache file of another shape (%+v)", hd.shape)
		}
		return h, err
	}
	mem, huge, err := mapShared(f, hd, opts)
	if err != nil {
		return nil, fmt.Errorf("npu: create cache file %s: mmap a dead owner's file: %w", path, err)
	}
	keep = true
	h := newHost(fl, mem, int(hd.dataOffset), path, opts.RemoveOnClose, huge, opts)
	h.ownerLock = f
	h.reclaimed = "reused in place a dead owner's cache file of the same shape (contents kept)"
	return h, nil
}

// OpenShm attaches to an existing cache file made by CreateShm (by this or
// another process) and maps the same memory, with the layout its header
// describes. A file that is not one (bad magic, version, checksum, a size
// that disagrees with its header) is rejected with an error wrapping
// ErrBadFile, as is a shape other than opts.Expect; nothing is written to it.
func OpenShm(path string, opts HostOptions) (*Host, error) {
	f, err := os.OpenFile(path, os.O_RDWR, 0)
	if err != nil {
		return nil, fmt.Errorf("npu: open cache file: %w", err)
	}
	defer f.Close()
	st, err := f.Stat()
	if err != nil {
		return nil, fmt.Errorf("npu: open cache file %s: %w", path, err)
	}
	if !st.Mode().IsRegular() {
		return nil, fmt.Errorf("%w: %s: not a regular file", ErrBadFile, path)
	}
	buf := make([]byte, headerSize)
	n, err := f.ReadAt(buf, 0)
	if err != nil && !errors.Is(err, io.EOF) {
		return nil, fmt.Errorf("npu: open cache file %s: %w", path, err)
	}
	hd, l, err := decodeHeader(path, buf[:n], st.Size())
	if err != nil {
		return nil, err
	}
	if opts.Expect != nil && *opts.Expect != hd.shape {
		return nil, fmt.Errorf("%w: %s: shape %+v, expected %+v", ErrBadFile, path, hd.shape, *opts.Expect)
	}
	mem, huge, err := mapShared(f, hd, opts)
	if err != nil {
		return nil, fmt.Errorf("npu: open cache file %s: mmap: %w", path, err)
	}
	return newHost(l, mem, int(hd.dataOffset), path, false, huge, opts), nil
}

// mapShared maps the whole file shared and advises huge pages for the data
// (honoured by tmpfs when shmem_enabled allows it; ignored otherwise).
func mapShared(f *os.File, hd header, opts HostOptions) ([]byte, bool, error) {
	mem, err := syscall.Mmap(int(f.Fd()), 0, int(hd.fileSize), syscall.PROT_READ|syscall.PROT_WRITE, syscall.MAP_SHARED)
	if err != nil {
		return nil, false, err
	}
	if !opts.NoHugePages {
		_ = syscall.Madvise(mem[hd.dataOffset:], syscall.MADV_HUGEPAGE)
	}
	return mem, false, nil
}

func munmap(b []byte) error { return syscall.Munmap(b) }

// lockMemory locks b's pages in memory as they are first touched
// (mlock2 MLOCK_ONFAULT): nothing is faulted in here, so a cache larger
// than free memory fails as it is used, as unlocked, rather than at
// start; once touched, a page stays. A refused lock is undone.
func lockMemory(b []byte) error {
	if len(b) == 0 {
		return nil
	}
	_, _, errno := unix.Syscall(unix.SYS_MLOCK2, uintptr(unsafe.Pointer(&b[0])), uintptr(len(b)), unix.MLOCK_ONFAULT)
	if errno != 0 {
		err := error(errno)
		unix.Munlock(b)
		return fmt.Errorf("npu: lock %d bytes of cache memory (RLIMIT_MEMLOCK?): %w", len(b), err)
	}
	return nil
}
