package pyrandom

import (
	"errors"
	"fmt"
	"math/bits"
)

const (
	n         = 624
	m         = 397
	matrixA   = 0x9908b0df
	upperMask = 0x80000000
	lowerMask = 0x7fffffff
)

// ErrSample is returned (wrapped) by Sample for arguments CPython rejects.
var ErrSample = errors.New("pyrandom: sample larger than population or is negative")

// Random is CPython's Mersenne Twister state. The zero value is not seeded;
// use New or Seed.
type Random struct {
	mt    [n]uint32
	index int
}

// New returns a generator in the state of CPython's random.Random(seed).
func New(seed uint64) *Random {
	r := new(Random)
	r.Seed(seed)
	return r
}

// Seed puts r in the state of CPython's random.Random(seed) for a
// non-negative int seed: the key is the seed's 32-bit words, least
// significant first, as many as its bit length needs (one word, 0, for 0).
func (r *Random) Seed(seed uint64) {
	lo, hi := uint32(seed), uint32(seed>>32)
	if hi == 0 {
		key := [1]uint32{lo}
		r.initByArray(key[:])
		return
	}
	key := [2]uint32{lo, hi}
	r.initByArray(key[:])
}

// SeedWords seeds r with init_by_array(key) exactly as CPython does for an
// integer whose 32-bit words (least significant first) are key. An empty key
// is treated as [0].
func (r *Random) SeedWords(key []uint32) {
	if len(key) == 0 {
		key = []uint32{0}
	}
	r.initByArray(key)
}

func (r *Random) initGenrand(s uint32) {
	mt := &r.mt
	mt[0] = s
	for i := 1; i < n; i++ {
		mt[i] = 1812433253*(mt[i-1]^(mt[i-1]>>30)) + uint32(i)
	}
	r.index = n
}

func (r *Random) initByArray(key []uint32) {
	r.initGenrand(19650218)
	mt := &r.mt
	i, j := 1, 0
	k := n
	if len(key) > k {
		k = len(key)
	}
	for ; k > 0; k-- {
		mt[i] = (mt[i] ^ ((mt[i-1] ^ (mt[i-1] >> 30)) * 1664525)) + key[j] + uint32(j)
		i++
		j++
		if i >= n {
			mt[0] = mt[n-1]
			i = 1
		}
		if j >= len(key) {
			j = 0
		}
	}
	for k = n - 1; k > 0; k-- {
		mt[i] = (mt[i] ^ ((mt[i-1] ^ (mt[i-1] >> 30)) * 1566083941)) - uint32(i)
		i++
		if i >= n {
			mt[0] = mt[n-1]
			i = 1
		}
	}
	mt[0] = 0x80000000
}

// Uint32 is CPython's genrand_uint32: the next 32-bit output.
func (r *Random) Uint32() uint32 {
	mt := &r.mt
	if r.index >= n {
		var kk int
		for kk = 0; kk < n-m; kk++ {
			y := (mt[kk] & upperMask) | (mt[kk+1] & lowerMask)
			mt[kk] = mt[kk+m] ^ (y >> 1) ^ (matrixA * (y & 1))
		}
		for ; kk < n-1; kk++ {
			y := (mt[kk] & upperMask) | (mt[kk+1] & lowerMask)
			mt[kk] = mt[kk+(m-n)] ^ (y >> 1) ^ (matrixA * (y & 1))
		}
		y := (mt[n-1] & upperMask) | (mt[0] & lowerMask)
		mt[n-1] = mt[m-1] ^ (y >> 1) ^ (matrixA * (y & 1))
		r.index = 0
	}
	y := mt[r.index]
	r.index++
	y ^= y >> 11
	y ^= (y << 7) & 0x9d2c5680
	y ^= (y << 15) & 0xefc60000
	y ^= y >> 18
	return y
}

// GetRandBits is getrandbits(k) for 0 <= k <= 32: the top k bits of one
// 32-bit output (0 without consuming output for k == 0, as CPython does).
// It panics for k outside [0, 32]; callers in this module never pass one.
func (r *Random) GetRandBits(k int) uint32 {
	if k < 0 || k > 32 {
		panic(fmt.Sprintf("pyrandom: GetRandBits(%d) outside [0, 32]", k))
	}
	if k == 0 {
		return 0
	}
	return r.Uint32() >> (32 - k)
}

// RandBelow is _randbelow_with_getrandbits(n) for 0 < n <= 2^32: draw
// getrandbits(n.bit_length()) until the value is below n.
func (r *Random) RandBelow(n uint64) uint64 {
	k := bits.Len64(n)
	v := uint64(r.GetRandBits(k))
	for v >= n {
		v = uint64(r.GetRandBits(k))
	}
	return v
}

// MaxPopulation is the largest n Sample accepts (RandBelow draws at most 32
// bits at a time, as CPython does for such n).
const MaxPopulation = 1 << 32

// SetSize is CPython's sample() threshold: the pool branch is used when
// n <= SetSize(k), the set branch otherwise. 21 plus 4**ceil(log(3k, 4))
// when k > 5; the power is computed exactly in integers (3k is never a power
// of 4, so CPython's float log never lands on the integer boundary).
func SetSize(k int) int {
	s := 21
	if k > 5 {
		p := 1
		for p < 3*k {
			p *= 4
		}
		s += p
	}
	return s
}

// Sample is random.Random.sample(range(n), k): k distinct values of
// [0, n) in CPython's selection order. It returns an error wrapping
// ErrSample where CPython raises ValueError, and one for n above
// MaxPopulation.
func (r *Random) Sample(n, k int) ([]int, error) {
	out := make([]int, 0, max(k, 0))
	return r.AppendSample(out, n, k)
}

// AppendSample is Sample appending to dst.
func (r *Random) AppendSample(dst []int, n, k int) ([]int, error) {
	if n < 0 || k < 0 || k > n {
		return dst, fmt.Errorf("%w (n=%d, k=%d)", ErrSample, n, k)
	}
	if uint64(n) > MaxPopulation {
		return dst, fmt.Errorf("pyrandom: population %d above %d", n, uint64(MaxPopulation))
	}
	if n <= SetSize(k) {
		var small [64]int
		var pool []int
		if n <= len(small) {
			pool = small[:n]
		} else {
			pool = make([]int, n)
		}
		for i := range pool {
			pool[i] = i
		}
		for i := 0; i < k; i++ {
			j := int(r.RandBelow(uint64(n - i)))
			dst = append(dst, pool[j])
			pool[j] = pool[n-i-1]
		}
		return dst, nil
	}
	// Set branch: rejection against the values already selected. The set
	// holds at most k values; membership is all that matters.
	seen := make(map[int]struct{}, k)
	for i := 0; i < k; i++ {
		j := int(r.RandBelow(uint64(n)))
		for {
			if _, dup := seen[j]; !dup {
				break
			}
			j = int(r.RandBelow(uint64(n)))
		}
		seen[j] = struct{}{}
		dst = append(dst, j)
	}
	return dst, nil
}
