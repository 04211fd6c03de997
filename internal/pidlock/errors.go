package pidlock

import (
	"errors"
	"fmt"
	"os"
)

// ErrHeld means another open file (another process, typically) holds the
// lock.
var ErrHeld = errors.New("pidlock: held by a live process")

// HeldError is a lock another owner holds.
type HeldError struct {
	// Path is the locked file.
	Path string
	// PID is the holder's process id, 0 if unknown.
	PID int
}

func (e *HeldError) Error() string {
	if e.PID > 0 {
		return fmt.Sprintf("%s is locked by live process %d", e.Path, e.PID)
	}
	return fmt.Sprintf("%s is locked by a live process (pid unknown)", e.Path)
}

// Unwrap makes errors.Is(err, ErrHeld) hold.
func (e *HeldError) Unwrap() error { return ErrHeld }

// File is a held lock file.
type File struct {
	f    *os.File
	path string
}

// Path is the lock file's path.
func (l *File) Path() string { return l.path }
