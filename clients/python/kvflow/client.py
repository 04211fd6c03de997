"""Python client for a kvflow worker: its control socket and its cache file.

kvflow runs one sidecar per prefill/decode worker. An engine's KV connector
drives it through the worker's control socket (a ZMQ ROUTER, ``ipc://`` by
default, msgpack maps; see internal/control/doc.go) and, when the cache lives
in a shared-memory file, maps that file to read and write the KV cache.

    from kvflow.client import Client, attach_cache, create_cache

    c = Client("ipc:///run/kvflow/decode0.sock", timeout_ms=10000)
    errs = c.load([{"request_id": "r1", "local_block_ids": [3, 4],
                    "kv_transfer_params": params}])       # decode worker
    errs = c.send([{"request_id": "r1", "delay_start_time": time.time()}])  # prefill
    n = c.abort(["r1"])
    done_sending, done_recving, failed_recving = c.finished()
    c.status()

    cache = attach_cache("/dev/shm/kvflow-decode0")
    k = cache[0, 0]   # layer 0, part 0: numpy [num_blocks, block_size, heads, head_dim]

    # an engine that owns its cache creates the file; kvflow serve attaches
    # to it with cache.mode shm_attach
    cache = create_cache("/dev/shm/kvflow-decode0", num_layers=2, num_blocks=64,
                         block_size=16, dtype="bf16", num_kv_heads=4, head_dim=64)

Dependencies: pyzmq, msgpack and numpy (Debian: python3-zmq python3-msgpack
python3-numpy). numpy is only needed by attach_cache and create_cache.
"""

import mmap
import os
import stat
import struct
import threading
import weakref

import msgpack
import zmq

__all__ = [
    "Client", "KvflowError", "ControlError", "ControlTimeout", "ProtocolError",
    "CacheFileError", "Cache", "Part", "attach_cache", "create_cache", "encode_header",
    "cache_layout", "DTYPES", "DATA_OFFSET",
]


class KvflowError(Exception):
    """Base of every error this module raises."""


class ControlError(KvflowError):
    """The worker answered with an error reply (``ok`` false, or the side
    channel's raw ``ERR <reason>`` for a message it could not even frame).
    ``reply`` is the decoded reply map (None for a raw error)."""

    def __init__(self, op, message, reply=None):
        super().__init__("kvflow %s: %s" % (op, message))
        self.op = op
        self.message = message
        self.reply = reply


class ControlTimeout(KvflowError):
    """No reply within the client's timeout. The socket was discarded; the
    next call uses a fresh one. The worker may or may not have run the op."""


class ProtocolError(KvflowError):
    """The reply was not a kvflow reply (not msgpack, not a map, wrong types)."""


class CacheFileError(KvflowError):
    """The file is not a usable kvflow cache file."""


# --------------------------------------------------------------------------
# Control socket
# --------------------------------------------------------------------------

def _int_list(v, what):
    try:
        return [int(x) for x in v]
    except TypeError:
        raise TypeError("%s must be a list of ints, got %r" % (what, type(v).__name__)) from None


