// Package bench is part of kvflow; not built yet.
package bench
