package read

import (
	"context"
	"errors"
	"fmt"
	"math"
	"slices"
	"time"

	"github.com/kvflow/kvflow/stages/job"
)

// Failure is how a batch failed, as a Transfer tells it
// (Capabilities.Classify). Without a classifier the stage never retries a
// read.
type Failure struct {
	// ConnLost: the peer's connection was refused or closed (its process
	// may have gone away or restarted), not a refusal of the reads, a
	// timeout or a cancellation.
	ConnLost bool
	// Moved: some op of the batch landed before it failed, so the peer
	// the job read from was alive and serving during this job's read.
	Moved bool
	// Refused: the peer answered and refused the reads (with read grants,
	// blocks it does not serve: not yet sent, or already freed).
	Refused bool
	// RefusedOnly: Refused, and every op of the batch that failed was
	// refused by the peer or skipped after the refusal (not attempted):
	// nothing else went wrong (no lost connection, timeout or local
	// error). With Moved it is the batch a grant arriving mid-batch
	// leaves behind: the ops the peer checked before the grant refused,
	// the others landed. The stage reads it again like a batch refused
	// outright (read.go, Options.GrantWait).
	RefusedOnly bool
}

// Refetcher returns the current metadata of task's rank after a read with
// used failed at failedAt (the handshake cache's Refetch: one fetch for
// all the reads that failed together).
type Refetcher func(ctx context.Context, j *job.Job, task int, used job.Meta, failedAt time.Time) (job.Meta, error)

// ErrPeerRestarted fails a job whose prefill rank restarted (or was
// replaced) while it held, or may have held, the job's blocks: they were
// lost with the old process, and the new one does not hold them.
var ErrPeerRestarted = errors.New("read: prefill peer restarted; the request's blocks may have been lost with the old process")

// minBootEpoch is the least boot epoch read as a boot time in unix
// nanoseconds (2017-07-14): kvflow's prefill workers send their start time;
// smaller values (tests, other senders) are opaque tokens that only say
// "another process".
const minBootEpoch = 1_500_000_000_000_000_000

// bootTime reads a boot epoch as the process's start in unix nanoseconds,
// if it is one (minBootEpoch up to the largest int64).
func bootTime(epoch uint64) (time.Time, bool) {
	if epoch < minBootEpoch || epoch > math.MaxInt64 {
		return time.Time{}, false
	}
	return time.Unix(0, int64(epoch)), true
}

// sameProcess reports whether a and b describe the same prefill process:
// the same boot epoch where both carry one; without epochs (seed and
// Mooncake peers), the same transfer-engine port, addresses and blocks.
func sameProcess(a, b job.Meta) bool {
	if a.BootEpoch != 0 || b.BootEpoch != 0 {
		return a.BootEpoch == b.BootEpoch
	}
	return a.TERPCPort == b.TERPCPort && a.NumBlocks == b.NumBlocks && slices.Equal(a.BaseAddrs, b.BaseAddrs)
}

// retryVerdict decides whether a read that failed (f) with metadata used
// may run once more with fresh, for a job admitted at admitted: nil means
// retry.
//
//   - Same process (fresh is used re-fetched): only a lost connection is
//     retried; the process still holds the job's blocks (no DONE has
//     left), so the retry reads what the first attempt would have. A
//     refusal, a short read or a timeout is not.
//   - Another process (boot epoch changed; without epochs, new port or
//     addresses): it holds the job's blocks only if the job was prefilled
//     there, that is after it booted. The job was prefilled before its
//     admission here, so a process that booted after the admission cannot
//     hold it: the blocks were lost with the old one (ErrPeerRestarted).
//     The retry runs only if fresh's boot epoch is a boot time (kvflow
//     sends its start in unix nanoseconds) before the admission and no op
//     of the failed batch landed (the old process served it during this
//     job's read: the job was there). A peer without a boot epoch cannot
//     tell when it booted: never retried.
func retryVerdict(f Failure, used, fresh job.Meta, admitted time.Time) error {
	if f.Moved {
		return errors.New("not retried: part of the batch had landed from the peer")
	}
	if sameProcess(used, fresh) {
		if !f.ConnLost {
			return errors.New("not retried: the peer did not restart and its connection was not lost")
		}
		return nil
	}
	if fresh.BootEpoch == 0 {
		return fmt.Errorf("%w: its metadata changed (te_rpc_port %d → %d) and it sends no boot epoch to tell whether it booted before this request",
			ErrPeerRestarted, used.TERPCPort, fresh.TERPCPort)
	}
	if _, ok := bootTime(fresh.BootEpoch); !ok {
		return fmt.Errorf("%w: boot epoch %d → %d is not a boot time, so whether it booted before this request cannot be told",
			ErrPeerRestarted, used.BootEpoch, fresh.BootEpoch)
	}
	if err := bootedAfter(fresh, admitted); err != nil {
		return fmt.Errorf("boot epoch %d → %d: %w", used.BootEpoch, fresh.BootEpoch, err)
	}
	return nil
}

// bootedAfter is ErrPeerRestarted if m's boot epoch is a boot time (see
// minBootEpoch) not before admitted: that process started after the job
// was admitted, so after it was prefilled, and cannot hold its blocks (the
// job's metadata was fetched, or re-fetched, after its prefill rank
// restarted). Every read checks it, first attempt or retry, so such a job
// fails instead of reading the new process's blocks in place of its own.
func bootedAfter(m job.Meta, admitted time.Time) error {
	boot, ok := bootTime(m.BootEpoch)
	if !ok || boot.Before(admitted) {
		return nil
	}
	return fmt.Errorf("%w: it booted at %s, %v after this request was admitted",
		ErrPeerRestarted, boot.UTC().Format(time.RFC3339Nano), boot.Sub(admitted).Round(time.Microsecond))
}
