// Package mooncakec is the cgo binding to Mooncake's transfer engine C API
// (transfer_engine_c.h): a [github.com/kvflow/kvflow/hw/mooncake.Engine]
// over Mooncake's own transports, for RDMA and Ascend deployments.
//
// It is compiled only with the build tag "mooncake" and cgo, against an
// installed Mooncake (hw/mooncake/README.md gives the flags); without the
// tag this package is empty and default builds never need Mooncake. It is
// a package of its own because Go refuses to build a package that has both
// cgo files and Go assembly, and hw/mooncake has assembly.
//
// CI type-checks it on every run against testdata/include, a stub of the
// header that declares what the binding calls (make vet-mooncake), so a
// change to hw/mooncake that breaks it is caught without Mooncake.
//
// # Contract
//
// [CgoEngine] keeps hw/mooncake's Engine contract: registered regions are
// checked by the same table the TCP engine uses (hw/mooncake.Regions), a
// batch returns nil only when every op completed and otherwise a
// *mooncake.BatchError, and a batch never returns while Mooncake may still
// touch its local memory. Mooncake cannot cancel a submitted transfer, so a
// cancelled context is reported only once every task is final. Completion
// is polled with an exponential sleep, never a spin. A peer's segment is
// opened once and kept; a batch with a failed op makes the next batch to
// that peer re-fetch its descriptor (openSegmentNoCache), so a peer that
// restarted under the same name (same RPC port) is read with its new
// buffers and data port.
//
// It must never hand Mooncake Go-managed memory (Mooncake keeps the
// pointers), and it has no strided reads and no read grants: the node
// leaves the transpose to the stitch kernel with it, as the seed does.
package mooncakec
