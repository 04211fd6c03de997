//go:build linux

package npu

import (
	"errors"
	"fmt"
	"io"
	"os"
	"strconv"
	"syscall"
	"time"
	"unsafe"

	"golang.org/x/sys/unix"
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

// CreateShm creates a new shared-memory cache file at path (typically under
// /dev/shm) for layout l: a self-describing header page, then zeroed caches
// at a huge-page-aligned offset. The file appears atomically, complete, and
// only if path did not exist (an existing file is an error wrapping
// fs.ErrExist, and is left as it was). The memory is fully allocated up
// front, so a too-small tmpfs fails here rather than faulting later.
func CreateShm(path string, l Layout, opts HostOptions) (*Host, error) {
	if l.NumCaches() == 0 {
		return nil, fmt.Errorf("%w: zero Layout", ErrInvalidShape)
	}
	if path == "" {
		return nil, errors.New("npu: create cache file: empty path")
	}
	if _, err := os.Lstat(path); err == nil {
		return nil, fmt.Errorf("npu: create cache file %s: %w", path, os.ErrExist)
	}
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
		f.Close()
		if !published {
			os.Remove(tmp)
		}
	}()
	fail := func(what string, err error) (*Host, error) {
		return nil, fmt.Errorf("npu: create cache file %s: %s: %w", path, what, err)
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
	return newHost(l, mem, int(hd.dataOffset), path, opts.RemoveOnClose, huge, opts), nil
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
