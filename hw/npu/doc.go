// Package npu owns a kvflow worker's KV-cache memory: its layout, its
// allocation (or attachment to the serving engine's), its registration with
// a transfer engine, and the stitch kernel that re-interleaves heads after a
// split pull.
//
// # Layout
//
// A worker's cache is NumLayers × NumParts cache tensors of NumBlocks blocks
// each (Shape → NewLayout → Layout):
//
//   - GQA/MHA: 2 parts per layer, K and V, each [num_blocks, block_size,
//     heads, head_dim] (or the flat [num_blocks, block_size, heads*head_dim];
//     same bytes).
//   - MLA: 2 parts per layer, [.., 1, kv_lora_rank] and [.., 1, qk_rope_head_dim].
//   - Sparse (MLA + indexer): 3 parts, MLA's two and [.., 1, indexer_dim].
//
// block_len of a part is block_size × heads × dim × element size, exactly as
// the seed's register_kv_caches computes it (which uses part 0's element size
// for every part; a Shape has one DType). Layout.BlockLens is the seed's
// self.block_len list: one entry for GQA (K and V share it), two for MLA,
// three for Sparse. The caches are numbered, and BaseAddrs/Regions are
// ordered, as the seed builds kv_caches_base_addr: layer-major, part-minor
// (L0.K, L0.V, L1.K, ...), so cache k is of part k % NumParts, which is how
// _transfer_kv_cache picks block_len[k % 2] / [k % 3]. The tests check this
// against a port of register_kv_caches and against every read recorded in
// transfer_kv_cache.json.
//
// One deliberate difference: the seed detects MLA by the two parts having
// different widths, so an MLA model with kv_lora_rank == qk_rope_head_dim
// would be seen as GQA with one block_len entry. The lengths, addresses and
// reads are the same either way; kvflow reports two entries.
//
// # Host backend
//
// Host keeps every cache in one mmap'd allocation, caches back to back in
// seed order, each CacheAlign-aligned:
//
//   - NewHost: anonymous private memory. MAP_HUGETLB is tried first (it needs
//     reserved huge pages), then normal pages with MADV_HUGEPAGE; both fall
//     back silently (HugeTLB reports which).
//   - CreateShm: a shared-memory file (put it under /dev/shm) that the serving
//     engine maps too. A 132-byte header (magic "KVFLOWKV", version, shape,
//     sizes, CRC-32C; see header.go) leads the first page; the caches start
//     at a 2 MiB-aligned data offset. The file is fully allocated, written
//     under a temporary name and published with link(2), so it appears
//     complete and never replaces an existing file by accident.
//     The creating Host owns the file: an exclusive flock (internal/pidlock)
//     taken before the file appears, held until Close, dropped by the
//     kernel when the process dies however it dies. A file already at the
//     path whose owner is alive is refused (ErrInUse, naming the owner's
//     pid); one a dead owner left (SIGKILL, OOM kill, crash) is reclaimed
//     without a person: in place when its header is valid and of the same
//     shape (same file, contents kept), replaced when it is a valid kvflow
//     file of another shape (the configuration changed), refused
//     (ErrBadFile) when it is not a kvflow cache file (a typo'd path must
//     never cost someone else's file). Reclaimed says which happened.
//     An engine that maps the file is deliberately not an owner: it takes
//     no lock, so a restarted worker takes its file back while the engine
//     keeps running, and reclaiming in place (never unlink and recreate)
//     keeps the engine's mapping and the worker's on the same memory; a
//     new file would leave the engine reading blocks the worker never
//     wrote.
//   - OpenShm: attach to such a file (another process's, typically) and get
//     the layout from its header. A file with the wrong magic, version,
//     checksum or size, or a shape other than HostOptions.Expect, is
//     rejected with an error wrapping ErrBadFile (and ErrBadMagic,
//     ErrBadVersion, ErrBadChecksum, ErrBadSize or ErrInvalidShape); it is
//     read, never written.
//
// Every backend locks its caches in memory as they are touched (mlock2
// MLOCK_ONFAULT; HostOptions.NoLock opts out), as an RDMA registration
// pins them: a page once in stays, and reclaim never unmaps it. On this project's test
// machine a DAMON pageout scheme unmapped cold cache pages between
// transfers, and the decode workers spent ~6 % of their CPU re-faulting
// them; locked, under 1 %. A lock the process's RLIMIT_MEMLOCK refuses is
// reported by Locked and the memory stays usable, pageable.
//
// Addresses (BaseAddrs, Regions) are this process's virtual addresses, as the
// transfer engine and the handshake expect. Register them with any engine
// through the one-method Registrar (RegisterAll); npu imports no engine.
//
// # Stitch
//
// With tp_num_need_pulls = P > 1, a decode rank pulls each block from P
// prefill ranks, each slice of block_len/P bytes landing side by side, so a
// block holds [P][block_size][heads/P · head_dim]. Stitch(ctx, blockIDs, P)
// rewrites every listed block of every layer and part to
// [block_size][heads][head_dim]: the result of the seed's _cat_kv_cache
// (paged_cache_load, _transpose_kv_cache_between_head, reshape_and_cache),
// checked against every head_transpose.json case. It runs in place, block by
// block: a sequential copy of the block into a per-worker scratch buffer,
// then a gather of each token row back from the P planes, so the strided
// work stays in L2. Items (one block of one cache) are shared by at most
// StitchWorkers goroutines (GOMAXPROCS by default), all finished before
// Stitch returns.
//
// Contract of Stitch, for every backend:
//   - It validates the whole request before it touches memory: P >= 1;
//     P == 1 or a GQA layout (MLA and sparse caches are pulled whole); every
//     part's heads × head_dim divisible by P (the seed's view(.., P,
//     block_size, -1), so a slice may split a head, as in the seed); block ids
//     in [0, num_blocks) and distinct. A bad request returns an error wrapping
//     ErrInvalidStitch and changes nothing.
//   - P == 1 and an empty block list are valid no-ops.
//   - Blocks not listed, and the padding between caches, are never written.
//   - If ctx is done before it starts, nothing changes. If ctx is cancelled
//     while it runs, it stops claiming blocks and returns an error wrapping
//     ctx.Err(); each block is then either fully stitched or untouched, but
//     the set is unspecified: treat the request as failed (re-pull it).
//   - Calls on disjoint block sets may run concurrently; calls on the same
//     blocks must not (each would permute the other's data).
//
// # Accelerator backends
//
// An Ascend (ACL/CANN) or CUDA backend implements Device over device memory:
// Layout and BaseAddrs from the same Layout (device pointers in seed order),
// Regions for the transfer engine's device-memory registration, Bytes
// returning nil (no host view), Stitch as a device kernel with the contract
// above (a gather of rows [t][q] ← [q][t] into a scratch block and a copy
// back, or the seed's paged_cache_load / reshape_and_cache pair), and Close
// freeing the memory. StitchMemory and StitchBlock are the reference any
// backend's kernel is tested against.
//
// # Fingerprint
//
// Layout.Fingerprint is everything about a cache that changes its bytes or
// the address arithmetic of a read (kind, dtype, block size, heads and
// dims, layers, each part's block_len, num_blocks); the caller adds the
// instance sizes and rank its configuration states. Prefill workers send
// it with their metadata and decode workers compare it with the cache
// their reads assume (package handshake), so a peer shaped otherwise is
// refused before any byte moves.
//
// # Never
//
//   - Never reorder kv_caches_base_addr or compute block_len other than the
//     seed does: a seed peer and a kvflow peer must agree on every address.
//   - Never touch memory before a request is validated, and never write a
//     block that was not listed.
//   - Never write to, truncate or remove a file this process attached to;
//     remove a file only if this Host created it with RemoveOnClose.
//   - Never replace a file at CreateShm's path that a live process owns or
//     that is not a kvflow cache file; never reclaim a dead owner's file of
//     the same shape other than in place.
//   - Never start goroutines that outlive a call, or more than the bound.
//   - Never import a transfer engine (hw/mooncake) or use cgo here; accelerator
//     backends live in their own packages behind build tags.
//   - Never use a slice or address from Bytes, Block, Data, BaseAddrs or
//     Regions after Close (the memory is unmapped).
package npu
