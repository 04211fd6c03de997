//go:build !unix

package pidlock

import "os"

// TryLock needs flock(2): without it, no lock is taken.
func TryLock(f *os.File) error { return nil }

// Holder is unknown without /proc/locks.
func Holder(f *os.File) int { return 0 }

// Acquire only names the file without flock(2).
func Acquire(path string) (*File, error) { return &File{path: path}, nil }

// Release does nothing without flock(2).
func (l *File) Release() error { return nil }
