#!/usr/bin/python3
"""A test peer speaking the seed's Mooncake side channel (vllm-ascend
mooncake_connector.py), for kvflow's interop tests. Needs python3-zmq and
python3-msgpack (Debian). msgpack.packb(use_bin_type=True) of a dict in
declaration order gives the same bytes as the seed's msgspec encoder
(see testdata/seedref/wire_bytes.json).

  seedpeer.py serve ENGINE_ID TE_RPC_PORT NUM_BLOCKS ADDR...
      Bind a ROUTER on tcp://127.0.0.1:* and serve as the seed's
      KVCacheSendingThread.run does. Prints "READY <port>", then
      "DONE <request id as JSON>" per DONE_RECVING. Exits when stdin closes.

  seedpeer.py client HOST:PORT REQ_ID...
      As the seed's KVCacheRecvingThread: a REQ socket, GET_META, then one
      DONE_RECVING per REQ_ID expecting b"ACK", each reply awaited with a
      1 s poll (ensure_zmq_recv). Prints one JSON line
      {"metadata": {...}, "acks": [...]} and exits 0, or prints the error
      and exits 1.
"""
import json
import sys
import threading

import msgpack
import zmq

GET_META_MSG = b"get_meta_msg"
DONE_RECVING_MSG = b"done_recving_msg"
FIELDS = (("engine_id", str), ("te_rpc_port", int),
          ("kv_caches_base_addr", list), ("num_blocks", int))


def out(line):
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


def serve(argv):
    engine_id, te_rpc_port, num_blocks = argv[0], int(argv[1]), int(argv[2])
    addrs = [int(a) for a in argv[3:]]
    encoded = msgpack.packb(
        {"engine_id": engine_id, "te_rpc_port": te_rpc_port,
         "kv_caches_base_addr": addrs, "num_blocks": num_blocks},
        use_bin_type=True)
    ctx = zmq.Context()
    sock = ctx.socket(zmq.ROUTER)
    sock.bind("tcp://127.0.0.1:*")
    port = sock.getsockopt(zmq.LAST_ENDPOINT).decode().rsplit(":", 1)[1]
    stop = threading.Event()

    def watch_stdin():
        sys.stdin.read()
        stop.set()

    threading.Thread(target=watch_stdin, daemon=True).start()
    out("READY " + port)
    poller = zmq.Poller()
    poller.register(sock, zmq.POLLIN)
    while not stop.is_set():
        if not dict(poller.poll(100)):
            continue
        # From here on: the seed's loop body.
        try:
            frames = sock.recv_multipart()
            if len(frames) < 2:
                out("ERROR Invalid message format")
                continue
            identity = frames[0]
            payload = [f for f in frames[1:] if f != b""]
            if len(payload) != 1:
                out("ERROR Invalid message format")
                continue
            msg = tuple(msgpack.unpackb(payload[0], raw=False))
            if msg[0] == GET_META_MSG:
                sock.send_multipart((identity, b"", encoded))
            elif msg[0] == DONE_RECVING_MSG:
                out("DONE " + json.dumps(msg[1]))
                sock.send_multipart((identity, b"", b"ACK"), flags=zmq.NOBLOCK)
            else:
                out("ERROR unexpected message")
        except Exception as e:  # noqa: BLE001 - as the seed
            out("ERROR exception %s: %s" % (type(e), e))
    sock.close(linger=0)
    ctx.term()


def recv(sock, poller, timeout=1.0):
    if not dict(poller.poll(int(timeout * 1000))):
        raise RuntimeError("Receive timeout")
    return sock.recv()


def client(argv):
    endpoint, req_ids = argv[0], argv[1:]
    ctx = zmq.Context()
    sock = ctx.socket(zmq.REQ)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.SNDTIMEO, 1000)
    sock.connect("tcp://" + endpoint)
    poller = zmq.Poller()
    poller.register(sock, zmq.POLLIN)
    try:
        sock.send(msgpack.packb((GET_META_MSG, ""), use_bin_type=True))
        raw = recv(sock, poller)
        meta = msgpack.unpackb(raw, raw=False)
        # msgspec.msgpack.Decoder(MooncakeAgentMetadata): a map with the
        # four typed fields; unknown fields are ignored.
        if not isinstance(meta, dict):
            raise TypeError("metadata is not a map: %r" % (meta,))
        for name, typ in FIELDS:
            if not isinstance(meta.get(name), typ) or isinstance(meta.get(name), bool):
                raise TypeError("field %s: %r" % (name, meta.get(name)))
        if not all(isinstance(a, int) for a in meta["kv_caches_base_addr"]):
            raise TypeError("kv_caches_base_addr: %r" % (meta["kv_caches_base_addr"],))
        known = {name: meta[name] for name, _ in FIELDS}
        extra = sorted(k for k in meta if k not in known)
        acks = []
        for rid in req_ids:
            sock.send(msgpack.packb((DONE_RECVING_MSG, rid), use_bin_type=True))
            resp = recv(sock, poller)
            if resp != b"ACK":
                raise RuntimeError("Failed to receive ACK, resp: %r" % (resp,))
            acks.append(resp.decode())
        out(json.dumps({"metadata": known, "extra_fields": extra, "acks": acks,
                        "metadata_hex": raw.hex()}))
        return 0
    except Exception as e:  # noqa: BLE001
        out("ERROR %s: %s" % (type(e).__name__, e))
        return 1
    finally:
        sock.close(linger=0)
        ctx.term()


if __name__ == "__main__":
    if len(sys.argv) < 2 or sys.argv[1] not in ("serve", "client"):
        sys.stderr.write(__doc__)
        sys.exit(2)
    sys.exit(serve(sys.argv[2:]) if sys.argv[1] == "serve" else client(sys.argv[2:]))
