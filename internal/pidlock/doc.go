// Package pidlock marks a file as owned by a live process: an exclusive
// flock(2) taken without waiting and held on an open file for the owner's
// lifetime. The kernel drops it when the owner exits, however it exits
// (SIGKILL included), so a file a dead process left behind can be told
// from one a live process still uses, and reclaimed without a person.
//
// # Contract
//
//   - TryLock(f) takes the lock on f's open file description or returns an
//     error wrapping ErrHeld (a *HeldError naming the holder's pid when
//     /proc/locks shows it). Two opens of one file in one process are two
//     owners, as across processes.
//   - Acquire(path) creates or opens a lock file, locks it, checks that
//     path still names the locked file (a releaser may have removed it in
//     between) and writes the owner's pid into it, for people.
//     File.Release removes the lock file while still holding the lock,
//     then unlocks: the next Acquire creates a fresh one.
//   - Holder(f) is the pid that holds a flock on f's file, from
//     /proc/locks (0 when unknown: no procfs, a holder in another pid
//     namespace, or none).
//
// flock locks are advisory: they keep out kvflow processes, not others.
// They are per open file description (never lost when another descriptor
// of the same file is closed, unlike fcntl record locks) and are not
// inherited across exec (files are opened close-on-exec).
//
// # Never
//
// Never wait for a lock; never remove a file this package did not lock.
package pidlock