class Client:
    """A client of one worker's control socket.

    One REQ socket, one request at a time (calls are serialised by a lock,
    so a Client may be shared by threads). After a timeout or any socket
    error the socket is closed and replaced by a fresh one on the next call:
    a REQ socket that missed its reply is never reused.

    timeout_ms bounds each call (send and reply). Keep it above the worker's
    load timeout (5 s by default), which a ``load`` into a full pipeline may
    wait before answering.
    """

    def __init__(self, endpoint, timeout_ms=10000, context=None):
        if not isinstance(endpoint, str) or "://" not in endpoint:
            raise ValueError("endpoint must be a ZMQ endpoint such as ipc:///path or tcp://host:port, got %r" % (endpoint,))
        if isinstance(timeout_ms, bool) or not isinstance(timeout_ms, (int, float)) or not timeout_ms > 0:
            raise ValueError("timeout_ms must be a number > 0, got %r" % (timeout_ms,))
        self.endpoint = endpoint
        self.timeout_ms = int(timeout_ms)
        self._ctx = context or zmq.Context.instance()
        self._sock = None
        self._lock = threading.Lock()
        self._closed = False

    # -- socket lifecycle -------------------------------------------------

    def _socket(self):
        if self._sock is None:
            s = self._ctx.socket(zmq.REQ)
            s.setsockopt(zmq.LINGER, 0)
            s.setsockopt(zmq.SNDTIMEO, self.timeout_ms)
            s.setsockopt(zmq.RCVTIMEO, self.timeout_ms)
            s.connect(self.endpoint)
            self._sock = s
        return self._sock

    def _discard(self):
        if self._sock is not None:
            self._sock.close(linger=0)
            self._sock = None

    def close(self):
        """Close the socket. Further calls raise KvflowError."""
        with self._lock:
            self._closed = True
            self._discard()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __del__(self):
        try:
            self._discard()
        except Exception:
            pass

    # -- one round trip ---------------------------------------------------

    def call(self, msg):
        """Send one control message (a dict with "op") and return the reply
        map. Raises ControlError on an error reply, ControlTimeout, or
        ProtocolError."""
        op = msg.get("op", "?")
        payload = msgpack.packb(msg, use_bin_type=True)
        with self._lock:
            if self._closed:
                raise KvflowError("kvflow %s: client is closed" % op)
            try:
                s = self._socket()
                s.send(payload)
                raw = s.recv()
            except zmq.Again:
                self._discard()
                raise ControlTimeout("kvflow %s: no reply from %s within %d ms" % (op, self.endpoint, self.timeout_ms)) from None
            except zmq.ZMQError as e:
                self._discard()
                raise KvflowError("kvflow %s: %s: %s" % (op, self.endpoint, e)) from e
        return _check_reply(op, raw)

    # -- ops --------------------------------------------------------------

    def load(self, requests):
        """Decode worker: pull each request's blocks from its prefill worker.

        requests: dicts with request_id (str), local_block_ids (ints) and
        kv_transfer_params (the prefill side's dict: remote_block_ids,
        remote_engine_id, remote_host, remote_port, optional remote_pcp_size,
        remote_dcp_size and kvflow_boot_epochs: the prefill ranks' boot
        epochs, a request whose rank restarted since fails). Other keys are
        passed through (the worker ignores keys it does not know).

        Returns one entry per request, index-aligned: None if accepted, else
        the worker's reason (the engine should treat that request as failed).
        Raises ControlError if the whole message was rejected.
        """
        reqs = []
        for r in requests:
            r = dict(r)
            r["local_block_ids"] = _int_list(r.get("local_block_ids"), "local_block_ids")
            p = r.get("kv_transfer_params")
            if isinstance(p, dict) and "remote_block_ids" in p:
                p = dict(p)
                p["remote_block_ids"] = _int_list(p["remote_block_ids"], "kv_transfer_params.remote_block_ids")
                r["kv_transfer_params"] = p
            reqs.append(r)
        return self._per_request("load", reqs)

    def send(self, requests):
        """Prefill worker: these requests' blocks are held for decode.

        requests: dicts with request_id (str), delay_start_time (float, the
        time.time() at which the scheduler started holding the blocks; 0
        means now) and optional block_ids (this worker's block ids).
        Returns per-request errors as load does.
        """
        reqs = []
        for r in requests:
            r = dict(r)
            if "delay_start_time" in r:
                try:
                    r["delay_start_time"] = float(r["delay_start_time"])
                except (TypeError, ValueError):
                    raise TypeError("delay_start_time of %r must be a number (time.time()), got %r"
                                    % (r.get("request_id"), r["delay_start_time"])) from None
            if r.get("block_ids") is not None:
                r["block_ids"] = _int_list(r["block_ids"], "block_ids")
            reqs.append(r)
        return self._per_request("send", reqs)

    def abort(self, request_ids):
        """Abort requests; returns how many the worker knew."""
        ids = [str(i) for i in request_ids]
        rep = self.call({"op": "abort", "request_ids": ids})
        n = rep.get("aborted", 0)
        if not isinstance(n, int):
            raise ProtocolError("kvflow abort: aborted is %r, want an int" % (n,))
        return n

    def finished(self):
        """Requests finished since the last call, each reported once:
        (done_sending, done_recving, failed_recving). The first two are lists
        of request ids; failed_recving is a list of dicts with request_id,
        block_ids (to recompute) and reason."""
        rep = self.call({"op": "finished"})
        out = []
        for key in ("done_sending", "done_recving", "failed_recving"):
            v = rep.get(key)
            if v is None:
                v = []
            if not isinstance(v, list):
                raise ProtocolError("kvflow finished: %s is %r, want a list" % (key, type(v).__name__))
            out.append(v)
        for f in out[2]:
            if not isinstance(f, dict) or "request_id" not in f:
                raise ProtocolError("kvflow finished: bad failed_recving entry %r" % (f,))
            if f.get("block_ids") is None:
                f["block_ids"] = []
        return out[0], out[1], out[2]

    def status(self):
        """The worker's role and counters: a dict with "role" and the
        worker's status fields (the reply's "status" map, merged)."""
        rep = self.call({"op": "status"})
        st = dict(rep.get("status") or {})
        st["role"] = rep.get("role", "")
        return st

    def _per_request(self, op, reqs):
        rep = self.call({"op": op, "requests": reqs})
        errs = rep.get("errors")
        if errs is None:
            errs = []
        if not isinstance(errs, list) or len(errs) != len(reqs):
            raise ProtocolError("kvflow %s: %d results for %d requests" % (op, len(errs) if isinstance(errs, list) else -1, len(reqs)))
        return errs


