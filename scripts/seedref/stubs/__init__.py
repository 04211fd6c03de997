"""Stand-in modules for running the seed's mooncake_connector.py outside vLLM.

install() puts small fake versions of vllm, vllm_ascend, torch, torch_npu, zmq,
msgspec and mooncake into sys.modules. They carry no logic of the seed: only
what the seed imports, configured per call through STATE, and recorders for
what the seed does with them (sockets, transfers).
"""
import enum
import sys
import types

import msgpack
import numpy as np


class _State:
    """Knobs read by the stand-ins; gen.py sets them before each call."""

    def __init__(self):
        self.reset()

    def reset(self):
        self.pcp_enable = False
        self.tp_rank = 0
        self.tp_world = 1
        self.pp_rank = 0
        self.pcp_world = 1
        self.pcp_rank = 0
        self.dcp_world = 1
        self.dcp_rank = 0
        self.ip = "192.0.2.10"
        self.engine_return = 0
        self.transfers = []  # batch_transfer_sync_read calls
        self.sent = []  # (path, bytes) every REQ socket sent
        self.peer = None  # peer(path, bytes) -> reply bytes for REQ sockets
        self.router_frames = []  # frames a ROUTER socket receives, in order
        self.router_sent = []  # what a ROUTER socket sent
        self.router_path = None
        self.errors = []  # logger.error format strings


STATE = _State()


def _mod(name, **attrs):
    m = types.ModuleType(name)
    m.__dict__.update(attrs)
    sys.modules[name] = m
    parent, _, child = name.rpartition(".")
    if parent:
        setattr(sys.modules[parent], child, m)
    return m


# ---------------------------------------------------------------- msgspec

class Struct:
    """msgspec.Struct stand-in: fields are the annotations in declaration order."""

    __struct_fields__ = ()

    def __init_subclass__(cls, **kwargs):  # omit_defaults=, dict=, ...
        super().__init_subclass__()
        fields = []
        for klass in reversed(cls.__mro__):
            for f in getattr(klass, "__annotations__", {}):
                if f not in fields and klass is not Struct and klass is not object:
                    fields.append(f)
        cls.__struct_fields__ = tuple(fields)

    def __init__(self, *args, **kwargs):
        for f, v in zip(self.__struct_fields__, args):
            kwargs[f] = v
        for f in self.__struct_fields__:
            if f not in kwargs:
                if hasattr(type(self), f):
                    kwargs[f] = getattr(type(self), f)
                else:
                    raise TypeError(f"Missing required argument '{f}'")
            setattr(self, f, kwargs[f])

    def __eq__(self, other):
        return type(self) is type(other) and all(
            getattr(self, f) == getattr(other, f) for f in self.__struct_fields__)

    def __repr__(self):
        return "%s(%s)" % (type(self).__name__, ", ".join(
            "%s=%r" % (f, getattr(self, f)) for f in self.__struct_fields__))


def _to_builtin(obj):
    if isinstance(obj, Struct):
        return {f: _to_builtin(getattr(obj, f)) for f in obj.__struct_fields__}
    if isinstance(obj, (list, tuple)):
        return [_to_builtin(x) for x in obj]
    if isinstance(obj, dict):
        return {k: _to_builtin(v) for k, v in obj.items()}
    return obj


class ValidationError(ValueError):
    pass


class Encoder:
    def encode(self, obj):
        return msgpack.packb(_to_builtin(obj), use_bin_type=True)


class Decoder:
    def __init__(self, type=None):
        self.type = type

    def decode(self, data):
        v = msgpack.unpackb(bytes(data), raw=False)
        t = self.type
        if t is tuple:
            if not isinstance(v, list):
                raise ValidationError(f"Expected `array`, got `{type(v).__name__}`")
            return tuple(v)
        if isinstance(t, type) and issubclass(t, Struct):
            if not isinstance(v, dict):
                raise ValidationError("Expected `object`")
            return t(**v)
        return v


# ---------------------------------------------------------------- zmq

class ZMQError(Exception):
    pass


class Again(ZMQError):
    pass


