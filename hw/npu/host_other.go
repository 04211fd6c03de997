//go:build !linux

package npu

import (
	"errors"
	"fmt"
)

// NewHost needs Linux (mmap, MAP_HUGETLB, fallocate).
func NewHost(l Layout, opts HostOptions) (*Host, error) {
	return nil, fmt.Errorf("npu: host backend: %w", errors.ErrUnsupported)
}

// CreateShm needs Linux.
func CreateShm(path string, l Layout, opts HostOptions) (*Host, error) {
	return nil, fmt.Errorf("npu: host backend: %w", errors.ErrUnsupported)
}

// OpenShm needs Linux.
func OpenShm(path string, opts HostOptions) (*Host, error) {
	return nil, fmt.Errorf("npu: host backend: %w", errors.ErrUnsupported)
}

func munmap([]byte) error { return nil }

func lockMemory([]byte) error { return errors.ErrUnsupported }
