"""A tiny serving engine around TinyModel: a monolith, or a prefill and a
decode instance joined by kvflow through KvflowConnector, called in vLLM
v1's order (scheduler: get_num_new_matched_tokens → allocate →
update_state_after_alloc → build_connector_meta; each worker:
bind_connector_metadata → start_load_kv → forward → wait_for_save →
get_finished → get_block_ids_with_load_errors → clear_connector_metadata;
scheduler: update_connector_output, request_finished).

Each TP rank of an instance has its own KvflowConnector (worker role) and
so its own ``kvflow serve`` sidecar process; the ranks' compute runs in
this process. A rank's cache is, by default, a kvflow cache file created
with kvflow.client.create_cache and mapped as torch tensors (zero-copy:
the sidecar attaches to the same file); with zero_copy=False it is plain
torch memory and the connector copies through a host buffer."""

import hashlib
import os
import time
import types

import torch

from .. import client as kc
from ..scheduler import FINISHED_LENGTH_CAPPED
from ..sidecar import free_port_base
from ..vllm import KVConnectorRole, KvflowConnector, cache_tensors
from ..parallel import PartitionError, kv_heads_per_rank, pp_indices
from .model import TinyModel

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


class EngineError(RuntimeError):
    pass


class Request:
    """What the connector sees of a request (vLLM's Request fields)."""

    def __init__(self, request_id, prompt, max_tokens, kv_transfer_params=None):
        self.request_id = request_id
        self.prompt_token_ids = list(prompt)
        self.output_token_ids = []
        self.max_tokens = max_tokens
        self.kv_transfer_params = kv_transfer_params
        self.status = "RUNNING"
        self.block_ids = []
        self.num_computed_tokens = 0


class Blocks:
    """vLLM's KVCacheBlocks, as the connector uses it."""

    def __init__(self, unhashed):
        self._unhashed = list(unhashed)

    def get_unhashed_block_ids(self):
        return list(self._unhashed)