def _check_reply(op, raw):
    if raw.startswith(b"ERR "):
        raise ControlError(op, raw[4:].decode("utf-8", "replace"))
    try:
        rep = msgpack.unpackb(raw, raw=False)
    except Exception as e:
        raise ProtocolError("kvflow %s: reply is not msgpack: %s (%r)" % (op, e, raw[:64])) from None
    if not isinstance(rep, dict) or not isinstance(rep.get("ok"), bool):
        raise ProtocolError("kvflow %s: reply is not a kvflow reply: %r" % (op, raw[:64]))
    if not rep["ok"]:
        raise ControlError(op, rep.get("error") or "error reply without a reason", rep)
    return rep


# --------------------------------------------------------------------------
# Shared-memory cache file (hw/npu/header.go, version 1)
# --------------------------------------------------------------------------

_MAGIC = b"KVFLOWKV"
_VERSION = 1
_HEADER_LEN = 128        # bytes covered by the CRC
_HEADER_SIZE = _HEADER_LEN + 4
_CACHE_ALIGN = 4096      # npu.CacheAlign
_FLAG_FLAT, _FLAG_MLA, _FLAG_SPARSE = 1, 2, 4

# npu.DType -> (name, numpy dtype string, element size). bf16 has no numpy
# dtype: it is exposed as little-endian uint16 (the raw bits; with torch,
# torch.from_numpy(a).view(torch.bfloat16)). fp8 (e4m3 or e5m2: the file
# does not say which) is exposed as uint8.
DTYPES = {
    1: ("bf16", "<u2", 2),
    2: ("fp16", "<f2", 2),
    3: ("fp32", "<f4", 4),
    4: ("int8", "i1", 1),
    5: ("fp8", "u1", 1),
}


def _crc32c_table():
    t = []
    for i in range(256):
        c = i
        for _ in range(8):
            c = (c >> 1) ^ 0x82F63B78 if c & 1 else c >> 1
        t.append(c)
    return t


_CRC32C = _crc32c_table()


def crc32c(data):
    """CRC-32C (Castagnoli), as hw/npu checksums the header."""
    c = 0xFFFFFFFF
    for b in data:
        c = _CRC32C[(c ^ b) & 0xFF] ^ (c >> 8)
    return c ^ 0xFFFFFFFF


def _align_up(n, a):
    return (n + a - 1) // a * a


class Part:
    """One cache tensor of a layer (npu.Part)."""

    __slots__ = ("name", "heads", "dim", "row_bytes", "block_len")

    def __init__(self, name, heads, dim, elem):
        self.name, self.heads, self.dim = name, heads, dim
        self.row_bytes = heads * dim * elem
        self.block_len = 0

    def __repr__(self):
        return "Part(%s, heads=%d, dim=%d, block_len=%d)" % (self.name, self.heads, self.dim, self.block_len)


