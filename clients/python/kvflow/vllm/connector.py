"""KvflowConnector: vLLM v1's KV connector API over one kvflow sidecar per
rank. See kvflow/vllm/__init__.py for how vLLM loads it."""

import logging
import os
import socket

import numpy as np
import torch

from .. import client as kc
from ..parallel import PartitionError, kv_head_start, kv_heads_per_rank, pp_indices
from ..scheduler import ConnectorMetadata, SchedulerRules
from ..sidecar import Sidecar, worker_config

try:  # the real base classes where vLLM is importable
    from vllm.distributed.kv_transfer.kv_connector.v1.base import (  # type: ignore
        KVConnectorBase_V1, KVConnectorMetadata, KVConnectorRole)
    HAVE_VLLM = True
except Exception:  # noqa: BLE001 - any import failure means: no vLLM here
    from ._shim import KVConnectorBase_V1, KVConnectorMetadata, KVConnectorRole
    HAVE_VLLM = False
try:
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorHandshakeMetadata  # type: ignore
except Exception:  # noqa: BLE001 - an older vLLM, or none
    from ._shim import KVConnectorHandshakeMetadata

log = logging.getLogger("kvflow.vllm")

__all__ = ["KvflowConnector", "KvflowMetadata", "KvflowHandshakeMetadata", "ConfigError", "cache_tensors",
           "TORCH_DTYPES"]

# torch dtype -> kvflow cache dtype name
TORCH_DTYPES = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32", torch.int8: "int8"}
for _n in ("float8_e4m3fn", "float8_e5m2"):
    if hasattr(torch, _n):
        TORCH_DTYPES[getattr(torch, _n)] = "fp8"
_CACHE_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32, "int8": torch.int8}


class ConfigError(ValueError):
    """The engine's configuration or caches cannot be served by kvflow."""


class KvflowMetadata(ConnectorMetadata, KVConnectorMetadata):
    """What the scheduler side hands the workers each step: the seed's
    requests to receive and to send, plus kvflow's send_block_ids (the
    held blocks of each request to send, for read grants and the host
    buffer copy) and requests_to_abort."""

    def __init__(self):
        ConnectorMetadata.__init__(self)
        self.send_block_ids = {}


class KvflowHandshakeMetadata(KVConnectorHandshakeMetadata):
    """What a prefill worker tells its scheduler at start (vLLM gathers
    get_handshake_metadata from every worker and hands the scheduler side
    set_xfer_handshake_metadata): its ranks and its sidecar's boot epoch,
    which the scheduler hands decode as kv_transfer_params'
    kvflow_boot_epochs."""

    def __init__(self, tp_rank, pp_rank, boot_epoch):
        self.tp_rank = tp_rank
        self.pp_rank = pp_rank
        self.boot_epoch = boot_epoch

    def __repr__(self):
        return "KvflowHandshakeMetadata(tp=%r, pp=%r, boot_epoch=%r)" % (self.tp_rank, self.pp_rank, self.boot_epoch)


def cache_tensors(cache):
    """torch tensors over a mapped kvflow cache file (zero-copy):
    [layer][part] -> [num_blocks, block_size, heads, head_dim]. bf16 caches
    (uint16 in numpy) are viewed as torch.bfloat16, fp8 as uint8."""
    out = []
    for layer in cache.caches:
        row = []
        for a in layer:
            if cache.dtype == "bf16":
                row.append(torch.from_numpy(a.view(np.int16)).view(torch.bfloat16))
            else:
                row.append(torch.from_numpy(a))
        out.append(row)
    return out


def _get(obj, name, default=None):
    if obj is None:
        return default
    if isinstance(obj, dict):
        return obj.get(name, default)
    return getattr(obj, name, default)


