// Package mooncake is part of kvflow; not built yet.
package mooncake
