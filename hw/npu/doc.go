// Package npu is part of kvflow; not built yet.
package npu
