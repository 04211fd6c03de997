package wire

import "bytes"

// Keys of the "kvflow"."same_host" map, in the order AppendMetadata
// writes them.
const (
	keySameHost  = "same_host"
	keySHHost    = "host"
	keySHPath    = "path"
	keySHDev     = "dev"
	keySHIno     = "ino"
	keySHSize    = "size"
	keySHHeader  = "header"
	keySHGrants  = "grants"
	keySHGDev    = "grants_dev"
	keySHGIno    = "grants_ino"
	keySHEpoch   = "epoch"
	maxSHString  = 4096 // PATH_MAX
	maxSHHeader  = 4096 // a page: the cache file header lies in its first
	sameHostKeys = 10
)

// SameHost is a prefill worker's same-host claim (hw/shm.Claim; see the
// package docs for the fields' encoding): the host it runs on, its cache
// file's path and identity, and the grant table guarding it. A receiver
// trusts none of it (hw/shm.Open checks each field against what it opens).
type SameHost struct {
	HostID               string
	Path                 string
	Dev, Ino, Size       uint64
	Header               []byte
	Grants               string
	GrantsDev, GrantsIno uint64
	Epoch                uint64
}

func appendSameHost(dst []byte, s *SameHost) []byte {
	dst = appendMapLen(dst, sameHostKeys)
	dst = appendStr(appendStr(dst, keySHHost), s.HostID)
	dst = appendStr(appendStr(dst, keySHPath), s.Path)
	dst = appendUint(appendStr(dst, keySHDev), s.Dev)
	dst = appendUint(appendStr(dst, keySHIno), s.Ino)
	dst = appendUint(appendStr(dst, keySHSize), s.Size)
	dst = appendBin(appendStr(dst, keySHHeader), string(s.Header))
	dst = appendStr(appendStr(dst, keySHGrants), s.Grants)
	dst = appendUint(appendStr(dst, keySHGDev), s.GrantsDev)
	dst = appendUint(appendStr(dst, keySHGIno), s.GrantsIno)
	dst = appendUint(appendStr(dst, keySHEpoch), s.Epoch)
	return dst
}

// sameHost decodes the "same_host" map: every field required, once; host,
// path and grants non-empty strings of at most 4096 bytes; header bin of
// 1 to 4096 bytes; size and epoch at least 1; unknown keys skipped.
func (r *reader) sameHost(parent string) (*SameHost, error) {
	start := r.off
	n, err := r.mapLen(parent)
	if err != nil {
		return nil, err
	}
	s := &SameHost{}
	seen := map[string]bool{}
	str := func(field string, dst *string) error {
		at := r.off
		v, err := r.str(field)
		if err == nil && (v == "" || len(v) > maxSHString) {
			r.off = at
			return r.errf(field, "%d bytes, want 1..%d", len(v), maxSHString)
		}
		*dst = v
		return err
	}
	num := func(field string, dst *uint64, lo uint64) error {
		at := r.off
		v, err := r.uint(field)
		if err == nil && v < lo {
			r.off = at
			return r.errf(field, "%d, want at least %d", v, lo)
		}
		*dst = v
		return err
	}
	for i := 0; i < n; i++ {
		key, err := r.str(parent + " key")
		if err != nil {
			return nil, err
		}
		field := parent + "." + key
		known := true
		switch key {
		case keySHHost:
			err = str(field, &s.HostID)
		case keySHPath:
			err = str(field, &s.Path)
		case keySHGrants:
			err = str(field, &s.Grants)
		case keySHDev:
			err = num(field, &s.Dev, 0)
		case keySHIno:
			err = num(field, &s.Ino, 0)
		case keySHSize:
			err = num(field, &s.Size, 1)
		case keySHGDev:
			err = num(field, &s.GrantsDev, 0)
		case keySHGIno:
			err = num(field, &s.GrantsIno, 0)
		case keySHEpoch:
			err = num(field, &s.Epoch, 1)
		case keySHHeader:
			at := r.off
			var h []byte
			if h, err = r.bin(field); err == nil && (len(h) == 0 || len(h) > maxSHHeader) {
				r.off = at
				err = r.errf(field, "%d bytes, want 1..%d", len(h), maxSHHeader)
			}
			s.Header = bytes.Clone(h)
		default:
			known = false
			err = r.skip(field, 3)
		}
		if err != nil {
			return nil, err
		}
		if known {
			if seen[key] {
				return nil, r.errf(field, "duplicate key")
			}
			seen[key] = true
		}
	}
	if len(seen) != sameHostKeys {
		for _, k := range []string{keySHHost, keySHPath, keySHDev, keySHIno, keySHSize, keySHHeader, keySHGrants, keySHGDev, keySHGIno, keySHEpoch} {
			if !seen[k] {
				r.off = start
				return nil, r.errf(parent, "missing required field %q", k)
			}
		}
	}
	return s, nil
}