class Cache:
    """A mapped kvflow cache file.

    cache[layer, part] (or cache.caches[layer][part]) is a numpy array over
    the shared memory: [num_blocks, block_size, heads, head_dim] for GQA
    (K is part 0, V part 1; [num_blocks, block_size, heads*head_dim] if the
    file says flat), [num_blocks, block_size, 1, dim] for the MLA and sparse
    parts (kv_lora, k_rope, indexer_k). Writes through the arrays land in
    kvflow's memory. Attributes: kind ("gqa", "mla", "sparse"), dtype (kvflow's
    name), np_dtype, num_layers, num_blocks, block_size, num_kv_heads,
    head_dim, kv_lora_rank, qk_rope_head_dim, indexer_dim, flat, parts,
    block_lens (the seed's block_len list), offsets (per cache, from
    data_offset, seed order), data_offset, data_size, file_size, path.
    """

    def __init__(self, path, writable=True):
        import numpy as np

        self.path = path
        if not stat.S_ISREG(os.stat(path).st_mode):
            raise CacheFileError("%s: not a regular file" % path)
        fd = os.open(path, os.O_RDWR if writable else os.O_RDONLY)
        try:
            st = os.fstat(fd)
            with open(fd, "rb", closefd=False) as f:
                hdr = f.read(_HEADER_SIZE)
            self._parse(hdr, st.st_size)
            prot = mmap.PROT_READ | (mmap.PROT_WRITE if writable else 0)
            self._mm = mmap.mmap(fd, self.file_size, mmap.MAP_SHARED, prot)
        finally:
            os.close(fd)
        self.np_dtype = np.dtype(DTYPES[self._dt][1])
        self.caches = []
        for layer in range(self.num_layers):
            row = []
            for p, part in enumerate(self.parts):
                off = self.data_offset + self.offsets[layer * len(self.parts) + p]
                if self.kind == "gqa" and self.flat:
                    shape = (self.num_blocks, self.block_size, part.heads * part.dim)
                else:
                    shape = (self.num_blocks, self.block_size, part.heads, part.dim)
                count = self.num_blocks * self.block_size * part.heads * part.dim
                a = np.frombuffer(self._mm, dtype=self.np_dtype, count=count, offset=off).reshape(shape)
                if not writable:
                    a.flags.writeable = False
                row.append(a)
            self.caches.append(row)

    def _parse(self, b, actual_size):
        p = self.path

        def bad(msg):
            raise CacheFileError("%s: %s" % (p, msg))

        if len(b) < len(_MAGIC) or b[:len(_MAGIC)] != _MAGIC:
            bad("not a kvflow cache file (bad magic %r)" % (b[:len(_MAGIC)],))
        if len(b) < _HEADER_SIZE:
            bad("%d bytes, shorter than a header (%d)" % (len(b), _HEADER_SIZE))
        version, hlen, dt, flags = struct.unpack_from("<IIII", b, 8)
        if version != _VERSION:
            bad("unsupported cache file version %d, this client reads %d" % (version, _VERSION))
        if hlen != _HEADER_LEN:
            bad("header length %d, want %d" % (hlen, _HEADER_LEN))
        (stored,) = struct.unpack_from("<I", b, _HEADER_LEN)
        computed = crc32c(b[:_HEADER_LEN])
        if stored != computed:
            bad("header checksum mismatch: stored %#010x, computed %#010x" % (stored, computed))
        (reserved,) = struct.unpack_from("<Q", b, 24)
        if dt not in DTYPES or flags & ~(_FLAG_FLAT | _FLAG_MLA | _FLAG_SPARSE) or reserved:
            bad("unknown dtype %d, flags %#x or reserved bits" % (dt, flags))
        dims = struct.unpack_from("<8Q", b, 32)
        for i, v in enumerate(dims):
            if v > 1 << 31:
                bad("dimension %d is %d" % (i, v))
        (self.num_layers, self.num_blocks, self.block_size, self.num_kv_heads, self.head_dim,
         self.kv_lora_rank, self.qk_rope_head_dim, self.indexer_dim) = dims
        align, self.data_offset, self.data_size, self.file_size = struct.unpack_from("<4Q", b, 96)
        self._dt = dt
        self.dtype = DTYPES[dt][0]
        elem = DTYPES[dt][2]
        self.flat = bool(flags & _FLAG_FLAT)
        mla, sparse = bool(flags & _FLAG_MLA), bool(flags & _FLAG_SPARSE)
        self.kind = "sparse" if sparse else "mla" if mla else "gqa"

        problems = []

        def pos(name, v):
            if v < 1:
                problems.append("%s = %d, must be >= 1" % (name, v))

        pos("num_layers", self.num_layers)
        pos("num_blocks", self.num_blocks)
        pos("block_size", self.block_size)
        if self.kind == "gqa":
            pos("num_kv_heads", self.num_kv_heads)
            pos("head_dim", self.head_dim)
            dims_ = [("k", self.num_kv_heads, self.head_dim), ("v", self.num_kv_heads, self.head_dim)]
        else:
            if sparse and not mla:
                problems.append("sparse without MLA")
            pos("kv_lora_rank", self.kv_lora_rank)
            pos("qk_rope_head_dim", self.qk_rope_head_dim)
            dims_ = [("kv_lora", 1, self.kv_lora_rank), ("k_rope", 1, self.qk_rope_head_dim)]
            if sparse:
                pos("indexer_dim", self.indexer_dim)
                dims_.append(("indexer_k", 1, self.indexer_dim))
        if self.flat and self.kind != "gqa":
            problems.append("flat applies to GQA caches only")
        if problems:
            bad("invalid cache shape: " + "; ".join(problems))

        self.parts = []
        for name, heads, dim in dims_:
            part = Part(name, heads, dim, elem)
            part.block_len = part.row_bytes * self.block_size
            self.parts.append(part)
        self.block_lens = [self.parts[0].block_len] if self.kind == "gqa" else [q.block_len for q in self.parts]
        self.offsets = []
        off = 0
        for k in range(self.num_layers * len(self.parts)):
            self.offsets.append(off)
            off += _align_up(self.num_blocks * self.parts[k % len(self.parts)].block_len, _CACHE_ALIGN)
        if align != _CACHE_ALIGN or self.data_offset < _HEADER_SIZE or self.data_offset % 4096:
            bad("cache alignment %d, data offset %d" % (align, self.data_offset))
        if self.data_size != off or self.file_size != self.data_offset + self.data_size:
            bad("header says data %d bytes at %d in a %d-byte file; the shape needs %d"
                % (self.data_size, self.data_offset, self.file_size, off))
        if actual_size != self.file_size:
            bad("file is %d bytes, header says %d" % (actual_size, self.file_size))

    @property
    def num_parts(self):
        return len(self.parts)

    def __getitem__(self, key):
        layer, part = key
        return self.caches[layer][part]

    def block(self, layer, part, block_id):
        """Block block_id of cache (layer, part): [block_size, heads, dim]."""
        return self.caches[layer][part][block_id]

    def close(self):
        """Drop this object's arrays and unmap the file. If arrays taken from
        it are still alive, the mapping stays until they are freed."""
        self.caches = []
        mm, self._mm = getattr(self, "_mm", None), None
        if mm is not None:
            try:
                mm.close()
            except BufferError:
                pass  # views still exported; freed with them

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __repr__(self):
        return "Cache(%r, %s %s, %d layers x %d parts, %d blocks of %d)" % (
            self.path, self.kind, self.dtype, self.num_layers, len(self.parts), self.num_blocks, self.block_size)


