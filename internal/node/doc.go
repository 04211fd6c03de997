// Package node assembles one kvflow worker from its parts: the KV-cache
// device (hw/npu host memory, anonymous or a shared-memory file), the
// transfer engine (hw/mooncake's TCP engine, caches registered), the ZMQ
// side channel (one context per process) and the role — decode's pull
// pipeline or prefill's side-channel server and tracker.
//
// Start either returns a running node or releases everything it opened;
// Close shuts down in reverse order after draining the role. The package
// only wires: every behaviour lives in the packages it assembles.
package node
