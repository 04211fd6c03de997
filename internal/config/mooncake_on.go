//go:build mooncake && cgo

package config

// MooncakeBuilt reports whether this binary was built with -tags mooncake
// (and cgo), so that node.te_backend mooncake can run: internal/node then
// links hw/mooncake/mooncakec, the binding to Mooncake's C API.
const MooncakeBuilt = true