class KvflowConnector(KVConnectorBase_V1):
    """vLLM v1 KV connector backed by kvflow.

    Scheduler side: kvflow.scheduler's port of the seed's rules (the
    kv_transfer_params it returns are the seed's, byte for byte).
    Worker side: register_kv_caches derives the cache shape from the
    tensors and the model config, then launches (or attaches to) this
    rank's ``kvflow serve``; start_load_kv forwards loads, sends and
    aborts over the control socket; get_finished polls ``finished``;
    failed loads (and every load in flight when the sidecar dies or stops
    answering within the control timeout) come back through
    get_block_ids_with_load_errors, and the request is still reported
    finished, as vLLM's recompute path expects.

    Settings under kv_connector_extra_config["kvflow"] (all optional):
    bin (the kvflow binary), workdir (configs, logs, ipc sockets), shm_dir,
    control (attach to this running sidecar instead of launching one;
    "{tp}", "{pp}", "{dp}" are replaced by this rank's), host (the side
    channel host advertised to peers; default the host's address),
    control_timeout_ms (10000), sidecar (extra config sections for kvflow
    serve), tp_rank/pp_rank (when vLLM's parallel state is unavailable),
    pp_layer_partition / decode_pp_layer_partition (the prefill's and the
    decode's VLLM_PP_LAYER_PARTITION; this instance's own defaults to the
    environment variable).

    Ranks: a rank holds max(1, kv_heads // tp) KV heads (head
    rank // (tp // kv_heads) when TP exceeds the heads, as vLLM replicates
    them), and with PP the layers of vLLM's get_pp_indices for its stage;
    this instance's tp_size and pp_size go into the sidecar's
    kv_connector_extra_config from parallel_config (a different value
    there is a ConfigError).
    """

    def __init__(self, vllm_config, role, kv_cache_config=None):
        super().__init__(vllm_config, role, kv_cache_config)
        kv = vllm_config.kv_transfer_config
        self.engine_id = str(_get(kv, "engine_id"))
        extra = _get(kv, "kv_connector_extra_config") or {}
        self.opts = dict(extra.get("kvflow") or {})
        self.kv_role = _get(kv, "kv_role")
        par = vllm_config.parallel_config
        self.tp_size = _get(par, "tensor_parallel_size", 1)
        self.pp_size = _get(par, "pipeline_parallel_size", 1)
        self.dp_rank = _get(par, "data_parallel_rank", 0) or 0
        self.block_size = _get(vllm_config.cache_config, "block_size")
        self.host = self.opts.get("host") or _default_host()
        self.kv_port = int(_get(kv, "kv_port", 0) or 0)
        if role == KVConnectorRole.SCHEDULER:
            self._rules = SchedulerRules(
                self.engine_id, self.host,
                SchedulerRules.side_channel_port(self.kv_port, self.dp_rank, self.tp_size, self.pp_size),
                self.block_size)
            self._send_blocks = {}
        else:
            self._rules = None
            self.tp_rank, self.pp_rank = self._ranks()
            self.sidecar = None
            self.cache = None          # the mapped kvflow cache file
            self._own_cache = False    # we created the file (host buffer mode)
            self._device_caches = None  # [layer][part] engine tensors (host buffer mode)
            self._loading = {}         # request id -> local block ids
            self._sending = set()
            self._aborted = set()
            self._load_errors = set()
            self._ready_recving = set()  # finished (done or failed) not yet reported
            self._dead = None          # why the sidecar is unusable

    # ------------------------------------------------------------------
    # scheduler side
    # ------------------------------------------------------------------

    def get_num_new_matched_tokens(self, request, num_computed_tokens):
        return self._rules.get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request, blocks, num_external_tokens):
        return self._rules.update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output):
        m = self._rules.build_connector_meta(scheduler_output)
        meta = KvflowMetadata()
        meta.requests, meta.requests_to_send, meta.requests_to_abort = (
            m.requests, m.requests_to_send, m.requests_to_abort)
        for rid in m.requests_to_send:
            meta.send_block_ids[rid] = self._send_blocks.pop(rid, None)
        return meta

    def update_connector_output(self, connector_output):
        recving = _get(connector_output, "finished_recving") or ()
        self._rules.finished_recving(recving)

    def request_finished(self, request, block_ids):
        delay, params = self._rules.request_finished(request, block_ids)
        if delay:
            self._send_blocks[request.request_id] = list(block_ids)
        return delay, params

    def get_finished_count(self):
        return None

    def set_xfer_handshake_metadata(self, metadata):
        """vLLM hands the scheduler what each worker's
        get_handshake_metadata returned ({tp_rank: metadata}): on a
        prefill instance, each rank's sidecar boot epoch. From then on
        every hand-over's kv_transfer_params carry them as
        kvflow_boot_epochs (entry tp + pp * tp_size; 0 for a rank that
        sent none), so a decode fails a request whose prefill rank has
        restarted since instead of reading the new process's blocks.
        Anything else is logged and ignored (no epochs: as the seed).
        vLLM keys the dict by TP rank only, so with PP > 1 one stage's
        metadata per TP rank survives its merge; the ranks of the others
        stay 0 (not compared: as today)."""
        if self._rules is None or not self._is_prefill():
            return
        epochs = [0] * (self.tp_size * self.pp_size)
        for key, md in (metadata or {}).items():
            tp, pp, e = (getattr(md, n, None) for n in ("tp_rank", "pp_rank", "boot_epoch"))
            ok = all(isinstance(v, int) and not isinstance(v, bool) for v in (tp, pp, e))
            if not ok or not (0 <= tp < self.tp_size and 0 <= pp < self.pp_size and 0 <= e < 1 << 63):
                log.warning("kvflow: handshake metadata of worker %r ignored: %r", key, md)
                continue
            epochs[tp + pp * self.tp_size] = e
        self._rules.set_boot_epochs(epochs)

    # ------------------------------------------------------------------
    # worker side
    # ------------------------------------------------------------------

    def _ranks(self):
        tp, pp = self.opts.get("tp_rank"), self.opts.get("pp_rank")
        if tp is None:
            try:
                from vllm.distributed.parallel_state import get_tensor_model_parallel_rank  # type: ignore
                tp = get_tensor_model_parallel_rank()
            except Exception:  # noqa: BLE001
                tp = 0
        if pp is None:
            try:
                from vllm.distributed.parallel_state import get_pp_group  # type: ignore
                pp = get_pp_group().rank_in_group
            except Exception:  # noqa: BLE001
                pp = 0
        return int(tp), int(pp)

    def _model_shape(self, kv_caches):
        """The whole model's cache shape, derived from this rank's tensors
        and vLLM's config, checked for consistency. Returns the per-layer
        cache parts ([K, V] for GQA, [kv_lora, k_rope] for MLA, each
        [blocks, block_size, heads, dim]), the sidecar's model section and
        create_cache's shape keywords."""
        cfg = self._vllm_config
        mc = cfg.model_config
        hf = _get(mc, "hf_config")
        if not kv_caches:
            raise ConfigError("kvflow register_kv_caches: no KV cache tensors")
        mla = bool(_get(mc, "use_mla", False) or _get(mc, "is_deepseek_mla", False))
        rank_ = _get(hf, "kv_lora_rank") if mla else None
        layers = []
        for name, t in kv_caches.items():
            if isinstance(t, (tuple, list)):
                parts = list(t)   # vllm-ascend: (k, v) or (kv_lora, k_rope)
            elif isinstance(t, torch.Tensor) and not mla and t.dim() == 5 and t.shape[0] == 2:
                parts = [t[0], t[1]]     # FlashAttention: [2, blocks, block_size, heads, head_dim]
            elif isinstance(t, torch.Tensor) and mla and t.dim() == 3 and isinstance(rank_, int) \
                    and 0 < rank_ < t.shape[2]:
                # vLLM MLA: [blocks, block_size, kv_lora_rank + qk_rope_head_dim]
                parts = [t[..., :rank_].unsqueeze(2), t[..., rank_:].unsqueeze(2)]
            else:
                raise ConfigError("kvflow register_kv_caches: layer %s: want %s, got %s" % (
                    name, "a (kv_lora, k_rope) pair or a [blocks, block_size, kv_lora_rank + rope_dim] tensor" if mla
                    else "a (k, v) pair or a [2, blocks, block_size, heads, head_dim] tensor", _desc(t)))
            if len(parts) != 2 or any(not isinstance(p, torch.Tensor) or p.dim() != 4 for p in parts):
                raise ConfigError("kvflow register_kv_caches: layer %s: want 2 parts of [blocks, block_size, heads, "
                                  "dim], got %s" % (name, [_desc(p) for p in parts]))
            layers.append(parts)
        nb, bs, heads, hd = layers[0][0].shape
        dt = layers[0][0].dtype
        for i, parts in enumerate(layers):
            for j, p in enumerate(parts):
                want = tuple(layers[0][j].shape)
                if tuple(p.shape) != want or p.dtype != dt or p.shape[:2] != (nb, bs):
                    raise ConfigError("kvflow register_kv_caches: layer %d part %d: %s differs from layer 0's %s"
                                      % (i, j, _desc(p), _desc(layers[0][j])))
        problems = []
        if dt not in TORCH_DTYPES:
            problems.append("unknown cache dtype %s (kvflow supports %s)" % (dt, ", ".join(map(str, TORCH_DTYPES))))
        cache_dtype = _get(cfg.cache_config, "cache_dtype", "auto")
        if cache_dtype not in (None, "auto"):
            try:
                kc._dtype_id(cache_dtype)
            except kc.CacheFileError:
                problems.append("unknown cache_config.cache_dtype %r" % (cache_dtype,))
        total = _get(hf, "num_key_value_heads") or _get(hf, "num_attention_heads")
        if mla:
            lora, rope = layers[0][0].shape[3], layers[0][1].shape[3]
            if heads != 1 or layers[0][1].shape[2] != 1:
                problems.append("MLA cache parts hold %d and %d heads, want 1" % (heads, layers[0][1].shape[2]))
            for key, got in (("kv_lora_rank", lora), ("qk_rope_head_dim", rope)):
                w = _get(hf, key)
                if w is not None and w != got:
                    problems.append("cache %s %d, model_config.hf_config.%s %d" % (key, got, key, w))
        elif not isinstance(total, int) or total < 1:
            problems.append("model_config.hf_config.num_key_value_heads is %r" % (total,))
        else:
            want = kv_heads_per_rank(total, self.tp_size)
            if total >= self.tp_size and total % self.tp_size:
                problems.append("%d KV heads are not divisible by tensor_parallel_size %d" % (total, self.tp_size))
            elif total < self.tp_size and self.tp_size % total:
                problems.append("tensor_parallel_size %d is not a multiple of %d KV heads" % (self.tp_size, total))
            elif heads != want:
                problems.append("cache tensors hold %d KV heads, the model has %d over TP %d (want %d%s)"
                                % (heads, total, self.tp_size, want,
                                   ", head %d replicated over %d ranks" % (
                                       kv_head_start(total, self.tp_size, self.tp_rank), self.tp_size // total)
                                   if self.tp_size > total else ""))
            if tuple(layers[0][1].shape) != (nb, bs, heads, hd):
                problems.append("V %s differs from K %s" % (_desc(layers[0][1]), _desc(layers[0][0])))
        n_layers = _get(hf, "num_hidden_layers")
        partitions = self._partitions()
        if self.pp_size == 1 and n_layers is not None and n_layers != len(layers):
            problems.append("%d cache layers, model has %d" % (len(layers), n_layers))
        elif self.pp_size > 1 and not isinstance(n_layers, int):
            problems.append("pipeline_parallel_size %d needs model_config.hf_config.num_hidden_layers (got %r)"
                            % (self.pp_size, n_layers))
        elif self.pp_size > 1:
            own = partitions["decode_pp_layer_partition" if not self._is_prefill() else "pp_layer_partition"]
            try:
                lo, hi = pp_indices(n_layers, self.pp_rank, self.pp_size, own)
            except PartitionError as e:
                problems.append(str(e))
            else:
                if hi - lo != len(layers):
                    problems.append("%d cache layers, PP stage %d of %d holds layers [%d, %d) of %d%s"
                                    % (len(layers), self.pp_rank, self.pp_size, lo, hi, n_layers,
                                       " (partition %s)" % own if own else ""))
        if self.block_size is not None and bs != self.block_size:
            problems.append("cache block size %d, cache_config.block_size %d" % (bs, self.block_size))
        if problems:
            raise ConfigError("kvflow register_kv_caches: inconsistent vLLM config: " + "; ".join(problems))
        model = {"num_layers": n_layers or len(layers), "block_size": bs, "dtype": TORCH_DTYPES[dt], "num_blocks": nb}
        model.update({k: v for k, v in partitions.items() if v})
        if mla:
            model.update({"num_kv_heads": 1, "mla": True, "kv_lora_rank": lora, "qk_rope_head_dim": rope})
            shape_kw = {"mla": True, "kv_lora_rank": lora, "qk_rope_head_dim": rope}
        else:
            model.update({"num_kv_heads": total, "head_dim": hd})
            shape_kw = {"num_kv_heads": heads, "head_dim": hd}
        return layers, model, shape_kw

    def _partitions(self):
        """The instances' VLLM_PP_LAYER_PARTITION strings for the sidecar's
        model section: pp_layer_partition (the prefill's) and
        decode_pp_layer_partition (the decode's), from the kvflow settings;
        this instance's own defaults to $VLLM_PP_LAYER_PARTITION, which vLLM
        read to place its layers."""
        out = {}
        for key in ("pp_layer_partition", "decode_pp_layer_partition"):
            v = self.opts.get(key)
            own = (key == "pp_layer_partition") == self._is_prefill()
            if v is None and own and self.pp_size > 1:
                v = os.environ.get("VLLM_PP_LAYER_PARTITION")
            out[key] = str(v) if v not in (None, "") else None
        return out

    def register_kv_caches(self, kv_caches):
        if self.kv_role not in ("kv_producer", "kv_consumer"):
            raise ConfigError("kvflow register_kv_caches: kv_role %r: kvflow runs kv_producer (prefill) or "
                              "kv_consumer (decode) instances" % (self.kv_role,))
        layers, model, shape_kw = self._model_shape(kv_caches)
        sides = self._sides()
        # Zero-copy when the tensors are kvflow's cache file (mapped here).
        k0 = layers[0][0]
        cache = kc.find_mapped_cache(k0.data_ptr()) if k0.device.type == "cpu" else None
        if cache is not None:
            views = cache_tensors(cache)
            same = len(views) == len(layers) and all(
                views[i][j].data_ptr() == layers[i][j].data_ptr() and layers[i][j].is_contiguous()
                and tuple(views[i][j].shape) == tuple(layers[i][j].shape)
                for i in range(len(layers)) for j in range(2))
            if not same:
                cache = None
        name = "kvflow-%s-%s-dp%d-pp%d-tp%d" % (self.engine_id, "prefill" if self._is_prefill() else "decode",
                                                 self.dp_rank, self.pp_rank, self.tp_rank)
        if cache is None:
            buf = _get(self._kv_transfer_config, "kv_buffer_device") or "cpu"
            if buf != "cpu":
                raise ConfigError("kvflow register_kv_caches: caches are not in a kvflow cache file and "
                                  "kv_buffer_device is %r: set it to \"cpu\" (host buffer copy)" % (buf,))
            shm = self.opts.get("shm_dir") or ("/dev/shm" if os.path.isdir("/dev/shm") else "/tmp")
            path = os.path.join(shm, name + ".kv")
            if os.path.exists(path):
                os.unlink(path)  # a previous run of this rank's buffer
            cache = kc.create_cache(path, len(layers), model["num_blocks"], model["block_size"], model["dtype"],
                                    **shape_kw)
            self._own_cache = True
            self._device_caches = layers
        self.cache = cache
        self._file = cache_tensors(cache)
        self._start_sidecar(model, name, sides)

    def _is_prefill(self):
        return self.kv_role == "kv_producer"

    def _sides(self):
        """kv_connector_extra_config's prefill and decode layouts, this
        instance's tp_size and pp_size filled in from parallel_config (a
        different value there is a ConfigError)."""
        extra = _get(self._kv_transfer_config, "kv_connector_extra_config") or {}
        sides = {}
        for side in ("prefill", "decode"):
            p = extra.get(side)
            if not isinstance(p, dict) or "tp_size" not in p or "dp_size" not in p:
                raise ConfigError("kvflow: kv_connector_extra_config.%s needs tp_size and dp_size (got %r)"
                                  % (side, p))
            sides[side] = dict(p)
        name = "prefill" if self._is_prefill() else "decode"
        own = sides[name]
        for key, mine in (("tp_size", self.tp_size), ("pp_size", self.pp_size)):
            got = own.get(key, 1 if key == "pp_size" else None)
            if got != mine:
                raise ConfigError("kvflow: kv_connector_extra_config.%s.%s is %r, this instance's "
                                  "parallel_config says %d" % (name, key, got, mine))
            own[key] = mine
        return sides

    def _start_sidecar(self, model, name, sides):
        timeout = int(self.opts.get("control_timeout_ms", 10000))
        ranks = {"tp": self.tp_rank, "pp": self.pp_rank, "dp": self.dp_rank}
        if self.opts.get("control"):
            ep = self.opts["control"].format(**ranks)
            self.sidecar = Sidecar.attach(ep, timeout_ms=timeout)
            self._launched = False
            return
        workdir = self.opts.get("workdir") or os.path.join("/tmp", "kvflow-" + self.engine_id)
        os.makedirs(workdir, exist_ok=True)
        role = "prefill" if self._is_prefill() else "decode"
        cfg = worker_config(role, self.engine_id, self.kv_port, sides["prefill"], sides["decode"], model, ranks,
                            self.cache.path, "ipc://" + os.path.join(workdir, name + ".sock"),
                            cache_mode="shm_attach", host=self.host, extra=self.opts.get("sidecar"))
        self.sidecar = Sidecar.launch(cfg, workdir, name, exe=self.opts.get("bin"), timeout_ms=timeout)
        self._launched = True

    # the host buffer copies (device tensors <-> kvflow's cache file)
    def _copy_to_file(self, block_ids):
        if self._device_caches is None or not block_ids:
            return
        idx = torch.tensor(block_ids, dtype=torch.long)
        for dev, f in zip(self._device_caches, self._file):
            for d, h in zip(dev, f):
                h[idx] = d[idx.to(d.device)].to("cpu")

    def _copy_from_file(self, block_ids):
        if self._device_caches is None or not block_ids:
            return
        idx = torch.tensor(block_ids, dtype=torch.long)
        for dev, f in zip(self._device_caches, self._file):
            for d, h in zip(dev, f):
                d[idx.to(d.device)] = h[idx].to(d.device)

    def _sidecar_failed(self, why):
        """The sidecar is gone or not answering: every load in flight ends
        as a load error, every send as finished (the blocks are freed; the
        decode side's pull fails and recomputes)."""
        if self._dead is None:
            self._dead = why
            log.error("kvflow sidecar %s unusable: %s", self.sidecar.control if self.sidecar else "?", why)
        for rid, blocks in self._loading.items():
            self._load_errors.update(blocks)
            self._ready_recving.add(rid)
        self._loading.clear()

    def start_load_kv(self, forward_context, **kwargs):
        meta = self._get_connector_metadata()
        if self.sidecar is None:
            raise ConfigError("kvflow start_load_kv before register_kv_caches")
        try:
            if meta.requests_to_abort:
                for rid in meta.requests_to_abort:
                    # vLLM freed the request: never report it again
                    self._ready_recving.discard(rid)
                    if self._loading.pop(rid, None) is not None:
                        self._aborted.add(rid)  # its end is still to come
                if self._dead is None:
                    self.sidecar.client.abort(list(meta.requests_to_abort))
            if meta.requests:
                reqs, order = [], []
                for rid, m in meta.requests.items():
                    try:
                        params = m.kv_transfer_params()
                    except ValueError as e:
                        # A malformed request from the router fails alone (its
                        # blocks are recomputed); the others still load.
                        log.warning("kvflow load %s refused: %s", rid, e)
                        self._load_errors.update(m.local_block_ids)
                        self._ready_recving.add(rid)
                        continue
                    order.append((rid, list(m.local_block_ids)))
                    reqs.append({"request_id": rid, "local_block_ids": list(m.local_block_ids),
                                 "kv_transfer_params": params})
                for rid, blocks in order:
                    self._loading[rid] = blocks
                if self._dead is not None:
                    self._sidecar_failed(self._dead)
                elif reqs:
                    errs = self.sidecar.client.load(reqs)
                    for (rid, blocks), err in zip(order, errs):
                        if err is not None:
                            log.warning("kvflow load %s refused: %s", rid, err)
                            self._loading.pop(rid, None)
                            self._load_errors.update(blocks)
                            self._ready_recving.add(rid)
            if meta.requests_to_send:
                sends = []
                for rid, t in meta.requests_to_send.items():
                    blocks = meta.send_block_ids.get(rid)
                    self._copy_to_file(blocks)
                    s = {"request_id": rid, "delay_start_time": t}
                    if blocks:
                        s["block_ids"] = list(blocks)
                    sends.append(s)
                    self._sending.add(rid)
                if self._dead is None:
                    for s, err in zip(sends, self.sidecar.client.send(sends)):
                        if err is not None:
                            log.warning("kvflow send %s refused: %s", s["request_id"], err)
        except kc.KvflowError as e:
            self._sidecar_failed(str(e))

    def wait_for_layer_load(self, layer_name):
        """kvflow loads whole requests asynchronously (between steps)."""

    def save_kv_layer(self, layer_name, kv_layer, attn_metadata, **kwargs):
        """Nothing to save: the prefill's blocks are read in place."""

    def wait_for_save(self):
        """Nothing to wait for. Sends are handed to the sidecar in
        start_load_kv (as the seed does), because vLLM skips wait_for_save
        on steps without a forward pass, which is exactly when a finished
        prefill's send arrives."""

    def get_finished(self, finished_req_ids):
        sending, recving = set(), set()
        if self.sidecar is not None and self._dead is None:
            if not self.sidecar.alive():
                self._sidecar_failed("kvflow serve exited with status %s" % self.sidecar.proc.returncode)
            else:
                try:
                    ds, dr, failed = self.sidecar.client.finished()
                except kc.KvflowError as e:
                    self._sidecar_failed(str(e))
                else:
                    sending.update(r for r in ds if r in self._sending)
                    self._sending.difference_update(sending)
                    for rid in dr:
                        blocks = self._loading.pop(rid, None)
                        if rid in self._aborted:
                            self._aborted.discard(rid)
                            continue
                        self._copy_from_file(blocks)
                        recving.add(rid)
                    for f in failed:
                        rid = f["request_id"]
                        blocks = self._loading.pop(rid, None)
                        if rid in self._aborted:
                            self._aborted.discard(rid)
                            continue
                        self._load_errors.update(f.get("block_ids") or blocks or [])
                        log.warning("kvflow load %s failed: %s", rid, f.get("reason"))
                        recving.add(rid)
        if self._dead is not None:
            sending.update(self._sending)
            self._sending.clear()
        recving.update(self._ready_recving)
        self._ready_recving.clear()
        return (sending or None), (recving or None)

    def get_handshake_metadata(self):
        """A prefill worker's ranks and its sidecar's boot epoch (from
        ``status``), for the scheduler's kvflow_boot_epochs; None on a
        decode worker, before register_kv_caches, or when the sidecar
        does not say (then no epochs are handed over: as the seed)."""
        if self._rules is not None or not self._is_prefill() or self.sidecar is None or self._dead is not None:
            return None
        try:
            e = self.sidecar.client.status().get("boot_epoch")
        except kc.KvflowError as err:
            log.warning("kvflow sidecar status: %s (no boot epoch handed over)", err)
            return None
        if isinstance(e, bool) or not isinstance(e, int) or not 0 < e < 1 << 63:
            return None
        return KvflowHandshakeMetadata(self.tp_rank, self.pp_rank, e)

    def get_block_ids_with_load_errors(self):
        out, self._load_errors = self._load_errors, set()
        return out

    def shutdown(self):
        if self._rules is not None:
            return
        if self.sidecar is not None:
            if getattr(self, "_launched", False):
                self.sidecar.stop()
            else:
                self.sidecar.client.close()
            self.sidecar = None
        if self.cache is not None and self._own_cache:
            path = self.cache.path
            self._file = None
            self.cache.close()
            try:
                os.unlink(path)
            except OSError:
                pass
        self.cache = None


def _desc(t):
    if isinstance(t, torch.Tensor):
        return "tensor%s %s on %s" % (list(t.shape), t.dtype, t.device)
    return type(t).__name__


def _default_host():
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect(("10.255.255.255", 1))
            return s.getsockname()[0]
    except OSError:
        return "127.0.0.1"


