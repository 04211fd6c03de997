//go:build !(mooncake && cgo)

package config

// MooncakeBuilt reports whether this binary was built with -tags mooncake
// (and cgo), so that node.te_backend mooncake can run. This one was not:
// Validate rejects the backend with ErrMooncakeNotBuilt.
const MooncakeBuilt = false