class Socket:
    def __init__(self, ctx, socket_type):
        self.ctx, self.type, self.path = ctx, socket_type, None
        self.replies = []
        self.opts = {}

    def setsockopt(self, opt, value):
        self.opts[opt] = value

    def connect(self, path):
        self.path = path

    def bind(self, path):
        self.path = path
        STATE.router_path = path

    def send(self, data, flags=0):
        data = bytes(data)
        STATE.sent.append((self.path, data))
        if STATE.peer is not None:
            r = STATE.peer(self.path, data)
            if r is not None:
                self.replies.append(r)

    def recv(self, flags=0):
        if not self.replies:
            raise ZMQError("Resource temporarily unavailable")
        return self.replies.pop(0)

    def send_multipart(self, frames, flags=0):
        STATE.router_sent.append([bytes(f) for f in frames])

    def recv_multipart(self, flags=0):
        if not STATE.router_frames:
            raise _EndOfScript()
        return STATE.router_frames.pop(0)

    def close(self, linger=None):
        pass


class _EndOfScript(BaseException):
    """Raised by a ROUTER socket when its scripted frames run out (ends run())."""


class Context:
    def socket(self, socket_type):
        return Socket(self, socket_type)

    def destroy(self, linger=None):
        pass

    def term(self):
        pass


class Poller:
    def __init__(self):
        self.socks = []

    def register(self, sock, flags=0):
        self.socks.append(sock)

    def poll(self, timeout=None):
        return [(s, 1) for s in self.socks if s.replies]


def make_zmq_path(scheme, host, port=None):
    if port is None:
        return f"{scheme}://{host}"
    if ":" in host:
        return f"{scheme}://[{host}]:{port}"
    return f"{scheme}://{host}:{port}"


def make_zmq_socket(ctx, path, socket_type, bind=None, identity=None, linger=None):
    s = ctx.socket(socket_type)
    if bind:
        s.bind(path)
    else:
        s.connect(path)
    return s


# ---------------------------------------------------------------- torch

class dtype:
    def __init__(self, name, np_dtype):
        self.name, self.np = name, np.dtype(np_dtype)

    def __repr__(self):
        return "torch." + self.name


int32 = dtype("int32", np.int32)
int64 = dtype("int64", np.int64)
float16 = dtype("float16", np.float16)
bfloat16 = dtype("bfloat16", np.uint16)  # two-byte stand-in
float32 = dtype("float32", np.float32)
int8 = dtype("int8", np.int8)
_DTYPES = {d.np: d for d in (int32, int64, float16, float32, int8)}


class Tensor:
    """numpy-backed tensor with the methods the seed calls."""

    def __init__(self, arr, ptr=None, dt=None):
        self.arr = arr
        self._ptr = ptr
        self.dtype = dt or _DTYPES.get(arr.dtype, float32)
        self.device = "cpu"

    # shape
    @property
    def shape(self):
        return tuple(self.arr.shape)

    def size(self, dim=None):
        return tuple(self.arr.shape) if dim is None else self.arr.shape[dim]

    def element_size(self):
        return self.dtype.np.itemsize

    def data_ptr(self):
        return self._ptr if self._ptr is not None else self.arr.__array_interface__["data"][0]

    def __getitem__(self, idx):
        return Tensor(self.arr[idx], None, self.dtype)

    def __len__(self):
        return len(self.arr)

    def view(self, *shape):
        if len(shape) == 1 and isinstance(shape[0], (tuple, list)):
            shape = tuple(shape[0])
        if not self.arr.flags["C_CONTIGUOUS"]:
            raise RuntimeError("view size is not compatible with input tensor's size and stride")
        return Tensor(self.arr.reshape(shape), None, self.dtype)

    def reshape(self, *shape):
        if len(shape) == 1 and isinstance(shape[0], (tuple, list)):
            shape = tuple(shape[0])
        return Tensor(self.arr.reshape(shape), None, self.dtype)

    def transpose_(self, a, b):
        self.arr = self.arr.swapaxes(a, b)
        return self

    def contiguous(self):
        return Tensor(np.ascontiguousarray(self.arr), None, self.dtype)

    def flatten(self):
        return Tensor(self.arr.flatten(), None, self.dtype)

    def to(self, *args, device=None, **kwargs):
        return self

    def tolist(self):
        return self.arr.tolist()

    def _bin(self, other, op):
        o = other.arr if isinstance(other, Tensor) else other
        return Tensor(op(self.arr, o), None, self.dtype)

    def __add__(self, o):
        return self._bin(o, np.add)

    __radd__ = __add__

    def __mul__(self, o):
        return self._bin(o, np.multiply)

    __rmul__ = __mul__


