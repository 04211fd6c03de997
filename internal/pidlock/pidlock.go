//go:build unix

package pidlock

import (
	"bufio"
	"bytes"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"strconv"
	"strings"
	"syscall"

	"golang.org/x/sys/unix"
)

// TryLock takes an exclusive flock on f without waiting. A lock held by
// another open file is an error wrapping ErrHeld (a *HeldError).
func TryLock(f *os.File) error {
	for {
		err := unix.Flock(int(f.Fd()), unix.LOCK_EX|unix.LOCK_NB)
		switch {
		case err == nil:
			return nil
		case errors.Is(err, unix.EINTR):
			continue
		case errors.Is(err, unix.EWOULDBLOCK):
			return &HeldError{Path: f.Name(), PID: Holder(f)}
		default:
			return fmt.Errorf("pidlock: lock %s: %w", f.Name(), err)
		}
	}
}

// Holder is the pid of a process holding a flock on f's file, from
// /proc/locks; 0 when unknown.
func Holder(f *os.File) int {
	var st unix.Stat_t
	if err := unix.Fstat(int(f.Fd()), &st); err != nil {
		return 0
	}
	b, err := os.ReadFile("/proc/locks")
	if err != nil {
		return 0
	}
	dev := uint64(st.Dev)
	return holder(b, uint64(unix.Major(dev)), uint64(unix.Minor(dev)), uint64(st.Ino))
}

// holder parses /proc/locks lines such as
//
//	1: FLOCK  ADVISORY  WRITE 4711 00:1a:123456 0 EOF
//
// (blocked waiters, "1: -> FLOCK ...", are skipped) for a flock on the
// file (major:minor in hex, inode in decimal).
func holder(procLocks []byte, major, minor, ino uint64) int {
	sc := bufio.NewScanner(bytes.NewReader(procLocks))
	for sc.Scan() {
		f := strings.Fields(sc.Text())
		if len(f) < 6 || f[1] != "FLOCK" {
			continue
		}
		id := strings.Split(f[5], ":")
		if len(id) != 3 {
			continue
		}
		ma, err1 := strconv.ParseUint(id[0], 16, 32)
		mi, err2 := strconv.ParseUint(id[1], 16, 32)
		in, err3 := strconv.ParseUint(id[2], 10, 64)
		if err1 != nil || err2 != nil || err3 != nil || ma != major || mi != minor || in != ino {
			continue
		}
		if pid, err := strconv.Atoi(f[4]); err == nil && pid > 0 {
			return pid
		}
	}
	return 0
}

// maxAttempts bounds Acquire's retries when the lock file is removed or
// replaced between its open and its lock (each retry means another
// process released or took it just then).
const maxAttempts = 8

// Acquire creates (mode 0600) or opens the lock file at path and takes its
// lock without waiting: an error wrapping ErrHeld (a *HeldError) if a
// live process holds it. It then writes this process's pid into it.
func Acquire(path string) (*File, error) {
	for range maxAttempts {
		f, err := os.OpenFile(path, os.O_RDWR|os.O_CREATE|syscall.O_NOFOLLOW, 0o600)
		if err != nil {
			return nil, fmt.Errorf("pidlock: open lock file: %w", err)
		}
		if err := TryLock(f); err != nil {
			f.Close()
			return nil, err
		}
		// The lock is on the file f names; a releaser may have removed
		// path (or another process made a new one) since f was opened.
		same, err := sameFile(f, path)
		if err != nil {
			f.Close()
			return nil, fmt.Errorf("pidlock: lock file %s: %w", path, err)
		}
		if !same {
			f.Close()
			continue
		}
		pid := []byte(strconv.Itoa(os.Getpid()) + "\n")
		if err := f.Truncate(0); err == nil {
			_, err = f.WriteAt(pid, 0)
		}
		// The pid is for people; the lock is what counts.
		return &File{f: f, path: path}, nil
	}
	return nil, fmt.Errorf("pidlock: lock file %s: replaced %d times while locking it", path, maxAttempts)
}

func sameFile(f *os.File, path string) (bool, error) {
	a, err := f.Stat()
	if err != nil {
		return false, err
	}
	b, err := os.Lstat(path)
	if errors.Is(err, fs.ErrNotExist) {
		return false, nil
	}
	if err != nil {
		return false, err
	}
	return os.SameFile(a, b), nil
}

// Release removes the lock file, then unlocks it (closing it). It is
// idempotent.
func (l *File) Release() error {
	if l == nil || l.f == nil {
		return nil
	}
	var errs []error
	if err := os.Remove(l.path); err != nil && !errors.Is(err, fs.ErrNotExist) {
		errs = append(errs, fmt.Errorf("pidlock: remove lock file: %w", err))
	}
	if err := l.f.Close(); err != nil {
		errs = append(errs, fmt.Errorf("pidlock: close lock file: %w", err))
	}
	l.f = nil
	return errors.Join(errs...)
}
