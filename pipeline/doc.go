// Package pipeline is part of kvflow; not built yet.
package pipeline
