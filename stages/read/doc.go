// Package read is part of kvflow; not built yet.
package read
