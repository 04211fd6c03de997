// Package pyrandom reproduces, bit for bit, the parts of CPython's random
// module that the seed's rank choice uses: random.Random(seed) for a
// non-negative integer seed (MT19937 seeded by init_by_array over the
// integer's 32-bit words, least significant first), getrandbits(k) for
// k <= 32, _randbelow(n) (rejection sampling on getrandbits(n.bit_length()))
// and sample(range(n), k) with both of its branches (pool and set).
//
// It is checked against vectors produced by CPython 3.11 and, in tests, against
// a live python3 when one is on PATH. The package is pure: no I/O, no
// goroutines, no global state; a Random is not safe for concurrent use.
package pyrandom