_MAPPED = weakref.WeakValueDictionary()  # address of cache[0, 0] -> Cache


def find_mapped_cache(address):
    """The Cache (made by attach_cache or create_cache in this process)
    whose first cache tensor starts at address, or None. An engine's
    tensors that are views of a mapped cache file are found this way and
    shared zero-copy with kvflow."""
    return _MAPPED.get(int(address))


def attach_cache(path, writable=True):
    """Map kvflow's shared-memory cache file at path (made by kvflow with
    npu.CreateShm; typically under /dev/shm) and return a Cache whose
    cache[layer, part] are numpy arrays over the shared memory. The header
    is checked exactly as kvflow checks it (magic, version, CRC-32C, shape,
    sizes); a bad file raises CacheFileError. bf16 caches are uint16 arrays
    (raw bits); fp8 caches are uint8. The file is never written unless you
    write through the arrays (writable=False maps it read-only)."""
    c = Cache(path, writable=writable)
    _MAPPED[c.caches[0][0].ctypes.data] = c
    return c


# --------------------------------------------------------------------------
# Writing a cache file (the engine owns the cache; kvflow attaches to it)
# --------------------------------------------------------------------------

DATA_OFFSET = 2 << 20     # npu's shmDataOffset: one huge page
_DTYPE_IDS = {name: i for i, (name, _, _) in DTYPES.items()}
_DTYPE_ALIASES = {"bfloat16": "bf16", "float16": "fp16", "half": "fp16", "float32": "fp32",
                  "float": "fp32", "fp8_e4m3": "fp8", "fp8_e5m2": "fp8", "float8_e4m3fn": "fp8",
                  "float8_e5m2": "fp8"}


def _dtype_id(dtype):
    name = str(dtype).lower().replace("torch.", "")
    name = _DTYPE_ALIASES.get(name, name)
    if name not in _DTYPE_IDS:
        raise CacheFileError("unknown cache dtype %r (want one of %s)" % (dtype, ", ".join(sorted(_DTYPE_IDS))))
    return _DTYPE_IDS[name]