def tensor(data, dtype=None, device=None):
    dt = dtype or int64
    return Tensor(np.array(data, dtype=dt.np), None, dt)


def arange(start, end=None, dtype=None, device=None):
    dt = dtype or int64
    if end is None:
        start, end = 0, start
    return Tensor(np.arange(start, end, dtype=dt.np), None, dt)


def empty(*shape, dtype=None, device=None):
    dt = dtype or float32
    return Tensor(np.zeros(shape, dtype=dt.np), None, dt)


def npu_paged_cache_load(key_cache, value_cache, block_table, context_lens, seq_starts=None, key=None, value=None):
    """ASSUMED semantics: gather the block table's tokens in order into key/value."""
    bs = key_cache.arr.shape[1]
    blocks = block_table.arr.reshape(-1).tolist()
    n = int(context_lens.arr.reshape(-1)[0])
    for dst, src in ((key, key_cache), (value, value_cache)):
        flat = dst.arr.reshape(dst.arr.shape[0], -1)
        for t in range(n):
            b, off = blocks[t // bs], t % bs
            flat[t] = src.arr[b, off].reshape(-1)


def _npu_reshape_and_cache(key, value, key_cache, value_cache, slot_indices):
    """ASSUMED semantics: scatter token i to slot block*block_size + offset."""
    bs = key_cache.arr.shape[1]
    slots = slot_indices.arr.reshape(-1).tolist()
    for src, dst in ((key, key_cache), (value, value_cache)):
        flat = src.arr.reshape(src.arr.shape[0], -1)
        for i, s in enumerate(slots):
            dst.arr[s // bs, s % bs] = flat[i].reshape(dst.arr.shape[2:])


# ---------------------------------------------------------------- mooncake

class TransferEngine:
    def get_rpc_port(self):
        return 16000

    def batch_transfer_sync_read(self, session_id, src_list, dst_list, length_list):
        STATE.transfers.append({"session_id": session_id, "src_list": list(src_list),
                                "dst_list": list(dst_list), "length_list": list(length_list)})
        return STATE.engine_return

    def register_memory(self, *a):
        return 0


class _GlobalTE:
    def get_transfer_engine(self, hostname, device_name=None):
        return TransferEngine()

    def register_buffer(self, ptrs, lengths):
        pass


# ---------------------------------------------------------------- vllm

class _Logger:
    def debug(self, *a, **k):
        pass

    info = warning = debug

    def error(self, msg, *a, **k):
        STATE.errors.append(msg)


def get_pp_indices(num_hidden_layers, pp_rank, pp_size):
    """vLLM's vllm.distributed.utils.get_pp_indices (VLLM_PP_LAYER_PARTITION aware)."""
    s = sys.modules["vllm.envs"].VLLM_PP_LAYER_PARTITION
    if s is not None:
        try:
            partitions = [int(x) for x in s.split(",")]
        except ValueError as err:
            raise ValueError(f"Invalid partition string: {s}") from err
        if len(partitions) != pp_size:
            raise ValueError(f"{len(partitions)=} does not match {pp_size=}.")
        if sum(partitions) != num_hidden_layers:
            raise ValueError(f"{sum(partitions)=} does not match {num_hidden_layers=}.")
    else:
        per = num_hidden_layers // pp_size
        partitions = [per for _ in range(pp_size)]
        if remaining := num_hidden_layers % pp_size:
            for i in range(2, remaining + 2):
                partitions[-i] += 1
    start = sum(partitions[:pp_rank])
    return (start, start + partitions[pp_rank])


class KVConnectorRole(enum.Enum):
    SCHEDULER = 0
    WORKER = 1


class RequestStatus(enum.IntEnum):
    WAITING = 0
    RUNNING = 1
    FINISHED_STOPPED = 2
    FINISHED_LENGTH_CAPPED = 3
    FINISHED_ABORTED = 4


def install():
    if "vllm" in sys.modules and getattr(sys.modules["vllm"], "_seedref_stub", False):
        return STATE
    ms = _mod("msgspec", Struct=Struct, ValidationError=ValidationError, DecodeError=ValueError)
    _mod("msgspec.msgpack", Encoder=Encoder, Decoder=Decoder)
    ms.msgpack = sys.modules["msgspec.msgpack"]

    _mod("zmq", ROUTER=6, REQ=3, DEALER=5, NOBLOCK=1, SNDTIMEO=28, RCVTIMEO=27, POLLIN=1,
         LINGER=17, ZMQError=ZMQError, Again=Again, Socket=Socket, Context=Context, Poller=Poller)

    _mod("torch", Tensor=Tensor, tensor=tensor, arange=arange, empty=empty, dtype=dtype,
         int32=int32, int64=int64, float16=float16, bfloat16=bfloat16, float32=float32, int8=int8)
    _mod("torch_npu", _npu_reshape_and_cache=_npu_reshape_and_cache)
    _mod("torch_npu.atb", npu_paged_cache_load=npu_paged_cache_load)

    _mod("mooncake")
    _mod("mooncake.engine", TransferEngine=TransferEngine)

    v = _mod("vllm")
    v._seedref_stub = True
    _mod("vllm.envs", VLLM_NIXL_ABORT_REQUEST_TIMEOUT=480, VLLM_PP_LAYER_PARTITION=None)
    _mod("vllm.config", VllmConfig=type("VllmConfig", (), {}))
    _mod("vllm.distributed",
         get_prefill_context_model_parallel_rank=lambda: STATE.pcp_rank,
         get_prefill_context_model_parallel_world_size=lambda: STATE.pcp_world)
    _mod("vllm.distributed.kv_transfer")
    _mod("vllm.distributed.kv_transfer.kv_connector")
    _mod("vllm.distributed.kv_transfer.kv_connector.v1")
    _mod("vllm.distributed.kv_transfer.kv_connector.v1.base",
         KVConnectorBase_V1=type("KVConnectorBase_V1", (), {}),
         KVConnectorMetadata=type("KVConnectorMetadata", (), {}),
         KVConnectorRole=KVConnectorRole)
    _mod("vllm.distributed.parallel_state",
         get_decode_context_model_parallel_rank=lambda: STATE.dcp_rank,
         get_decode_context_model_parallel_world_size=lambda: STATE.dcp_world,
         get_pp_group=lambda: types.SimpleNamespace(rank_in_group=STATE.pp_rank),
         get_tensor_model_parallel_rank=lambda: STATE.tp_rank,
         get_tensor_model_parallel_world_size=lambda: STATE.tp_world,
         get_tp_group=lambda: types.SimpleNamespace(rank_in_group=STATE.tp_rank))
    _mod("vllm.distributed.utils", get_pp_indices=get_pp_indices)
    _mod("vllm.logger", logger=_Logger())
    _mod("vllm.utils")
    _mod("vllm.utils.network_utils", get_ip=lambda: STATE.ip, make_zmq_path=make_zmq_path,
         make_zmq_socket=make_zmq_socket)
    _mod("vllm.v1")
    _mod("vllm.v1.core")
    _mod("vllm.v1.core.sched")
    _mod("vllm.v1.core.sched.output", SchedulerOutput=type("SchedulerOutput", (), {}))
    _mod("vllm.v1.kv_cache_interface", KVCacheConfig=type("KVCacheConfig", (), {}))
    _mod("vllm.v1.request", RequestStatus=RequestStatus, Request=type("Request", (), {}))

    _mod("vllm_ascend")
    _mod("vllm_ascend.ascend_config", get_ascend_config=lambda: types.SimpleNamespace(),
         init_ascend_config=lambda cfg: None)
    _mod("vllm_ascend.distributed")
    _mod("vllm_ascend.distributed.mooncake_transfer_engine", global_te=_GlobalTE())
    _mod("vllm_ascend.distributed.utils", get_transfer_timeout_value=lambda: 10000)
    # True while the seed module is imported, so its optional pcp imports run.
    STATE.pcp_enable = True
    _mod("vllm_ascend.utils", prefill_context_parallel_enable=lambda: STATE.pcp_enable)
    return STATE
