"""Stock Mooncake initiator for TestStockMooncakeInitiator.

Mooncake's own Python engine (TCP transport, P2PHANDSHAKE) reads from a
kvflow target: one op per size with transfer_sync_read, then one batch of
128 ops with batch_transfer_sync_read. With the connection pool off
(Mooncake's default) every op is a new connection. Prints the SHA-256 of
the bytes read, in op order, for the Go test to compare.

usage: stock_initiator.py SESSION REMOTE_ADDR SIZES BATCH_BLOCK BATCH_COUNT
"""

import ctypes
import hashlib
import mmap
import sys

from mooncake.engine import TransferEngine


def main():
    session, remote = sys.argv[1], int(sys.argv[2])
    sizes = [int(s) for s in sys.argv[3].split(",")]
    block, count = int(sys.argv[4]), int(sys.argv[5])
    total = sum(sizes) + block * count
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
    bufs = [addr + off + i * block for i in range(count)]
    peers = [remote + off + i * block for i in range(count)]
    if engine.batch_transfer_sync_read(session, bufs, peers, [block] * count) != 0:
        sys.exit("batch_transfer_sync_read failed")
    print(hashlib.sha256(buf[:total]).hexdigest())
    sys.stdout.flush()


if __name__ == "__main__":
    main()
