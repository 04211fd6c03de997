package sidechannel

import "sync"

// seenCap bounds the DONE-batch message ids a server remembers. A retry
// follows its first send within the client's attempts (seconds), while
// 65,536 messages take a busy prefill worker minutes, so a retry always
// finds its id; 65,536 ids stay under 2 MiB.
const seenCap = 1 << 16

// seenIDs remembers the last seenCap message ids handed over, oldest
// evicted first, with the reply each got when it was not "ACK" (a handler
// panic's "ERR internal error"), so a repeat is answered as the first was.
type seenIDs struct {
	mu    sync.Mutex
	reply map[uint64][]byte // nil: ACK
	ring  []uint64          // insertion order; next is the slot to overwrite
	next  int
}

// check reports whether id was seen, with its reply (nil: ACK); an unseen
// id is recorded, answered ACK unless answered says otherwise.
func (s *seenIDs) check(id uint64) (reply []byte, seen bool) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if r, ok := s.reply[id]; ok {
		return r, true
	}
	if s.reply == nil {
		s.reply = make(map[uint64][]byte)
	}
	if len(s.ring) < seenCap {
		s.ring = append(s.ring, id)
	} else {
		delete(s.reply, s.ring[s.next])
		s.ring[s.next] = id
		s.next = (s.next + 1) % seenCap
	}
	s.reply[id] = nil
	return nil, false
}

// answered records the reply id got, if it is still remembered.
func (s *seenIDs) answered(id uint64, reply []byte) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if _, ok := s.reply[id]; ok {
		s.reply[id] = reply
	}
}
