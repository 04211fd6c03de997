// Package notify is part of kvflow; not built yet.
package notify
