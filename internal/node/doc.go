// Package node assembles one kvflow worker from its parts: the KV-cache
// device (an npu.Device: hw/npu host memory, anonymous or a shared-memory
// file), the transfer engine (a mooncake.Engine: hw/mooncake's TCP engine,
// or Mooncake's own through hw/mooncake/mooncakec in a binary built with
// -tags mooncake (backends_mooncake.go); caches registered), the ZMQ side channel (one context per process) and
// the role — decode's pull pipeline or prefill's side-channel server and
// tracker.
//
// Backends are chosen by config in backends.go (openDevice, openEngine)
// and held as interfaces; what only some engines can do (read grants,
// data-plane authentication, peer buffers, and the read stage's strided
// and gathered reads through stages/read.Engine) is resolved once, at
// Start; what the configured backend cannot do of what the config asks is
// logged at warn there (config.BackendFallbacks). Adding a transfer backend: its package (implementing
// mooncake.Engine and the optional interfaces it can), a case in
// openEngine, and the name in internal/config's node.te_backend
// validation. node.te_backend shm is the TCP engine plus same-host reads
// (samehost.go): a prefill keeps hw/shm's grant table beside the engine's
// grants and publishes its claim in the metadata; a decode's transfer is
// sameHost, which every GET_META reply passes through (fetcher), reading
// the peers whose claim holds from their mapped cache files and all others
// over TCP. Adding a memory backend: its npu.Device implementation, a
// case in openDevice, and the name in internal/config's cache.mode.
//
// Start either returns a running node or releases everything it opened;
// Close shuts down in reverse order after draining the role. The package
// only wires: every behaviour, address arithmetic included, lives in the
// packages it assembles.
package node
