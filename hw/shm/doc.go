// Package shm is the same-host transfer path (node.te_backend: shm): a
// decode worker on the same host as a prefill worker maps the prefill's
// cache file (npu.CreateShm's) read-only and reads blocks as memory copies,
// with no network and no server (one poll(2) of the owner's pidfd per
// batch), the head transpose of tp_num_need_pulls > 1 fused into the copy
// and head slices gathered (Stride).
//
// # The claim
//
// A prefill worker that offers the path publishes a Claim in its metadata
// extension ("kvflow"."same_host"): its host id (the kernel's boot id;
// HostID says why not the hostname or /etc/machine-id), the cache file's
// path, device, inode and size, the file's header bytes (shape, sizes,
// CRC-32C), and its grant table's path, device, inode and epoch. Open
// trusts none of it: it opens both files read-only with O_NOFOLLOW and
// checks each against the claim (the table must be the cache file's own,
// "<cache>.grants", with the cache file's owner; fstat device, inode and
// size, neither above the host's memory; the header byte for byte, the
// table's magic, block count and epoch, the peer's kv_caches_base_addr
// against the header's layout) before anything is mapped. A file that differs in any of these is refused (ErrMismatch); a
// claim from another host is ErrNotSameHost; the caller then reads over
// the network.
//
// # Grants without a server: the grant table
//
// With the TCP engine, the prefill's server refuses reads of blocks that
// are not granted, and a revoke waits for reads in flight. Here nobody
// serves the read, so the prefill publishes what is readable in a small
// shared file next to its cache (Table, "<cache>.grants"), and the reader
// checks it around every copy, seqlock-style:
//
//   - one 64-bit word per block id: generation<<32 | grant count. Grant
//     adds 1; Revoke subtracts 1, and when the count reaches 0 it bumps the
//     generation in the same atomic step, before Revoke returns and so
//     before the prefill reports the request finished to its engine (the
//     only point from which the engine may reuse the block); a GrantAll
//     word does the same for "every block";
//   - one slot per held request (GrantRequest/RevokeRequest, what the
//     prefill worker uses for a send that names its blocks): key = 8 bytes
//     of SHA-256 of the request id, word = generation<<32 | count as
//     above, in an open-addressing table whose keys stay put, so a reader
//     finds a request without a lock;
//   - an epoch word (random, not 0) for the owner's run: CreateTable
//     takes an existing table over in place (never unlink and recreate, so
//     a reader never keeps a stale copy): epoch 0 first, then every word
//     reset, then a new epoch. Close sets it to 0;
//   - the owner's pid and start time: Open takes a pidfd on the owner and
//     checks it is the process that wrote the table.
//
// A Read names its request (read.Batch.Request: the id DONE carries). It
// loads that request's slot (it must be held; with no slot, only a
// GrantAll lets it through), and before each op's copy the epoch (must be
// the claim's) and the words of the blocks the op covers (each must be
// granted); copies; then, after the last copy and a fence, checks that
// the request's slot and every block word kept their generation, that the
// epoch is the same, and that the owner is alive (pidfd). If all hold,
// the request was held during the whole copy, so its engine cannot have
// freed, let alone reused, its blocks; otherwise the batch fails
// (ErrNotGranted, ErrOwnerGone) and the bytes it wrote are not trusted.
// A request freed before the read's first look fails too, even when its
// blocks were already granted to another request: its own slot says so.
// A prefill restart changes the epoch (and the pid), so a read from a
// claim of the previous run always fails, and the decode re-fetches the
// metadata and re-opens.
//
// Why a table and not a server: no round trip, no socket, no thread on
// the prefill side per read; the price is that a revoke cannot wait for a
// copy in flight (the TCP engine's can), so the reader detects an
// overlapping free afterwards and fails the batch instead.
//
// What this does not cover: a send without block ids (read.grants auto
// opens every block with GrantAll, as the TCP engine does; a request with
// no slot is then read on the blocks' words alone, which cannot tell one
// request from another), read.grants off (every block granted for good),
// and two request ids whose SHA-256 share 8 bytes. With every slot held
// (4096 or twice the blocks, whichever is more) a send is refused.
//
// A truncated file cannot crash the reader: copies run with
// debug.SetPanicOnFault and a fault fails the batch (ErrFault).
//
// # Never
//
//   - Never map a file whose device, inode, size or header differs from the
//     claim, never follow a symbolic link, never open the cache file for
//     writing: the reader's mapping is PROT_READ.
//   - Never take a grant table that is not the cache file's own (its path
//     plus TableSuffix, same owner): a hostile prefill could otherwise name
//     a cache file it cannot read itself (another worker's) and have this
//     process read it as the prefill's.
//   - Never return a batch as good unless its request (when named) and
//     every block it read were granted from before its copy to after it,
//     in the claimed epoch, with the owner alive.
//   - Never unlink or replace a grant table in use; CreateTable refuses a
//     file that is not one.
//   - Never write outside the local memory given at Open (Options.Local) or
//     read outside the peer's caches.
//   - Never start goroutines; never block (a read is copies, atomic loads
//     and a non-blocking poll).
//   - Never trust a claim's fields, or the grant table's contents, to size
//     or place a copy: ops are resolved against the layout of the header
//     this process read and checked, and the memory it was given.
package shm
