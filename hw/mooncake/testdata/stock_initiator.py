"""Stock Mooncake initiator for TestStockMooncakeInitiator.

Mooncake's own Python engine (TCP transport, P2PHANDSHAKE) reads from a
kvflow target: one op per size with transfer_sync_read, then one batch of
BATCH_COUNT ops with batch_transfer_sync_read, run by THREADS threads at
once (default 1), each into its own copy. With the connection pool off
(Mooncake's default) every op is a new connection, and a batch's are
opened all at once. Prints the SHA-256 of the bytes read, in op order
(the sizes, then the first thread's batch), for the Go test to compare;
exits non-zero when another thread's copy differs from the first's.

usage: stock_initiator.py SESSION REMOTE_ADDR SIZES BATCH_BLOCK BATCH_COUNT [THREADS]
"""

import ctypes
import hashlib
import mmap
import sys
import threading

from mooncake.engine import TransferEngine


def main():
    session, remote = sys.argv[1], int(sys.argv[2])
    sizes = [int(s) for s in sys.argv[3].split(",")]
    block, count = int(sys.argv[4]), int(sys.argv[5])
    threads = int(sys.argv[6]) if len(sys.argv) > 6 else 1
    head = sum(sizes)
    total = head + threads * block * count
    buf = mmap.mmap(-1, total)
    addr = ctypes.addressof(ctypes.c_char.from_buffer(buf))
    engine = TransferEngine()
    if engine.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") != 0:
        sys.exit("initialize failed")
    if engine.register_memory(addr, total) != 0:
        sys.exit("register_memory failed")
    off = 0
    for n in sizes:  # remote ranges back to back from remote
        if engine.transfer_sync_read(session, addr + off, remote + off, n) != 0:
            sys.exit(f"transfer_sync_read of {n} bytes failed")
        off += n
    peers = [remote + head + i * block for i in range(count)]
    failed = []

    def read(t):
        base = addr + head + t * block * count
        bufs = [base + i * block for i in range(count)]
        if engine.batch_transfer_sync_read(session, bufs, peers, [block] * count) != 0:
            failed.append(t)

    workers = [threading.Thread(target=read, args=(t,)) for t in range(threads)]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    if failed:
        sys.exit(f"batch_transfer_sync_read of {count} ops failed in threads {sorted(failed)}")
    first = buf[head:head + block * count]
    for t in range(1, threads):
        start = head + t * block * count
        if buf[start:start + block * count] != first:
            sys.exit(f"thread {t} read other bytes than thread 0")
    print(hashlib.sha256(buf[:head + block * count]).hexdigest())
    sys.stdout.flush()


if __name__ == "__main__":
    main()
