package npu

import (
	"encoding/binary"
	"errors"
	"fmt"
	"hash/crc32"
)

// The shared-memory file format (version 1). All integers little-endian.
//
//	off  size  field
//	  0     8  magic "KVFLOWKV"
//	  8     4  version (1)
//	 12     4  header length covered by the checksum (128)
//	 16     4  dtype (DType)
//	 20     4  flags: bit 0 flat, bit 1 MLA, bit 2 sparse
//	 24     8  reserved, zero
//	 32    64  num_layers, num_blocks, block_size, num_kv_heads, head_dim,
//	           kv_lora_rank, qk_rope_head_dim, indexer_dim (u64 each)
//	 96     8  cache alignment (CacheAlign)
//	104     8  data offset: where cache 0 starts in the file
//	112     8  data size: Layout.Size()
//	120     8  file size: data offset + data size
//	128     4  CRC-32C of bytes [0, 128)
//
// The rest of the first page is zero. Caches follow at the data offset in
// seed order, at Layout.Offset.
const (
	shmMagic      = "KVFLOWKV"
	shmVersion    = 1
	headerLen     = 128
	headerSize    = headerLen + 4
	shmDataOffset = 2 << 20 // a huge page, so the data can be huge-page backed
)

const (
	flagFlat = 1 << iota
	flagMLA
	flagSparse
)

// Errors for a file that is not a usable kvflow cache file. Every one also
// wraps ErrBadFile.
var (
	ErrBadFile     = errors.New("npu: bad cache file")
	ErrBadMagic    = errors.New("not a kvflow cache file (bad magic)")
	ErrBadVersion  = errors.New("unsupported cache file version")
	ErrBadChecksum = errors.New("cache file header checksum mismatch")
	ErrBadSize     = errors.New("cache file size does not match its header")
)

var castagnoli = crc32.MakeTable(crc32.Castagnoli)

type header struct {
	shape      Shape
	align      uint64
	dataOffset uint64
	dataSize   uint64
	fileSize   uint64
}

func newHeader(l Layout) header {
	return header{
		shape:      l.shape,
		align:      CacheAlign,
		dataOffset: shmDataOffset,
		dataSize:   uint64(l.Size()),
		fileSize:   shmDataOffset + uint64(l.Size()),
	}
}

func (h header) encode() []byte {
	b := make([]byte, headerSize)
	le := binary.LittleEndian
	copy(b, shmMagic)
	le.PutUint32(b[8:], shmVersion)
	le.PutUint32(b[12:], headerLen)
	s := h.shape
	le.PutUint32(b[16:], uint32(s.DType))
	var flags uint32
	if s.Flat {
		flags |= flagFlat
	}
	if s.MLA {
		flags |= flagMLA
	}
	if s.Sparse {
		flags |= flagSparse
	}
	le.PutUint32(b[20:], flags)
	for i, v := range []int{s.NumLayers, s.NumBlocks, s.BlockSize, s.NumKVHeads, s.HeadDim, s.KVLoraRank, s.QKRopeHeadDim, s.IndexerDim} {
		le.PutUint64(b[32+8*i:], uint64(v))
	}
	le.PutUint64(b[96:], h.align)
	le.PutUint64(b[104:], h.dataOffset)
	le.PutUint64(b[112:], h.dataSize)
	le.PutUint64(b[120:], h.fileSize)
	le.PutUint32(b[headerLen:], crc32.Checksum(b[:headerLen], castagnoli))
	return b
}

