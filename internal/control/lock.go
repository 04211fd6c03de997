package control

import (
	"errors"
	"fmt"
	"io/fs"
	"os"
	"strconv"
	"strings"

	"github.com/kvflow/kvflow/internal/pidlock"
)

// ErrInUse means a live process holds the control socket: another worker
// with the same engine id, role and ranks (or node.control) is running.
var ErrInUse = errors.New("control: socket in use by a live worker")

// SocketLock is this process's hold on an ipc:// control socket path: an
// exclusive flock on <path>.lock, held from before the bind until after
// the socket is closed. ZMQ's ipc bind silently unlinks a socket file in
// use and binds a new one, so without it a second worker would take the
// first one's engine away; and ZMQ never removes the file it bound.
type SocketLock struct {
	sock string // the socket file; "" when nothing is locked
	lock *pidlock.File
}

// LockSocket takes endpoint for this process. For ipc://path it locks
// path+".lock" (creating it): a live holder is an error wrapping ErrInUse
// that names the endpoint and the holder's pid; a lock file or socket file
// left by a dead worker is taken over (the bind then replaces the stale
// socket). tcp:// endpoints and Linux abstract ipc://@names need no lock
// (their bind fails by itself when in use): the SocketLock is a no-op.
func LockSocket(endpoint string) (*SocketLock, error) {
	path, ok := strings.CutPrefix(endpoint, "ipc://")
	if !ok || path == "" || strings.HasPrefix(path, "@") {
		return &SocketLock{}, nil
	}
	l, err := pidlock.Acquire(path + ".lock")
	if err != nil {
		var held *pidlock.HeldError
		if errors.As(err, &held) {
			owner := "pid unknown"
			if held.PID > 0 {
				owner = "pid " + strconv.Itoa(held.PID)
			}
			return nil, fmt.Errorf("%w: %s (%s, lock file %s): another kvflow worker with this engine id, role and ranks is running; stop it, or give this worker another node.control",
				ErrInUse, endpoint, owner, held.Path)
		}
		return nil, fmt.Errorf("control socket %s: %w", endpoint, err)
	}
	return &SocketLock{sock: path, lock: l}, nil
}

// Release removes the socket file (if it is a socket) and the lock file,
// then drops the lock. Call it once the socket is closed (the ZMQ context
// terminated). Idempotent.
func (s *SocketLock) Release() error {
	if s == nil || s.lock == nil {
		return nil
	}
	var errs []error
	if st, err := os.Lstat(s.sock); err == nil && st.Mode()&fs.ModeSocket != 0 {
		if err := os.Remove(s.sock); err != nil {
			errs = append(errs, fmt.Errorf("control: remove socket file: %w", err))
		}
	}
	if err := s.lock.Release(); err != nil {
		errs = append(errs, fmt.Errorf("control: %w", err))
	}
	s.lock = nil
	return errors.Join(errs...)
}