class Instance:
    """One engine instance: role "mono", "prefill" or "decode", TP ranks
    in each of pp pipeline stages (stage s holds layers pp_indices(layers,
    s, pp, pp_layer_partition), vLLM's get_pp_indices with
    VLLM_PP_LAYER_PARTITION). other_tp/other_pp/other_pp_layer_partition
    describe the peer instance."""

    def __init__(self, model, role, tp=1, dtype="bf16", num_blocks=64, engine_id=None, kv_port=None,
                 other_tp=1, workdir=None, zero_copy=True, prefix_caching=False, kvflow_opts=None,
                 pp=1, pp_layer_partition=None, other_pp=1, other_pp_layer_partition=None):
        self.model, self.role, self.tp, self.pp = model, role, tp, pp
        self.world = tp * pp  # workers that each report a request finished
        c = model.cfg
        if c.q_heads % tp or (not c.mla and c.kv_heads % tp and tp % c.kv_heads):
            raise EngineError("TP %d does not divide %d query heads, or neither divides nor is a multiple of "
                              "%d KV heads" % (tp, c.q_heads, c.kv_heads))
        if role == "mono" and pp != 1:
            raise EngineError("the monolith runs PP 1")
        try:
            self.layer_ranges = [pp_indices(c.layers, s, pp, pp_layer_partition) for s in range(pp)]
        except PartitionError as e:
            raise EngineError("%s instance: %s" % (role, e)) from e
        self.dtype = dtype
        self.num_blocks = num_blocks
        self.free = list(range(num_blocks - 1, -1, -1))
        self.prefix = {} if prefix_caching else None  # hash of tokens up to a full block -> block id
        self.engine_id = engine_id or "tiny-%s-%d" % (role, os.getpid())
        self.workdir = workdir
        self.caches = []   # [worker][layer - stage start] (K, V); worker = pp_rank * tp + tp_rank
        self.stages = []   # per PP stage: (first layer, end layer, its TP ranks' caches)
        self._files = []
        self.connectors = []
        self.scheduler = None
        self.timings = {}
        hpr = kv_heads_per_rank(c.kv_heads, tp)
        if c.mla:
            shapes = [(num_blocks, c.block_size, 1, c.kv_lora_rank), (num_blocks, c.block_size, 1, c.rope_dim)]
            kw = {"mla": True, "kv_lora_rank": c.kv_lora_rank, "qk_rope_head_dim": c.rope_dim}
        else:
            shapes = [(num_blocks, c.block_size, hpr, c.head_dim)] * 2
            kw = {"num_kv_heads": hpr, "head_dim": c.head_dim}
        for s, (lo, hi) in enumerate(self.layer_ranges):
            for r in range(tp):
                if role != "mono" and zero_copy:
                    path = os.path.join(workdir, "%s-pp%d-r%d.kv" % (self.engine_id, s, r))
                    f = kc.create_cache(path, hi - lo, num_blocks, c.block_size, dtype, **kw)
                    self._files.append(f)
                    t = cache_tensors(f)
                    self.caches.append([(t[l][0], t[l][1]) for l in range(hi - lo)])
                else:
                    self.caches.append([tuple(torch.zeros(sh, dtype=DTYPES[dtype]) for sh in shapes)
                                        for _ in range(hi - lo)])
            self.stages.append((lo, hi, self.caches[s * tp:(s + 1) * tp]))
        if role == "mono":
            return
        self.kv_port = kv_port if kv_port is not None else free_port_base(self.world)
        ptp, dtp = (tp, other_tp) if role == "prefill" else (other_tp, tp)
        ppp, dpp = (pp, other_pp) if role == "prefill" else (other_pp, pp)
        ppart, dpart = ((pp_layer_partition, other_pp_layer_partition) if role == "prefill"
                        else (other_pp_layer_partition, pp_layer_partition))
        opts = {"bin": None, "workdir": workdir, "shm_dir": workdir, "host": "127.0.0.1"}
        if ppart:
            opts["pp_layer_partition"] = ppart
        if dpart:
            opts["decode_pp_layer_partition"] = dpart
        opts.update(kvflow_opts or {})
        for w in range(-1, self.world):
            o = dict(opts, tp_rank=max(w, 0) % tp, pp_rank=max(w, 0) // tp)
            vcfg = types.SimpleNamespace(
                kv_transfer_config=types.SimpleNamespace(
                    kv_connector="KvflowConnector", kv_connector_module_path="kvflow.vllm",
                    engine_id=self.engine_id, kv_role="kv_producer" if role == "prefill" else "kv_consumer",
                    kv_port=self.kv_port, kv_buffer_device="cpu",
                    kv_connector_extra_config={"prefill": {"tp_size": ptp, "dp_size": 1, "pp_size": ppp},
                                               "decode": {"tp_size": dtp, "dp_size": 1, "pp_size": dpp},
                                               "kvflow": o}),
                parallel_config=types.SimpleNamespace(tensor_parallel_size=tp, pipeline_parallel_size=pp,
                                                      data_parallel_size=1, data_parallel_rank=0),
                cache_config=types.SimpleNamespace(block_size=c.block_size, cache_dtype="auto"),
                model_config=types.SimpleNamespace(
                    dtype=DTYPES[dtype], use_mla=c.mla,
                    hf_config=types.SimpleNamespace(num_hidden_layers=c.layers, num_key_value_heads=c.kv_heads,
                                                    num_attention_heads=c.q_heads, kv_lora_rank=c.kv_lora_rank,
                                                    qk_rope_head_dim=c.rope_dim)))
            if w < 0:
                self.scheduler = KvflowConnector(vcfg, KVConnectorRole.SCHEDULER)
            else:
                self.connectors.append(KvflowConnector(vcfg, KVConnectorRole.WORKER))
        try:
            for w, conn in enumerate(self.connectors):
                lo, hi = self.layer_ranges[w // tp]
                conn.register_kv_caches({"layers.%d.attn" % l: self.caches[w][l - lo] for l in range(lo, hi)})
            # As vLLM's engine core does after the caches are registered:
            # each worker's handshake metadata, keyed by its TP rank, to
            # the scheduler side (a prefill's boot epochs, handed over as
            # kvflow_boot_epochs).
            md = {}
            for conn in self.connectors:
                h = conn.get_handshake_metadata()
                if h is not None:
                    md[conn.tp_rank] = h
            if md:
                self.scheduler.set_xfer_handshake_metadata(md)
        except BaseException:
            self.close()
            raise

    # -- blocks -------------------------------------------------------------

    def _alloc(self, n):
        if len(self.free) < n:
            raise EngineError("%s: out of blocks (%d wanted, %d free)" % (self.role, n, len(self.free)))
        return [self.free.pop() for _ in range(n)]

    def _release(self, req):
        cached = set(self.prefix.values()) if self.prefix is not None else set()
        if self.prefix is not None:
            bs = self.model.cfg.block_size
            p = req.prompt_token_ids
            for i in range(len(p) // bs):
                h = _hash(p[:(i + 1) * bs])
                if h not in self.prefix:
                    self.prefix[h] = req.block_ids[i]
                    cached.add(req.block_ids[i])
        self.free.extend(b for b in req.block_ids if b not in cached)
        req.block_ids = []

    def _prefix_hit(self, prompt):
        """Cached full blocks of the prompt (as vLLM: at most (len-1)//bs,
        so the last prompt token is always computed)."""
        if self.prefix is None:
            return []
        bs = self.model.cfg.block_size
        hit = []
        for i in range((len(prompt) - 1) // bs):
            b = self.prefix.get(_hash(prompt[:(i + 1) * bs]))
            if b is None:
                break
            hit.append(b)
        return hit

    def _blocks_for(self, n_tokens):
        return (n_tokens + self.model.cfg.block_size - 1) // self.model.cfg.block_size

    # -- one engine step: the workers' side in vLLM's order -------------------

    def _step(self, forward=None, finished_req_ids=()):
        meta = self.scheduler.build_connector_meta(None) if self.scheduler else None
        sending, recving, errors = [], [], set()
        for conn in self.connectors:
            conn.bind_connector_metadata(meta)
            conn.start_load_kv(None)
        out = forward() if forward else None
        for conn in self.connectors:
            conn.wait_for_save()
            s, r = conn.get_finished(set(finished_req_ids))
            sending.append(s or set())
            recving.append(r or set())
            errors |= conn.get_block_ids_with_load_errors()
            conn.clear_connector_metadata()
        # vLLM's KVOutputAggregator: finished once every rank says so.
        for rid in set().union(*sending):
            self._count(self._sent, rid, sum(rid in s for s in sending))
        for rid in set().union(*recving):
            self._count(self._recvd, rid, sum(rid in s for s in recving))
        self._errors |= errors
        if self.scheduler:
            self.scheduler.update_connector_output(
                types.SimpleNamespace(finished_recving={r for r, n in self._recvd.items() if n >= self.world}))
        return out

    def _count(self, d, rid, n):
        d[rid] = d.get(rid, 0) + n

    _sent = None

    def _reset_counts(self):
        if self._sent is None:
            self._sent, self._recvd, self._errors = {}, {}, set()

    # -- monolith -------------------------------------------------------------

    def generate(self, prompt, max_tokens, request_id="r"):
        """Monolith: prefill and decode here."""
        req = Request(request_id, prompt, max_tokens)
        hit = self._prefix_hit(prompt)
        req.block_ids = hit + self._alloc(self._blocks_for(len(prompt) + max_tokens) - len(hit))
        start = len(hit) * self.model.cfg.block_size
        logits = self.model.forward(prompt[start:], start, req.block_ids, stages=self.stages)
        self._decode_loop(req, logits)
        self._release(req)
        return req.output_token_ids

    def _decode_loop(self, req, logits):
        while True:
            tok = int(torch.argmax(logits))
            req.output_token_ids.append(tok)
            if len(req.output_token_ids) >= req.max_tokens:
                return
            n = len(req.prompt_token_ids) + len(req.output_token_ids)
            logits = self.model.forward([tok], n - 1, req.block_ids, stages=self.stages)

    # -- prefill instance -------------------------------------------------------

    def prefill(self, request_id, prompt):
        """Prefill one request (max_tokens 1, do_remote_decode) and return
        (first token, kv_transfer_params); its blocks stay held until every
        rank reports the send finished (poll())."""
        self._reset_counts()
        req = Request(request_id, prompt, 1, {"do_remote_decode": True})
        n, _ = self.scheduler.get_num_new_matched_tokens(req, 0)
        hit = self._prefix_hit(prompt)
        req.block_ids = hit + self._alloc(self._blocks_for(len(prompt)) - len(hit))
        self.scheduler.update_state_after_alloc(req, Blocks(req.block_ids[len(hit):]), n)
        start = len(hit) * self.model.cfg.block_size
        logits = self._step(lambda: self.model.forward(prompt[start:], start, req.block_ids,
                                                       stages=self.stages))
        req.output_token_ids.append(int(torch.argmax(logits)))
        req.status = FINISHED_LENGTH_CAPPED
        delay, params = self.scheduler.request_finished(req, list(req.block_ids))
        if delay:
            self._held[request_id] = req
        else:
            self._release(req)
        self._step()  # the next step hands the send to the workers
        return req.output_token_ids[0], params

    @property
    def _held(self):
        if not hasattr(self, "_held_"):
            self._held_ = {}
        return self._held_

    def poll(self):
        """One idle step; frees the held blocks of requests every rank has
        finished sending. Returns the ids freed."""
        self._reset_counts()
        self._step()
        freed = [r for r, n in self._sent.items() if n >= self.world and r in self._held]
        for r in freed:
            self._release(self._held.pop(r))
            del self._sent[r]
        return freed

    # -- decode instance ---------------------------------------------------------

    def decode(self, request_id, prompt, params, max_tokens, peer=None, timeout=30.0, after_load=None, on_step=None):
        """Decode a request prefilled elsewhere: load its KV through kvflow,
        then generate. A load that fails (any block in
        get_block_ids_with_load_errors) is recomputed locally. peer (the
        prefill Instance) is polled meanwhile so that it frees its blocks.
        after_load(instance, req) runs once the load finished, on_step(instance)
        before each step while it runs (tests).
        Returns the output tokens; self.last records what happened."""
        self._reset_counts()
        p = dict(params)
        req = Request(request_id, prompt, max_tokens, p)
        hit = self._prefix_hit(prompt)
        computed = len(hit) * self.model.cfg.block_size
        t0 = time.perf_counter()
        n_ext, is_async = self.scheduler.get_num_new_matched_tokens(req, computed)
        new = self._alloc(self._blocks_for(len(prompt) + max_tokens) - len(hit))
        req.block_ids = hit + new
        ext_blocks = new[:self._blocks_for(computed + n_ext) - len(hit)] if n_ext else []
        self.scheduler.update_state_after_alloc(req, Blocks(ext_blocks), n_ext)
        failed = False
        if is_async:
            deadline = time.monotonic() + timeout
            while self._recvd.get(request_id, 0) < self.world:
                if time.monotonic() > deadline:
                    raise EngineError("decode %s: load not finished within %.0fs" % (request_id, timeout))
                if on_step is not None:
                    on_step(self)
                self._step()
                if peer is not None:
                    peer.poll()
                if self._recvd.get(request_id, 0) < self.world:
                    time.sleep(0.001)
            del self._recvd[request_id]
            failed = bool(self._errors & set(ext_blocks))
            self._errors -= set(ext_blocks)
        t_load = time.perf_counter() - t0
        if after_load is not None:
            after_load(self, req)
        t1 = time.perf_counter()
        if failed or not is_async:
            # recompute everything not held locally (vLLM: kv_load_failure_policy recompute)
            logits = self.model.forward(prompt[computed:], computed, req.block_ids, stages=self.stages)
        else:
            # the pulled KV covers the prompt; the last prompt token is computed here
            logits = self.model.forward(prompt[-1:], len(prompt) - 1, req.block_ids, stages=self.stages)
        t_first = time.perf_counter() - t1
        self._decode_loop(req, logits)
        req.status = FINISHED_LENGTH_CAPPED
        self.scheduler.request_finished(req, list(req.block_ids))
        self._release(req)
        self.last = {"failed": failed, "loaded": is_async and not failed, "prefix_hit_blocks": len(hit),
                     "load_s": t_load, "first_token_s": t_first}
        return req.output_token_ids

    def close(self):
        for conn in self.connectors:
            try:
                conn.shutdown()
            except Exception:  # noqa: BLE001 - close the rest
                pass
        self.connectors = []
        self.caches = []
        self.stages = []
        for f in self._files:
            path = f.path
            f.close()
            try:
                os.unlink(path)
            except OSError:
                pass
        self._files = []

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def _hash(tokens):
    return hashlib.sha256(repr(list(tokens)).encode()).hexdigest()
