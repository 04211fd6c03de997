// Package stitch is part of kvflow; not built yet.
package stitch
