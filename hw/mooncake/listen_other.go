//go:build !linux

package mooncake

import "net"

// listenConfig is net's default elsewhere: TCP_NODELAY and keep-alive set
// on each accepted connection.
func listenConfig() net.ListenConfig { return net.ListenConfig{} }
