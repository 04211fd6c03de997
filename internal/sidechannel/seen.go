package sidechannel

import "sync"

// seenCap bounds the DONE-batch message ids a server remembers. A retry
// follows its first send within the client's attempts (seconds), while
// 65,536 messages take a busy prefill worker minutes, so a retry always
// finds its id; 65,536 × ~24 bytes stays under 2 MiB.
const seenCap = 1 << 16

// seenIDs remembers the last seenCap message ids, oldest evicted first.
type seenIDs struct {
	mu   sync.Mutex
	set  map[uint64]struct{}
	ring []uint64 // insertion order; next is the slot to overwrite
	next int
}

// add records id and reports whether it was new.
func (s *seenIDs) add(id uint64) bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	if _, ok := s.set[id]; ok {
		return false
	}
	if s.set == nil {
		s.set = make(map[uint64]struct{})
	}
	if len(s.ring) < seenCap {
		s.ring = append(s.ring, id)
	} else {
		delete(s.set, s.ring[s.next])
		s.ring[s.next] = id
		s.next = (s.next + 1) % seenCap
	}
	s.set[id] = struct{}{}
	return true
}