// decodeHeader parses and checks the header of the file at path (for error
// messages only) and the layout it describes against the file's size.
func decodeHeader(path string, b []byte, fileSize int64) (header, Layout, error) {
	bad := func(kind error, format string, args ...any) (header, Layout, error) {
		return header{}, Layout{}, fmt.Errorf("%w: %s: %w: "+format, append([]any{ErrBadFile, path, kind}, args...)...)
	}
	le := binary.LittleEndian
	if len(b) < len(shmMagic) || string(b[:len(shmMagic)]) != shmMagic {
		return bad(ErrBadMagic, "first bytes %q", b[:min(len(b), len(shmMagic))])
	}
	if len(b) < headerSize {
		return bad(ErrBadSize, "%d bytes, shorter than a header (%d)", len(b), headerSize)
	}
	if v := le.Uint32(b[8:]); v != shmVersion {
		return bad(ErrBadVersion, "version %d, this kvflow reads %d", v, shmVersion)
	}
	if n := le.Uint32(b[12:]); n != headerLen {
		return bad(ErrBadVersion, "header length %d, want %d", n, headerLen)
	}
	if got, want := le.Uint32(b[headerLen:]), crc32.Checksum(b[:headerLen], castagnoli); got != want {
		return bad(ErrBadChecksum, "stored %#08x, computed %#08x", got, want)
	}
	var h header
	dt := le.Uint32(b[16:])
	flags := le.Uint32(b[20:])
	if dt > 255 || flags&^(flagFlat|flagMLA|flagSparse) != 0 || le.Uint64(b[24:]) != 0 {
		return bad(ErrBadVersion, "unknown dtype %d, flags %#x or reserved bits", dt, flags)
	}
	var dims [8]int
	for i := range dims {
		v := le.Uint64(b[32+8*i:])
		if v > 1<<31 {
			return bad(ErrBadSize, "dimension %d is %d", i, v)
		}
		dims[i] = int(v)
	}
	h.shape = Shape{
		NumLayers: dims[0], NumBlocks: dims[1], BlockSize: dims[2], DType: DType(dt),
		NumKVHeads: dims[3], HeadDim: dims[4], Flat: flags&flagFlat != 0,
		MLA: flags&flagMLA != 0, KVLoraRank: dims[5], QKRopeHeadDim: dims[6],
		Sparse: flags&flagSparse != 0, IndexerDim: dims[7],
	}
	h.align = le.Uint64(b[96:])
	h.dataOffset = le.Uint64(b[104:])
	h.dataSize = le.Uint64(b[112:])
	h.fileSize = le.Uint64(b[120:])
	// Before anything is sized by the header (a peer's, over hw/shm, may
	// be hostile with a matching checksum): the layout allocates one
	// offset per cache, and data offset + size must not wrap.
	if h.shape.NumLayers > maxFileLayers {
		return bad(ErrBadSize, "%d layers, at most %d", h.shape.NumLayers, maxFileLayers)
	}
	if h.dataOffset > maxBytes || h.dataSize > maxBytes || h.fileSize > 2*maxBytes {
		return bad(ErrBadSize, "data offset %d, size %d or file size %d above 2^50", h.dataOffset, h.dataSize, h.fileSize)
	}
	l, err := NewLayout(h.shape)
	if err != nil {
		return header{}, Layout{}, fmt.Errorf("%w: %s: %w", ErrBadFile, path, err)
	}
	if h.align != CacheAlign || h.dataOffset < headerSize || h.dataOffset%4096 != 0 {
		return bad(ErrBadVersion, "cache alignment %d, data offset %d", h.align, h.dataOffset)
	}
	if h.dataSize != uint64(l.Size()) || h.fileSize != h.dataOffset+h.dataSize {
		return bad(ErrBadSize, "header says data %d bytes at %d in a %d-byte file; the shape needs %d", h.dataSize, h.dataOffset, h.fileSize, l.Size())
	}
	if fileSize != int64(h.fileSize) {
		return bad(ErrBadSize, "file is %d bytes, header says %d", fileSize, h.fileSize)
	}
	return h, l, nil
}

// maxFileLayers bounds a cache file's layer count (real models have a
// few hundred): a header's shape sizes the layout's tables.
const maxFileLayers = 1 << 16

// HeaderSize is the length of a cache file's header (the bytes its
// checksum covers plus the checksum), the bytes FileHeader.Raw holds.
const HeaderSize = headerSize

// FileHeader is what a cache file's header says, for a reader that maps
// the file itself (hw/shm): the layout, where the caches start, the
// file's size and the header's bytes as stored.
type FileHeader struct {
	Layout     Layout
	DataOffset int64
	FileSize   int64
	Raw        []byte // HeaderSize bytes
}

// ParseFileHeader checks b, the first bytes of the cache file at path (for
// error messages only) whose size is fileSize, as OpenShm does, and
// returns what it describes. Errors wrap ErrBadFile.
func ParseFileHeader(path string, b []byte, fileSize int64) (FileHeader, error) {
	h, l, err := decodeHeader(path, b, fileSize)
	if err != nil {
		return FileHeader{}, err
	}
	return FileHeader{Layout: l, DataOffset: int64(h.dataOffset), FileSize: int64(h.fileSize), Raw: append([]byte(nil), b[:headerSize]...)}, nil
}
