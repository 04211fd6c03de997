//go:build !linux

package mooncake

import "errors"

// countFDs is Linux-only; elsewhere the descriptor reserve is not checked
// (the connection caps still apply).
func countFDs() (int, error) { return 0, errors.New("counting open descriptors needs /proc (linux)") }
