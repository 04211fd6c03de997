// Package plan is part of kvflow; not built yet.
package plan
