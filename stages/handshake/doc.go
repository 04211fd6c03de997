// Package handshake is part of kvflow; not built yet.
package handshake
