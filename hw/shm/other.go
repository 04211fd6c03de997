//go:build !linux

package shm

import (
	"context"
	"os"

	"github.com/kvflow/kvflow/hw/npu"
)

// Table is the grant table (Linux only).
type Table struct{}

// CreateTable is not supported off Linux.
func CreateTable(string, int, os.FileMode) (*Table, error) { return nil, ErrUnsupported }

func (*Table) Path() string                      { return "" }
func (*Table) Epoch() uint64                     { return 0 }
func (*Table) Identity() (uint64, uint64)        { return 0, 0 }
func (*Table) Grant([]int) error                 { return ErrUnsupported }
func (*Table) Revoke([]int) error                { return ErrUnsupported }
func (*Table) GrantAll() error                   { return ErrUnsupported }
func (*Table) RevokeAll() error                  { return ErrUnsupported }
func (*Table) GrantRequest(string, []int) error  { return ErrUnsupported }
func (*Table) RevokeRequest(string, []int) error { return ErrUnsupported }
func (*Table) Close(bool) error                  { return nil }
func MakeClaim(string, *Table) (Claim, error)    { return Claim{}, ErrUnsupported }

// HostMemory is unknown off Linux.
func HostMemory() uint64 { return ^uint64(0) }

type Options struct {
	HostID    string
	BaseAddrs []uint64
	Local     [][]byte
}
type Op struct{ Local, Remote, Len uint64 }
type Stride struct {
	Row, Pitch uint64
	Gather     bool
}
type Reader struct{}

func Open(Claim, Options) (*Reader, error)               { return nil, ErrUnsupported }
func (*Reader) Layout() npu.Layout                       { return npu.Layout{} }
func (*Reader) Read(context.Context, []Op, Stride) error { return ErrUnsupported }
func (*Reader) Close() error                             { return nil }
