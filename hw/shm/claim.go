package shm

import (
	"errors"
	"os"
	"strings"
	"sync"
)

// Claim is a prefill worker's statement that its cache can be read by
// mapping a file on this host: the host (HostID), the cache file's path and
// identity (device, inode, size, and its header's bytes, which hold the
// shape and a checksum), and the grant table that says which blocks may be
// read (its path, identity and the epoch of its owner's current run). It
// travels in kvflow's metadata extension ("kvflow"."same_host"). A reader
// trusts none of it: Open checks every field against what it opens.
type Claim struct {
	HostID               string
	Path                 string
	Dev, Ino, Size       uint64
	Header               []byte
	Grants               string
	GrantsDev, GrantsIno uint64
	Epoch                uint64
}

// Errors, for errors.Is.
var (
	// ErrNotSameHost: the claim names another host (or none can be read
	// here): the reader must use the network.
	ErrNotSameHost = errors.New("shm: peer is not on this host")
	// ErrMismatch: the file at the claim's path is not the one the claim
	// describes (other device, inode, size or header), or the grant table
	// is not the claimed one. Nothing was mapped.
	ErrMismatch = errors.New("shm: file does not match the claim")
	// ErrOwnerGone: the grant table's owner (the prefill worker) exited or
	// restarted (another epoch): nothing it granted may be read.
	ErrOwnerGone = errors.New("shm: grant table owner gone or restarted")
	// ErrNotGranted: a block read was not granted, or was freed (its
	// grant generation changed) during or before the copy.
	ErrNotGranted = errors.New("shm: block not granted")
	// ErrRange: an op outside the peer's caches or this process's memory.
	ErrRange = errors.New("shm: op out of range")
	// ErrFault: the mapping faulted during a copy (the file was truncated
	// under it).
	ErrFault = errors.New("shm: memory fault while copying")
	// ErrClosed: the reader or table was closed.
	ErrClosed = errors.New("shm: closed")
	// ErrUnsupported: no same-host path on this platform.
	ErrUnsupported = errors.New("shm: not supported on this platform")
)

// bootIDPath is the kernel's boot id: one value per boot of one kernel,
// shared by every container on it.
const bootIDPath = "/proc/sys/kernel/random/boot_id"

var hostID = sync.OnceValues(func() (string, error) {
	b, err := os.ReadFile(bootIDPath)
	if err != nil {
		return "", err
	}
	id := strings.TrimSpace(string(b))
	if id == "" {
		return "", errors.New("shm: empty boot id")
	}
	return "boot:" + id, nil
})

// HostID names this host for a Claim: the kernel's boot id. Two processes
// can share a file mapping only under one kernel; the boot id is the same
// for every container under it (the hostname and /etc/machine-id are not:
// a pod's hostname is its own, and an image may bake in a machine id that
// every host then shares), and it changes with a reboot.
func HostID() (string, error) { return hostID() }
