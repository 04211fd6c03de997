#!/usr/bin/python3
"""The seed's prefill worker side on Mooncake's Python engine, for kvflow's
tests with Mooncake: what vllm-ascend's mooncake_connector.py does on a
kv_producer rank, less vLLM. Needs Mooncake's Python module (PYTHONPATH:
$MOONCAKE_PY), kvflow's Python client (clients/python) and python3-zmq,
python3-msgpack, python3-numpy.

  seedprefill.py CACHE_FILE ENGINE_ID

Maps the kvflow cache file CACHE_FILE (filled by the test), starts a
TransferEngine as the seed's global_te does (P2PHANDSHAKE; protocol tcp
here, ascend in the seed), registers each cache tensor in one
batch_register_memory call with the seed's region lengths
(num_blocks * block_len), and serves the seed's side channel with the
metadata {engine_id, te_rpc_port, kv_caches_base_addr, num_blocks} through
internal/sidechannel/testdata/seedpeer.py's loop: prints "READY <port>",
then "DONE <request id as JSON>" per DONE_RECVING, exits when stdin
closes.
"""
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "..", "sidechannel", "testdata"))
sys.path.insert(0, os.path.join(HERE, "..", "..", "..", "clients", "python"))

from mooncake.engine import TransferEngine  # noqa: E402

import seedpeer  # noqa: E402
from kvflow.client import Cache  # noqa: E402


def main(argv):
    path, engine_id = argv[0], argv[1]
    cache = Cache(path)
    engine = TransferEngine()
    if engine.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") != 0:
        print("ERROR TransferEngine.initialize failed", flush=True)
        return 1
    ptrs, lengths = [], []
    for layer in range(cache.num_layers):
        for p in range(cache.num_parts):
            a = cache[layer, p]
            ptrs.append(a.ctypes.data)
            # The seed: num_blocks * block_len[i % parts] (one block_len for GQA).
            lengths.append(cache.num_blocks * cache.block_lens[p % len(cache.block_lens)])
    if engine.batch_register_memory(ptrs, lengths) != 0:
        print("ERROR batch_register_memory failed", flush=True)
        return 1
    seedpeer.serve([engine_id, str(engine.get_rpc_port()), str(cache.num_blocks)] + [str(a) for a in ptrs])
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