def cache_layout(num_layers, num_blocks, block_size, dtype, num_kv_heads=0, head_dim=0, flat=False,
                 mla=False, kv_lora_rank=0, qk_rope_head_dim=0, sparse=False, indexer_dim=0):
    """The cache file's layout for a shape, as hw/npu lays it out: a dict
    with dtype_id, flags, dims (the header's eight), parts [(name, heads,
    dim)], block_lens (per part), offsets (per cache, from the data
    offset, seed order) and data_size. Raises CacheFileError naming every
    problem of an invalid shape."""
    dt = _dtype_id(dtype)
    elem = DTYPES[dt][2]
    problems = []
    for name, v in (("num_layers", num_layers), ("num_blocks", num_blocks), ("block_size", block_size)):
        if not isinstance(v, int) or v < 1:
            problems.append("%s = %r, must be an int >= 1" % (name, v))
    if sparse and not mla:
        problems.append("sparse without MLA")
    if mla:
        if flat:
            problems.append("flat applies to GQA caches only")
        parts = [("kv_lora", 1, kv_lora_rank), ("k_rope", 1, qk_rope_head_dim)]
        if sparse:
            parts.append(("indexer_k", 1, indexer_dim))
        num_kv_heads, head_dim = 0, 0
    else:
        parts = [("k", num_kv_heads, head_dim), ("v", num_kv_heads, head_dim)]
        kv_lora_rank = qk_rope_head_dim = indexer_dim = 0
    for name, heads, dim in parts:
        if not isinstance(heads, int) or not isinstance(dim, int) or heads < 1 or dim < 1:
            problems.append("part %s: heads %r, dim %r must be ints >= 1" % (name, heads, dim))
    if problems:
        raise CacheFileError("invalid cache shape: " + "; ".join(problems))
    block_lens = [heads * dim * elem * block_size for _, heads, dim in parts]
    offsets, off = [], 0
    for k in range(num_layers * len(parts)):
        offsets.append(off)
        off += _align_up(num_blocks * block_lens[k % len(parts)], _CACHE_ALIGN)
    flags = (_FLAG_FLAT if flat else 0) | (_FLAG_MLA if mla else 0) | (_FLAG_SPARSE if sparse else 0)
    dims = (num_layers, num_blocks, block_size, num_kv_heads, head_dim, kv_lora_rank, qk_rope_head_dim, indexer_dim)
    return {"dtype_id": dt, "flags": flags, "dims": dims, "parts": parts, "block_lens": block_lens,
            "offsets": offsets, "data_size": off}


def encode_header(layout):
    """The 132 header bytes (hw/npu/header.go, version 1) of a layout made
    by cache_layout."""
    b = bytearray(_HEADER_SIZE)
    b[:8] = _MAGIC
    struct.pack_into("<IIII", b, 8, _VERSION, _HEADER_LEN, layout["dtype_id"], layout["flags"])
    struct.pack_into("<8Q", b, 32, *layout["dims"])
    size = layout["data_size"]
    struct.pack_into("<4Q", b, 96, _CACHE_ALIGN, DATA_OFFSET, size, DATA_OFFSET + size)
    struct.pack_into("<I", b, _HEADER_LEN, crc32c(bytes(b[:_HEADER_LEN])))
    return bytes(b)


def create_cache(path, num_layers, num_blocks, block_size, dtype, num_kv_heads=0, head_dim=0, flat=False,
                 mla=False, kv_lora_rank=0, qk_rope_head_dim=0, sparse=False, indexer_dim=0, mode=0o600):
    """Create a kvflow cache file at path (typically under /dev/shm) for the
    shape given, exactly as kvflow's npu.CreateShm would: header page, then
    zeroed caches at DATA_OFFSET in seed order. kvflow serve attaches to it
    with cache.mode shm_attach (and checks the shape against its config).
    The file appears atomically and only if path did not exist
    (FileExistsError otherwise). Returns the attached Cache (writable)."""
    lay = cache_layout(num_layers, num_blocks, block_size, dtype, num_kv_heads, head_dim, flat,
                       mla, kv_lora_rank, qk_rope_head_dim, sparse, indexer_dim)
    if os.path.lexists(path):
        raise FileExistsError("kvflow create cache file %s: file exists" % path)
    tmp = "%s.tmp.%d.%d" % (path, os.getpid(), threading.get_ident())
    fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_EXCL, mode)
    published = False
    try:
        os.ftruncate(fd, DATA_OFFSET + lay["data_size"])
        os.pwrite(fd, encode_header(lay), 0)
        os.link(tmp, path)   # atomic, never replaces an existing name
        published = True
    finally:
        os.close(fd)
        os.unlink(tmp)
    if not published:
        raise CacheFileError("%s: not published" % path)
    return attach_cache(path, writable=True)
