#!/usr/bin/python3
"""Move one request between the example workers and check its bytes.

Start deploy/examples/prefill.json and decode.json first (README, "Run a
prefill and a decode worker"), then, from the repository root:

    /usr/bin/python3 deploy/examples/one_request.py

It does what an engine's connector does: writes a pattern into one block of
the prefill cache, hands the request to the prefill worker (send), asks the
decode worker to pull it into another block (load) with the
kv_transfer_params the prefill scheduler would give, polls finished on both
sides and compares the bytes. Exit 0 when the request is done on both sides
and every byte matches. Needs python3-zmq, python3-msgpack, python3-numpy.
"""
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "clients", "python"))
from kvflow.client import Client, attach_cache  # noqa: E402

# The examples' control sockets (node.control derived from engine id, role
# and ranks) and cache files (cache.path); override with the environment.
PREFILL_CTL = os.environ.get("PREFILL_CTL", "ipc:///tmp/kvflow-example-prefill-prefill-dp0-pp0-tp0.sock")
DECODE_CTL = os.environ.get("DECODE_CTL", "ipc:///tmp/kvflow-example-decode-decode-dp0-pp0-tp0.sock")
PREFILL_CACHE = os.environ.get("PREFILL_CACHE", "/dev/shm/kvflow-example-prefill-tp0")
DECODE_CACHE = os.environ.get("DECODE_CACHE", "/dev/shm/kvflow-example-decode-tp0")
REMOTE_PORT = int(os.environ.get("REMOTE_PORT", "20001"))  # the prefill's kv_port


def main():
    rid = "one-request-%d" % os.getpid()
    src, dst = 3, 5  # prefill block 3 lands in decode block 5
    with Client(PREFILL_CTL) as p, Client(DECODE_CTL) as d:
        pc, dc = attach_cache(PREFILL_CACHE), attach_cache(DECODE_CACHE, writable=False)
        parts = [(layer, part) for layer in range(pc.num_layers) for part in range(pc.num_parts)]
        for layer, part in parts:
            pc.block(layer, part, src)[...] = layer * 7 + part * 3 + 1
        status = p.status()
        errs = p.send([{"request_id": rid, "delay_start_time": time.time(), "block_ids": [src]}])
        print("send", errs)
        errs = d.load([{"request_id": rid, "local_block_ids": [dst], "kv_transfer_params": {
            "remote_block_ids": [src], "remote_engine_id": status["engine_id"], "remote_host": "127.0.0.1",
            "remote_port": REMOTE_PORT, "remote_pcp_size": 1, "remote_dcp_size": 1}}])
        print("load", errs)
        recv = sent = False
        deadline = time.time() + 30
        while not (recv and sent) and time.time() < deadline:
            _, done_recving, failed = d.finished()
            if failed:
                print("decode failed:", failed)
                return 1
            recv = recv or rid in done_recving
            sent = sent or rid in p.finished()[0]
            time.sleep(0.02)
        if not (recv and sent):
            print("not done within 30 s (decode done %s, prefill freed %s)" % (recv, sent))
            return 1
        bad = [(layer, part) for layer, part in parts
               if not (dc.block(layer, part, dst) == pc.block(layer, part, src)).all()]
        print("done on both sides; %d of %d (layer, part) blocks differ" % (len(bad), len(parts)))
        return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
