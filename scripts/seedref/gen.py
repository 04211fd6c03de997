#!/usr/bin/python3
"""Generate seedref vectors by running the seed's own mooncake_connector.py.

The seed file is loaded from --seed-file at run time under the stand-in modules
of stubs/ (vLLM, vllm_ascend, torch, torch_npu, ZMQ, msgspec, the transfer
engine). Every answer comes from calling the seed's functions and methods;
this file only builds inputs, sets the stand-ins' knobs and records results.

    /usr/bin/python3 scripts/seedref/gen.py --seed-file ../shared/seed/mooncake_connector.py \
        --out /tmp/seedref-alt --salt 1

--salt picks request ids, block ids, random scripts and the sampled
configurations; the same salt gives the same files. See README.md.
"""
import argparse
import hashlib
import importlib.util
import itertools
import json
import os
import random
import sys
import threading
import types

HERE = os.path.dirname(os.path.abspath(__file__))
sys.dont_write_bytecode = True  # keep the tree clean (no __pycache__)
sys.path.insert(0, HERE)
import stubs  # noqa: E402

STATE = stubs.STATE
P_HOST = "192.0.2.20"
P_ENGINE = "engine-P"
D_ENGINE = "engine-D"


# ------------------------------------------------------------------ loading

class _FakeTime:
    """time module seen by the seed: time() is STATE-controlled (tracker expiry)."""

    def __init__(self, real):
        self.real = real
        self.now = 0.0

    def time(self):
        return self.now

    def perf_counter(self):
        return self.real.perf_counter()

    def sleep(self, s):
        pass


def load_seed(path):
    stubs.install()
    spec = importlib.util.spec_from_file_location("seed_mooncake_connector", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    mod.time = _FakeTime(mod.time)
    STATE.pcp_enable = False
    return mod


# ------------------------------------------------------------------ configs

def vllm_config(prefill, decode, heads, mla, tp_size, pp_size=1, dp_rank=0, dp_local=1,
                kv_port=30000, kv_role="kv_consumer", num_layers=4, block_size=16,
                head_dim=128, pcp=1, dcp=1):
    extra = {"prefill": prefill, "decode": decode}
    kv = types.SimpleNamespace(
        engine_id=D_ENGINE if kv_role == "kv_consumer" else P_ENGINE,
        kv_role=kv_role, kv_port=kv_port,
        get_from_extra_config=lambda key, default: extra.get(key, default))
    par = types.SimpleNamespace(
        tensor_parallel_size=tp_size, pipeline_parallel_size=pp_size,
        data_parallel_rank=dp_rank, data_parallel_rank_local=dp_rank,
        data_parallel_size_local=dp_local, data_parallel_size=dp_local,
        prefill_context_parallel_size=pcp, decode_context_parallel_size=dcp)
    hf = types.SimpleNamespace(num_key_value_heads=heads, num_hidden_layers=num_layers,
                               head_dim=head_dim, kv_lora_rank=512, qk_rope_head_dim=64)
    model = types.SimpleNamespace(is_deepseek_mla=mla, hf_config=hf)
    return types.SimpleNamespace(kv_transfer_config=kv, parallel_config=par, model_config=model,
                                 cache_config=types.SimpleNamespace(block_size=block_size))


def set_ranks(tp_rank=0, tp_world=1, pp_rank=0, pcp_enable=False, pcp_world=1, pcp_rank=0,
              dcp_world=1, dcp_rank=0):
    STATE.tp_rank, STATE.tp_world, STATE.pp_rank = tp_rank, tp_world, pp_rank
    STATE.pcp_enable, STATE.pcp_world, STATE.pcp_rank = pcp_enable, pcp_world, pcp_rank
    STATE.dcp_world, STATE.dcp_rank = dcp_world, dcp_rank


def decode_worker(mod, w, pcp_enable=False, num_layers=4):
    """A decode MooncakeConnectorWorker built by the seed's own __init__ from a
    worker dict (prefill_tp, decode_tp, prefill_pp, heads, mla, [use_sparse,
    use_mla, tp_size, tp_rank, pcp_size, pcp_rank, dcp_size])."""
    tp_size = w.get("tp_size", w["decode_tp"])
    set_ranks(tp_rank=w.get("tp_rank", 0), tp_world=tp_size, pcp_enable=pcp_enable,
              pcp_world=w.get("pcp_size", 1), pcp_rank=w.get("pcp_rank", 0),
              dcp_world=w.get("dcp_size", 1), dcp_rank=0)
    cfg = vllm_config({"tp_size": w["prefill_tp"], "dp_size": 1, "pp_size": w["prefill_pp"]},
                      {"tp_size": w["decode_tp"], "dp_size": 1, "pp_size": 1},
                      w["num_key_value_heads"], w["is_deepseek_mla"], tp_size,
                      num_layers=num_layers, pcp=w.get("pcp_size", 1), dcp=w.get("dcp_size", 1))
    worker = mod.MooncakeConnectorWorker(cfg, D_ENGINE)
    # register_kv_caches would set these from the cache tensors.
    worker.use_sparse = w.get("use_sparse", False)
    worker.use_mla = w.get("use_mla", False)
    return worker, cfg


def exc_fields(e):
    return {"exception": type(e).__name__, "message": str(e)}


# ------------------------------------------------------------------ families

def case_hash(mod, req_id):
    h = mod.string_to_int64_hash(req_id)
    return {"req_id": req_id, "req_id_utf8_hex": req_id.encode("utf-8").hex(), "hash": h,
            "hash_dec": str(h), "hash_hex": "%016x" % h}


def case_py_random(mod, req_id, n, k, nbits=4):
    seed = mod.string_to_int64_hash(req_id)
    fresh = random.Random(seed)
    first = [fresh.getrandbits(32) for _ in range(nbits)]
    return {"req_id": req_id, "seed": seed, "first_getrandbits32": first, "n": n, "k": k,
            "sample": random.Random(seed).sample(range(n), k)}


def case_group(mod, src, dst):
    s, d = mod.group_concurrent_contiguous(src, dst)
    return {"src": src, "dst": dst, "expect": {"src_groups": s, "dst_groups": d}}


def case_remote_ranks(mod, config, req_id):
    """config: prefill_tp, decode_tp, prefill_pp, num_key_value_heads,
    is_deepseek_mla, use_sparse. Returns (case, raising_case_or_None)."""
    w = dict(config)
    worker, _ = decode_worker(mod, w)
    worker.use_sparse = config["use_sparse"]
    cfg = dict(config)
    cfg["tp_num_need_pulls"] = worker.tp_num_need_pulls
    call = "_get_remote_ranks_for_req"
    try:
        for_req = worker._get_remote_ranks_for_req(req_id)
        call = "_prefill_get_remote_rank"
        flat = worker._prefill_get_remote_rank(req_id)
        by_tp = []
        for r in range(config["decode_tp"]):
            call = "_get_remote_rank(tp_rank=%d)" % r
            worker.tp_rank = r
            by_tp.append(worker._get_remote_rank(req_id))
    except Exception as e:
        return None, dict({"config": cfg, "req_id": req_id, "call": call}, **exc_fields(e))
    return {"config": cfg, "req_id": req_id, "seed_hash": mod.string_to_int64_hash(req_id),
            "remote_ranks_for_req": for_req, "prefill_get_remote_rank": flat,
            "remote_rank_by_tp_rank": by_tp}, None


def case_prefill_send(mod, worker_cfg, requests_to_send):
    """worker_cfg: prefill_tp, decode_tp, prefill_pp, num_key_value_heads,
    is_deepseek_mla, tp_rank, pp_rank. A prefill worker (seed __init__ with
    tensor_parallel_size = prefill tp) with a KVCacheSendingThread (not started)."""
    w = worker_cfg
    set_ranks(tp_rank=w["tp_rank"], tp_world=w["prefill_tp"], pp_rank=w["pp_rank"])
    cfg = vllm_config({"tp_size": w["prefill_tp"], "dp_size": 1, "pp_size": w["prefill_pp"]},
                      {"tp_size": w["decode_tp"], "dp_size": 1, "pp_size": 1},
                      w["num_key_value_heads"], w["is_deepseek_mla"], w["prefill_tp"],
                      pp_size=w["prefill_pp"], kv_role="kv_producer")
    worker = mod.MooncakeConnectorWorker(cfg, P_ENGINE)
    worker.use_sparse = False
    meta_struct = mod.MooncakeAgentMetadata(engine_id=P_ENGINE, te_rpc_port=17000,
                                            kv_caches_base_addr=[], num_blocks=0)
    send = mod.KVCacheSendingThread(cfg, worker.tp_rank, worker._prefill_tp_size, P_ENGINE,
                                    worker.side_channel_host, worker.side_channel_port,
                                    meta_struct, threading.Event(), {}, worker.pcp_rank)
    delayed, not_transfer = [], []
    orig_delayed, orig_not = send.add_delayed_request, send.add_not_transfer_request

    def rec_delayed(req_id, t):
        delayed.append([req_id, t])
        return orig_delayed(req_id, t)

    def rec_not(req_id):
        not_transfer.append(req_id)
        return orig_not(req_id)

    send.add_delayed_request, send.add_not_transfer_request = rec_delayed, rec_not
    worker.kv_send_thread, worker.kv_recv_thread = send, None
    md = mod.MooncakeConnectorMetadata()
    md.requests_to_send = {rid: t for rid, t in requests_to_send}
    worker.start_load_kv(md)
    return {"worker": dict(w), "requests_to_send": [list(r) for r in requests_to_send],
            "expect": {"delayed": delayed, "not_transfer": not_transfer}}


TPN_KEYS = ("prefill", "decode", "num_key_value_heads", "is_deepseek_mla", "tensor_parallel_size",
            "tp_rank", "pipeline_parallel_size", "pp_rank", "data_parallel_rank",
            "data_parallel_size_local", "prefill_context_parallel_enable", "pcp_world_size",
            "pcp_rank", "dcp_world_size", "dcp_rank", "kv_port")


def case_tp_num_need_pulls(mod, kind, inputs, dropped=None):
    """Runs MooncakeConnectorWorker.__init__ on inputs (with `dropped`
    [section, key] removed from the extra config). Returns (case, raising)."""
    i = inputs
    prefill, decode = dict(i["prefill"]), dict(i["decode"])
    if dropped:
        {"prefill": prefill, "decode": decode}[dropped[0]].pop(dropped[1])
    shown = dict(i)
    shown["prefill"], shown["decode"] = prefill, decode
    set_ranks(tp_rank=i["tp_rank"], tp_world=i["tensor_parallel_size"], pp_rank=i["pp_rank"],
              pcp_enable=i["prefill_context_parallel_enable"], pcp_world=i["pcp_world_size"],
              pcp_rank=i["pcp_rank"], dcp_world=i["dcp_world_size"], dcp_rank=i["dcp_rank"])
    cfg = vllm_config(prefill, decode, i["num_key_value_heads"], i["is_deepseek_mla"],
                      i["tensor_parallel_size"], pp_size=i["pipeline_parallel_size"],
                      dp_rank=i["data_parallel_rank"], dp_local=i["data_parallel_size_local"],
                      kv_port=i["kv_port"],
                      kv_role="kv_producer" if kind == "prefill_worker_ports" else "kv_consumer")
    try:
        w = mod.MooncakeConnectorWorker(cfg, "engine")
    except Exception as e:
        return None, dict({"inputs": shown, "dropped_extra_config_key": dropped}, **exc_fields(e))
    return {"kind": kind, "inputs": shown, "expect": {
        "tp_num_need_pulls": w.tp_num_need_pulls, "side_channel_port": w.side_channel_port,
        "handshake_port": w.handshake_port, "max_device_id": w.max_device_id,
        "pcp_size": w.pcp_size, "pcp_rank": w.pcp_rank, "dcp_size": w.dcp_size,
        "dcp_rank": w.dcp_rank}}, None


def split_branch(w, m):
    """Label of the _get_kv_split_metadata branch (for readers; not an answer)."""
    if m["remote_pcp_size"] * m["remote_dcp_size"] * w["pcp_size"] * w["dcp_size"] == 1:
        return "all_one"
    if w["pcp_size"] == m["remote_pcp_size"] and w["dcp_size"] == m["remote_dcp_size"]:
        return "point_to_point"
    return "split"


def case_kv_split(mod, label, worker_cfg, req_id, meta):
    """worker_cfg as in kv_split_metadata.json (tp_num_need_pulls is recomputed
    by the seed's __init__); meta: local/remote block ids, remote_port,
    remote_pcp_size, remote_dcp_size. Returns (case, raising)."""
    w = dict(worker_cfg)
    worker, _ = decode_worker(mod, w, pcp_enable=True)
    w["tp_num_need_pulls"] = worker.tp_num_need_pulls
    rm = mod.ReqMeta(local_block_ids=list(meta["local_block_ids"]),
                     remote_block_ids=list(meta["remote_block_ids"]), remote_host=P_HOST,
                     remote_port=meta["remote_port"], remote_engine_id=P_ENGINE,
                     remote_pcp_size=meta["remote_pcp_size"],
                     remote_dcp_size=meta["remote_dcp_size"])
    head = {"label": label, "branch": split_branch(w, meta), "worker": w, "req_id": req_id,
            "meta": dict(meta)}
    try:
        ports, local, remote = worker._get_kv_split_metadata(req_id, rm)
    except Exception as e:
        return None, dict(head, **exc_fields(e))
    return dict(head, expect={"remote_handshake_port_list": ports,
                              "local_block_ids_list": local,
                              "remote_block_ids_list": remote}), None


def local_bases(num_layers, cpl):
    return [0x10000000 * (i + 1) for i in range(num_layers * cpl)]


def remote_metadata(port, prefill_tp, prefill_pp, num_layers, cpl, kv_port=30000):
    """What the stand-in prefill rank on side-channel port kv_port+g serves."""
    g = port - kv_port
    stage = g // prefill_tp if prefill_pp > 1 else 0
    lo, hi = stubs.get_pp_indices(num_layers, stage, prefill_pp)
    return {"kv_caches_base_addr": [0x70000000 + 0x40000000 * g + 0x1000000 * i
                                    for i in range((hi - lo) * cpl)],
            "te_rpc_port": 17000 + g}


def install_peer(mod, prefill_tp, prefill_pp, num_layers, cpl):
    enc = mod.msgspec.msgpack.Encoder()

    def peer(path, data):
        msg = stubs.Decoder(type=tuple).decode(data)
        port = int(path.rsplit(":", 1)[1])
        if msg[0] == mod.GET_META_MSG:
            rm = remote_metadata(port, prefill_tp, prefill_pp, num_layers, cpl)
            return enc.encode(mod.MooncakeAgentMetadata(
                engine_id=P_ENGINE, te_rpc_port=rm["te_rpc_port"],
                kv_caches_base_addr=rm["kv_caches_base_addr"], num_blocks=1024))
        if msg[0] == mod.DONE_RECVING_MSG:
            return b"ACK"
        return None

    STATE.peer = peer


def recv_thread(mod, cfg, tp_rank, tp_size, prefill_pp, block_len, num_layers):
    cpl = len(block_len) if len(block_len) > 1 else 2
    kv_caches = {"layer%d" % l: tuple(stubs.Tensor(stubs.np.zeros(1, dtype=stubs.np.int32))
                                      for _ in range(cpl)) for l in range(num_layers)}
    th = mod.KVCacheRecvingThread(tp_rank, tp_size, prefill_pp, stubs.TransferEngine(), D_ENGINE,
                                  40000, local_bases(num_layers, cpl), list(block_len),
                                  threading.Event(), cfg, kv_caches)
    cats = []
    th._cat_kv_cache = lambda block_ids, p: cats.append(
        {"block_ids": [list(b) for b in block_ids], "tp_num_need_pulls": p})
    return th, cats, cpl


def set_partition(partition):
    sys.modules["vllm.envs"].VLLM_PP_LAYER_PARTITION = partition


def run_start_load(mod, sc):
    """sc: scenario dict (scenario, engine_return, prefill_context_parallel_enable,
    vllm_pp_layer_partition, worker, requests, block_len, num_layers).
    Returns (start_load_kv case or raising case, is_raising, queued req_metas)."""
    set_partition(sc["vllm_pp_layer_partition"])
    w = sc["worker"]
    worker, cfg = decode_worker(mod, w, pcp_enable=sc["prefill_context_parallel_enable"],
                                num_layers=sc["num_layers"])
    wout = dict(w)
    wout["tp_num_need_pulls"] = worker.tp_num_need_pulls
    th, _, cpl = recv_thread(mod, cfg, worker.tp_rank, worker.tp_size, worker._prefill_pp_size,
                             sc["block_len"], sc["num_layers"])
    worker.kv_recv_thread, worker.kv_send_thread = th, None
    md = mod.MooncakeConnectorMetadata()
    for r in sc["requests"]:
        md.add_new_req(request_id=r["req_id"], local_block_ids=list(r["local_block_ids"]),
                       kv_transfer_params={"remote_block_ids": list(r["remote_block_ids"]),
                                           "remote_engine_id": P_ENGINE, "remote_host": P_HOST,
                                           "remote_port": r["remote_port"],
                                           "remote_pcp_size": r["remote_pcp_size"],
                                           "remote_dcp_size": r["remote_dcp_size"]})
    head = {"scenario": sc["scenario"], "engine_return": sc["engine_return"],
            "prefill_context_parallel_enable": sc["prefill_context_parallel_enable"],
            "vllm_pp_layer_partition": sc["vllm_pp_layer_partition"], "worker": wout,
            "requests": [dict(r) for r in sc["requests"]]}
    try:
        worker.start_load_kv(md)
    except Exception as e:
        return dict(head, **exc_fields(e)), True, []
    calls = []
    while not th.request_queue.empty():
        calls.append(th.request_queue.get_nowait())
    queued = [json.loads(json.dumps(c)) for c in calls]
    STATE.sent, STATE.transfers, STATE.engine_return = [], [], sc["engine_return"]
    install_peer(mod, w["prefill_tp"], w["prefill_pp"], sc["num_layers"], cpl)
    for c in calls:
        th._handle_request(c)
    done = [{"path": p, "bytes_hex": b.hex()} for p, b in STATE.sent
            if stubs.Decoder(type=tuple).decode(b)[0] == mod.DONE_RECVING_MSG]
    finished = sorted(th.get_and_clear_finished_requests())
    record = sorted(th.task_tracker.record_finished_requests)
    STATE.peer = None
    set_partition(None)
    return dict(head, add_request_calls=queued, done_messages=done, finished_recving=finished,
                recv_tracker_record_finished_requests=record), False, queued


def case_transfer(mod, scenario, partition, engine_return, prefill_tp, prefill_pp, heads, mla,
                  tp_rank, tp_size, block_len, num_layers, req_meta):
    """_transfer_kv_cache(req_meta) on a fresh KVCacheRecvingThread. Returns (case, raising)."""
    set_partition(partition)
    cfg = vllm_config({"tp_size": prefill_tp, "dp_size": 1, "pp_size": prefill_pp},
                      {"tp_size": tp_size, "dp_size": 1, "pp_size": 1}, heads, mla, tp_size,
                      num_layers=num_layers)
    th, cats, cpl = recv_thread(mod, cfg, tp_rank, tp_size, prefill_pp, block_len, num_layers)
    install_peer(mod, prefill_tp, prefill_pp, num_layers, cpl)
    STATE.transfers, STATE.engine_return = [], engine_return
    thread = {"block_len": list(block_len), "num_hidden_layers": num_layers,
              "num_cache_per_layer": cpl, "prefill_pp_size": prefill_pp, "tp_rank": tp_rank,
              "local_engine_id": D_ENGINE, "local_handshake_port": 40000,
              "local_kv_caches_base_addr": local_bases(num_layers, cpl)}
    head = {"scenario": scenario, "vllm_pp_layer_partition": partition,
            "engine_return": engine_return, "thread": thread, "req_meta": dict(req_meta)}
    def fetched():
        """What the seed cached from its GET_META_MSG (None: never asked)."""
        port = req_meta["remote_handshake_port"]
        eng = req_meta["remote_engine_id"]
        if eng in th.kv_caches_base_addr and port in th.kv_caches_base_addr[eng]:
            return {"kv_caches_base_addr": th.kv_caches_base_addr[eng][port],
                    "te_rpc_port": th.remote_te_port[eng][port]}
        return None
    try:
        th._transfer_kv_cache(dict(req_meta))
        out = dict(head, remote_metadata=fetched(),
            expect={"batch_transfer_sync_read": STATE.transfers, "cat_kv_cache": cats}), None
    except Exception as e:
        # remote_metadata here too, so a reader of the raising case needs no
        # address convention to check the reads made before the raise.
        out = None, dict(head, **exc_fields(e), remote_metadata=fetched(),
                         batch_transfer_sync_read=STATE.transfers)
    STATE.peer = None
    set_partition(None)
    return out


def case_transpose(mod, num_blocks, p, block_size, num_kv_head, head_dim, start):
    """KVCacheRecvingThread._transpose_kv_cache_between_head on a numpy-backed tensor."""
    np = stubs.np
    th = object.__new__(mod.KVCacheRecvingThread)
    tokens = num_blocks * block_size
    shape = [tokens, num_kv_head, head_dim]
    data = np.arange(start, start + tokens * num_kv_head * head_dim, dtype=np.int32)
    out = th._transpose_kv_cache_between_head(stubs.Tensor(data.reshape(shape)), num_blocks,
                                              block_size, tokens, num_kv_head, p)
    return {"kind": "transpose", "num_blocks": num_blocks, "tp_num_need_pulls": p,
            "block_size": block_size, "num_kv_head": num_kv_head, "head_dim": head_dim,
            "input_shape": shape, "input": data.tolist(), "output_shape": list(out.shape),
            "output": out.arr.reshape(-1).tolist()}


def case_cat(mod, cache_shape, block_ids, p, heads, tp_size, layers=2):
    """The seed's whole _cat_kv_cache on int32 caches (K, V per layer); the two NPU
    ops have the ASSUMED semantics of stubs.npu_paged_cache_load/_npu_reshape_and_cache."""
    np = stubs.np
    th = object.__new__(mod.KVCacheRecvingThread)
    n = int(np.prod(cache_shape))
    kv, before = {}, {}
    for l in range(layers):
        k = np.arange(1000 * (2 * l + 1), 1000 * (2 * l + 1) + n, dtype=np.int32).reshape(cache_shape)
        v = np.arange(1000 * (2 * l + 2), 1000 * (2 * l + 2) + n, dtype=np.int32).reshape(cache_shape)
        kv["layer%d" % l] = (stubs.Tensor(k), stubs.Tensor(v))
        before["layer%d" % l] = [k.reshape(-1).tolist(), v.reshape(-1).tolist()]
    th.kv_caches = kv
    th.tp_size = tp_size
    cfg = vllm_config({}, {}, heads, False, tp_size, block_size=cache_shape[1],
                      head_dim=cache_shape[3])
    th.vllm_config, th.model_config = cfg, cfg.model_config
    th._cat_kv_cache([list(b) for b in block_ids], p)
    after = {name: [t.arr.reshape(-1).tolist() for t in pair] for name, pair in kv.items()}
    return {"kind": "cat_kv_cache", "cache_shape": list(cache_shape),
            "block_ids": [list(b) for b in block_ids], "tp_num_need_pulls": p,
            "num_key_value_heads": heads, "tp_size": tp_size, "caches_before": before,
            "caches_after": after}


def gen_head(mod, rng):
    cases = []
    for _ in range(12):
        p = rng.choice([1, 2, 2, 4, 8])
        heads = p * rng.choice([1, 1, 2])
        cases.append(case_transpose(mod, rng.randrange(1, 4), p, rng.choice([1, 2, 3, 4, 8]),
                                    heads, rng.choice([1, 2, 3, 4]), rng.randrange(100, 900)))
    for _ in range(6):
        p = rng.choice([2, 2, 4])
        tp = rng.choice([1, 2])
        heads_local = p * rng.choice([1, 2])
        nb = rng.randrange(3, 7)
        shape = [nb, rng.choice([2, 4]), heads_local, rng.choice([1, 2])]
        ids = [[b] for b in rng.sample(range(nb), rng.randrange(1, nb))]
        cases.append(case_cat(mod, shape, ids, p, heads_local * tp, tp))
    return cases


def tracker_state(tr):
    return {"finished_requests": sorted(tr.finished_requests),
            "record_finished_requests": sorted(tr.record_finished_requests),
            "delayed_free_requests": [[k, v] for k, v in tr.delayed_free_requests.items()]}


def case_tracker(mod, timeout, steps):
    """steps: dicts with op and request_id / delay_start_time / now."""
    sys.modules["vllm.envs"].VLLM_NIXL_ABORT_REQUEST_TIMEOUT = timeout
    tr = mod.KVCacheTaskTracker()
    out = []
    for s in steps:
        o = {"op": s["op"]}
        if s["op"] == "add_delayed_request":
            o.update(request_id=s["request_id"], delay_start_time=s["delay_start_time"])
            tr.add_delayed_request(s["request_id"], s["delay_start_time"])
        elif s["op"] == "update_done_task_count":
            o["request_id"] = s["request_id"]
            tr.update_done_task_count(s["request_id"])
        elif s["op"] == "add_not_transfer_request":
            o["request_id"] = s["request_id"]
            tr.add_not_transfer_request(s["request_id"])
        else:
            o["now"] = s["now"]
            mod.time.now = s["now"]
            o["result"] = sorted(tr.get_and_clear_finished_requests())
        o["state"] = tracker_state(tr)
        out.append(o)
    sys.modules["vllm.envs"].VLLM_NIXL_ABORT_REQUEST_TIMEOUT = 480
    return {"timeout": timeout, "steps": out}


# ------------------------------------------------------------------ inputs

def req_ids(rng, n):
    """Request ids of the public set's kinds (OpenAI-style, numeric, random ascii,
    random unicode, long repeated, whitespace/control), drawn from rng."""
    alnum = "abcdefghijklmnopqrstuvwxyz0123456789_-"
    uni = [(0x00C0, 0x024F), (0x0370, 0x03FF), (0x0400, 0x04FF), (0x0E00, 0x0E7F),
           (0x1100, 0x11FF), (0x2000, 0x2BFF), (0x3040, 0x30FF), (0x4E00, 0x9FFF),
           (0xAC00, 0xD7A3), (0x1F300, 0x1F6FF), (0x1F900, 0x1F9FF)]
    out, seen = [], set()
    kinds = ["cmpl32", "cmpl16", "chat", "req", "ascii", "unicode", "repeat", "ws", "digits"]
    while len(out) < n:
        k = kinds[len(out) % len(kinds)] if len(out) < 2 * len(kinds) else rng.choice(kinds)
        if k == "cmpl32":
            s = "cmpl-%032x-%d" % (rng.getrandbits(128), rng.randrange(8))
        elif k == "cmpl16":
            s = "cmpl-%016x-%d" % (rng.getrandbits(64), rng.randrange(10))
        elif k == "chat":
            s = "chatcmpl-" + "".join(rng.choice(alnum[:36]) for _ in range(rng.randrange(3, 30)))
        elif k == "req":
            s = "req-%d" % rng.randrange(10 ** 8, 10 ** 9)
        elif k == "ascii":
            s = "".join(rng.choice(alnum) for _ in range(rng.randrange(1, 64)))
        elif k == "unicode":
            s = ""
            for _ in range(rng.randrange(1, 11)):
                lo, hi = rng.choice(uni)
                s += chr(rng.randrange(lo, hi + 1))
        elif k == "repeat":
            s = rng.choice("abqxyzQZ7.") * rng.randrange(20, 700)
        elif k == "ws":
            s = "".join(rng.choice(["\t", "\n", " ", "\r", "\x00", "\x7f", "ok", "é", "-"])
                        for _ in range(rng.randrange(1, 8)))
        else:
            s = str(rng.randrange(0, 10 ** rng.randrange(1, 19)))
        if s not in seen:
            seen.add(s)
            out.append(s)
    return out


def blocks(rng, n, lo=0, hi=400):
    """n block ids: runs of contiguous ids with random gaps."""
    out, b = [], rng.randrange(lo, hi)
    for _ in range(n):
        out.append(b)
        b += 1 if rng.random() < 0.7 else rng.randrange(2, 9)
    return out


def gen_hash(mod, rng, ids):
    return [case_hash(mod, r) for r in ids]


def gen_py_random(mod, rng, ids):
    cases = []
    for r in ids:
        n = rng.choice([1, 2, 3, 4, 5, 6, 8, 12, 16, 20, 21, 22, 24, 32, 48, 64, 100, 128, 256])
        k = rng.randrange(1, n + 1) if rng.random() < 0.5 else min(n, rng.choice([1, 2, 4, 5, 6, 8, 16]))
        cases.append(case_py_random(mod, r, n, k))
    # sweeps over k for a few ids: pool/set method boundaries (setsize 21, 4**ceil);
    # as in the public set, these carry one first_getrandbits32 word
    for r in rng.sample(ids, 4):
        n = rng.choice([21, 22, 32, 64, 100, 200])
        for k in sorted(set([1, 2, 4, 5, 6, 8, 11, 16, 21, min(n, 22), n])):
            if k <= n:
                cases.append(case_py_random(mod, r, n, k, nbits=1))
    return cases


def gen_group(mod, rng):
    cases = [case_group(mod, [], [])]
    for _ in range(60):
        n = rng.randrange(1, 24)
        mode = rng.randrange(4)
        if mode == 0:
            s0, d0 = rng.randrange(200), rng.randrange(200)
            src, dst = list(range(s0, s0 + n)), list(range(d0, d0 + n))
        elif mode == 1:
            src, dst = blocks(rng, n), blocks(rng, n)
        elif mode == 2:
            src, dst = rng.sample(range(300), n), blocks(rng, n)
        else:
            src, dst = [rng.randrange(50) for _ in range(n)], [rng.randrange(50) for _ in range(n)]
        cases.append(case_group(mod, src, dst))
    return cases


def gen_remote_ranks(mod, rng, ids):
    grid = []
    for ptp in (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 64):
        for dtp in (1, 2, 3, 4, 6, 8, 16):
            if dtp > ptp or ptp % dtp:
                continue
            for pp in (1, 2, 3, 4):
                if ptp * pp > 128:
                    continue
                for heads in (1, 2, 4, 8, 16, 32, 64, 128):
                    for mla, sparse in ((False, False), (True, False), (False, True), (True, True)):
                        grid.append({"prefill_tp": ptp, "decode_tp": dtp, "prefill_pp": pp,
                                     "num_key_value_heads": heads, "is_deepseek_mla": mla,
                                     "use_sparse": sparse})
    chosen = rng.sample(grid, min(len(grid), 1400))
    cases, raising, total = [], [], 0
    for cfg in chosen:
        for r in rng.sample(ids, 2):
            c, e = case_remote_ranks(mod, cfg, r)
            if c:
                cases.append(c)
            else:
                total += 1
                if len(raising) < 12 and all(x["config"] != e["config"] for x in raising):
                    raising.append(e)
    return cases, raising, total


def gen_prefill_send(mod, rng, ids):
    topos = [(2, 1, 1, 2, False), (2, 2, 1, 8, False), (4, 1, 1, 1, False), (4, 2, 1, 8, False),
             (4, 2, 2, 2, False), (4, 4, 1, 4, False), (8, 1, 1, 8, False), (8, 2, 1, 1, True),
             (8, 2, 2, 1, True), (8, 4, 1, 2, False), (8, 4, 1, 16, False), (8, 8, 1, 8, False),
             (16, 2, 1, 1, True), (16, 4, 1, 4, False), (16, 4, 2, 8, False), (4, 1, 4, 4, False),
             (2, 1, 3, 1, True), (6, 2, 1, 2, False), (6, 3, 1, 1, True), (12, 4, 1, 4, False),
             (32, 4, 1, 1, True), (8, 1, 2, 2, False)]
    cases = []
    for ptp, dtp, pp, heads, mla in topos:
        n = rng.randrange(1, 6)
        reqs = [[r, 1000.0 + j] for j, r in enumerate(rng.sample(ids, n))]
        for pr in range(pp):
            for tr in range(ptp):
                cases.append(case_prefill_send(mod, {
                    "prefill_tp": ptp, "decode_tp": dtp, "prefill_pp": pp,
                    "num_key_value_heads": heads, "is_deepseek_mla": mla,
                    "tp_rank": tr, "pp_rank": pr}, reqs))
    return cases


def tpn_inputs(ptp, dtp, ppp, heads, mla, tp_size, tp_rank=0, pp_size=1, pp_rank=0, dp_rank=0,
               dp_local=1, pcp_enable=False, pcp_world=1, pcp_rank=0, dcp_world=1, dcp_rank=0,
               kv_port=30000):
    return {"prefill": {"tp_size": ptp, "dp_size": 1, "pp_size": ppp},
            "decode": {"tp_size": dtp, "dp_size": 1, "pp_size": 1},
            "num_key_value_heads": heads, "is_deepseek_mla": mla, "tensor_parallel_size": tp_size,
            "tp_rank": tp_rank, "pipeline_parallel_size": pp_size, "pp_rank": pp_rank,
            "data_parallel_rank": dp_rank, "data_parallel_size_local": dp_local,
            "prefill_context_parallel_enable": pcp_enable, "pcp_world_size": pcp_world,
            "pcp_rank": pcp_rank, "dcp_world_size": dcp_world, "dcp_rank": dcp_rank,
            "kv_port": kv_port}


def gen_tpn(mod, rng):
    cases, raising = [], []

    def add(kind, inputs, dropped=None):
        c, e = case_tp_num_need_pulls(mod, kind, inputs, dropped)
        (cases.append(c) if c else raising.append(e))

    for ptp in (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 64):
        for dtp in (1, 2, 3, 4, 6, 8, 16):
            if dtp > ptp or ptp % dtp:
                continue
            for heads in (1, 2, 4, 8, 16, 32, 64, 128):
                for mla in (False, True):
                    if rng.random() < 0.5:
                        ppp = rng.choice([1, 1, 2, 3, 4])
                        port = rng.choice([30000, 20000, 41000])
                        add("decode_worker", tpn_inputs(ptp, dtp, ppp, heads, mla, dtp,
                                                        tp_rank=rng.randrange(dtp), kv_port=port))
    # prefill workers: every rank's ports (pp, dp, pcp)
    for ptp, pp, dpl, pcp in ((2, 1, 1, 1), (4, 2, 1, 1), (2, 3, 1, 1), (4, 1, 2, 1), (2, 2, 2, 1),
                              (4, 1, 1, 2), (2, 1, 2, 2), (8, 1, 1, 2), (3, 1, 1, 3)):
        heads = rng.choice([1, 2, 4, 8, 16])
        mla = rng.random() < 0.3
        for dp_rank in range(dpl):
            for pr in range(pp):
                for pcr in range(pcp):
                    for tr in range(ptp):
                        add("prefill_worker_ports", tpn_inputs(
                            ptp, rng.choice([d for d in (1, 2, 4) if ptp % d == 0]), pp, heads,
                            mla, ptp, tp_rank=tr, pp_size=pp, pp_rank=pr, dp_rank=dp_rank,
                            dp_local=dpl, pcp_enable=pcp > 1, pcp_world=pcp, pcp_rank=pcr,
                            kv_port=rng.choice([30000, 35000])))
    # decode with dcp; pcp world ignored when pcp disabled
    for dcp in (2, 4):
        add("decode_worker", tpn_inputs(8, 4, 1, 8, False, 4, tp_rank=1, dcp_world=dcp, dcp_rank=1))
        add("decode_worker", tpn_inputs(4, 4, 1, 1, True, 4, tp_rank=3, dcp_world=dcp,
                                        dcp_rank=dcp - 1))
    add("decode_worker", tpn_inputs(4, 2, 1, 8, False, 2, pcp_enable=False, pcp_world=2, pcp_rank=1))
    # raising
    add("decode_worker", tpn_inputs(4, 8, 1, 8, False, 8))
    add("decode_worker", tpn_inputs(2, 3, 1, 1, True, 3))
    add("decode_worker", tpn_inputs(8, 8, 1, 8, False, 8, pp_size=2, pcp_enable=True, pcp_world=2))
    bad = tpn_inputs(8, 2, 1, 8, False, 2)
    bad["decode"]["pp_size"] = 2
    add("decode_worker", bad)
    for sect, key in (("prefill", "tp_size"), ("prefill", "dp_size"), ("decode", "tp_size"),
                      ("decode", "dp_size")):
        add("decode_worker", tpn_inputs(8, 2, 1, 8, False, 2), [sect, key])
    return cases, raising


def gen_kv_split(mod, rng, ids):
    """Worker setups per label, each over D tp/pcp ranks and random block lists."""
    def w(ptp, dtp, heads, mla, sparse=False, pcp=1, dcp=1, use_mla=None):
        return {"prefill_tp": ptp, "decode_tp": dtp, "prefill_pp": 1,
                "num_key_value_heads": heads, "is_deepseek_mla": mla, "use_sparse": sparse,
                "use_mla": mla and not sparse if use_mla is None else use_mla, "tp_size": dtp,
                "tp_rank": 0, "pcp_size": pcp, "pcp_rank": 0, "dcp_size": dcp,
                "tp_num_need_pulls": 0}
    setups = [
        ("trivial", w(4, 4, 8, False), [(1, 1)]),
        ("trivial", w(8, 2, 8, False), [(1, 1)]),
        ("trivial", w(8, 4, 1, True), [(1, 1)]),
        ("point_to_point", w(4, 4, 8, False, pcp=2), [(2, 1)]),
        ("point_to_point", w(2, 2, 4, False, pcp=3), [(3, 1)]),
        ("point_to_point", w(8, 4, 1, True, pcp=2), [(2, 1)]),
        ("point_to_point", w(4, 2, 1, True, pcp=2, dcp=2), [(2, 2)]),
        ("point_to_point", w(8, 4, 8, False, dcp=4), [(1, 4)]),
        ("point_to_point", w(8, 2, 16, False, pcp=2), [(2, 1)]),
        ("mla_split", w(8, 1, 1, True), [(2, 1), (4, 1), (1, 2), (2, 4), (1, 8)]),
        ("mla_split", w(8, 8, 1, True), [(2, 1), (1, 2), (2, 2), (1, 8), (3, 1)]),
        ("mla_split", w(4, 4, 1, True), [(3, 1), (2, 4), (1, 4)]),
        ("gqa_split", w(8, 8, 16, False), [(2, 1), (1, 2), (1, 8), (2, 4), (3, 1)]),
        ("gqa_split", w(2, 2, 4, False), [(2, 1), (1, 2), (4, 2)]),
        ("mla_split_dcp", w(8, 8, 1, True, dcp=2), [(1, 2), (2, 4), (1, 8), (2, 2)]),
        ("mla_split_dcp", w(8, 8, 1, True, dcp=4), [(1, 8), (2, 4)]),
        ("gqa_split_dcp", w(8, 8, 8, False, dcp=2), [(1, 4), (2, 2), (3, 2)]),
        ("gqa_split_dcp", w(4, 4, 4, False, dcp=4), [(1, 4), (2, 4)]),
        ("sparse_split", w(4, 4, 1, True, sparse=True), [(2, 1), (1, 2)]),
        ("raises_pcp_mismatch", w(4, 4, 8, False, pcp=2), [(1, 1), (4, 1)]),
        ("raises_gqa_tp_mismatch", w(8, 4, 8, False), [(2, 1)]),
        ("raises_mla_tp", w(8, 4, 1, True), [(2, 1)]),
        ("raises_dcp_mismatch", w(8, 8, 8, False, dcp=2), [(1, 8)]),
    ]
    cases, raising = [], []
    for label, base, remotes in setups:
        for rpcp, rdcp in remotes:
            for tr in range(base["tp_size"]):
                for pr in range(base["pcp_size"]):
                    for _ in range(rng.randrange(1, 3)):
                        wk = dict(base, tp_rank=tr, pcp_rank=pr)
                        n = rng.choice([0, 1, 2, 3, 5, 7, 8, 13, 16])
                        local = blocks(rng, n)
                        if label.startswith("point_to_point") or label == "trivial":
                            rn = n if rng.random() < 0.8 else n + rng.randrange(1, 3)
                        else:
                            parts = max(1, rpcp * max(1, rdcp // base["dcp_size"]))
                            rn = -(-n // parts) + (1 if rng.random() < 0.2 else 0)
                        meta = {"local_block_ids": local, "remote_block_ids": blocks(rng, rn),
                                "remote_port": rng.choice([30000, 30000, 31000]),
                                "remote_pcp_size": rpcp, "remote_dcp_size": rdcp}
                        c, e = case_kv_split(mod, label, wk, rng.choice(ids), meta)
                        (cases.append(c) if c else raising.append(e))
    return cases, raising


def vary_scenarios(rng, sc, w, req):
    """--vary: the scenarios above with other block lengths and layer counts
    (kept consistent with their PP partitions), plus random GQA and MLA
    topologies (prefill TP, decode TP, PP, KV heads), so a set differs in
    shapes and topologies, not only in ids and block ids."""
    def scale(bl):
        # block_len per part: any multiple of 128 bytes (divisible by any
        # tp_num_need_pulls up to 16), remote blocks stay inside 16 MiB.
        return [rng.choice([128, 256, 384, 640, 1024, 1536, 2048, 3072, 4096, 6144, 8192,
                            12288, 16384, 24576, 32768]) for _ in bl]
    out = []
    for name, wk, pcpe, part, er, bl, layers, reqs in sc:
        if part is None:
            layers = max(layers, wk["prefill_pp"]) + rng.randrange(0, 4)
        out.append((name, wk, pcpe, part, er, scale(bl), layers, reqs))
    for i in range(8):
        mla = rng.random() < 0.3
        ptp = rng.choice([1, 2, 4, 8, 16])
        dtp = rng.choice([d for d in (1, 2, 4, 8) if d <= ptp and ptp % d == 0])
        pp = rng.choice([1, 1, 2, 3])
        heads = 1 if mla else rng.choice([h for h in (1, 2, 4, 8, 16, 32)])
        layers = pp + rng.randrange(0, 6)
        bl = scale([0, 0] if mla else [0])
        er = rng.choice([0, 0, 0, -1])
        reqs = [req(rng.randrange(0, 7)) for _ in range(rng.randrange(1, 3))]
        out.append(("vary_%s_%d_p%d_d%d_pp%d_h%d" % ("mla" if mla else "gqa", i, ptp, dtp, pp, heads),
                    w(ptp, dtp, pp, heads, mla), False, None, er, bl, layers, reqs))
    return out


def start_scenarios(rng, ids, vary=False):
    def w(ptp, dtp, pp, heads, mla, sparse=False, pcp=1, pcp_rank=0, dcp=1):
        return {"prefill_tp": ptp, "decode_tp": dtp, "prefill_pp": pp,
                "num_key_value_heads": heads, "is_deepseek_mla": mla, "use_sparse": sparse,
                "use_mla": mla and not sparse, "tp_size": dtp, "tp_rank": 0, "pcp_size": pcp,
                "pcp_rank": pcp_rank, "dcp_size": dcp, "tp_num_need_pulls": 0}

    def req(n_local, n_remote=None, rpcp=1, rdcp=1, port=30000):
        n_remote = n_local if n_remote is None else n_remote
        return {"req_id": None, "local_block_ids": blocks(rng, n_local, 0, 60),
                "remote_block_ids": blocks(rng, n_remote, 0, 200), "remote_port": port,
                "remote_pcp_size": rpcp, "remote_dcp_size": rdcp}
    G, M, S = [8192], [16384, 2048], [16384, 2048, 4096]
    # name, worker, pcp_enable, partition, engine_return, block_len, layers, requests
    sc = [
        ("gqa_tpn1", w(4, 4, 1, 8, False), False, None, 0, G, 4, [req(6), req(3, 7), req(4)]),
        ("gqa_tpn2", w(8, 4, 1, 4, False), False, None, 0, [4096], 3, [req(5), req(2, 3)]),
        ("gqa_tpn4", w(8, 2, 1, 8, False), False, None, 0, G, 2, [req(3)]),
        ("gqa_tpn8", w(16, 2, 1, 16, False), False, None, 0, G, 2, [req(2)]),
        ("gqa_tpn2_pp2", w(4, 2, 2, 4, False), False, None, 0, [4096], 5, [req(3)]),
        ("gqa_tpn2_pp3", w(4, 2, 3, 4, False), False, None, 0, [4096], 7, [req(2)]),
        ("gqa_random_pp2", w(8, 2, 2, 2, False), False, None, 0, G, 4, [req(2), req(1)]),
        ("mla_pp2", w(4, 2, 2, 1, True), False, None, 0, M, 5, [req(5)]),
        ("mla_pp4", w(8, 4, 4, 1, True), False, None, 0, M, 9, [req(3), req(2)]),
        ("mla_random", w(16, 4, 1, 1, True), False, None, 0, M, 3, [req(4), req(1), req(2)]),
        ("sparse_pp1", w(2, 1, 1, 1, True, True), False, None, 0, S, 3, [req(4)]),
        ("sparse_pp2", w(4, 2, 2, 1, True, True), False, None, 0, S, 4, [req(2)]),
        ("gqa_pp4_partition", w(2, 2, 4, 8, False), False, "2,1,3,2", 0, G, 8, [req(4)]),
        ("gqa_tpn2_pp3_partition", w(4, 2, 3, 4, False), False, "1,4,1", 0, [4096], 6, [req(3)]),
        ("empty_local", w(4, 4, 1, 8, False), False, None, 0, G, 2, [req(0, 3)]),
        ("engine_failure", w(4, 2, 1, 4, False), False, None, -1, [4096], 2, [req(2)]),
        ("engine_failure_mla", w(4, 2, 2, 1, True), False, None, -3, M, 4, [req(2)]),
        ("pcp_split_mla", w(4, 4, 1, 1, True), True, None, 0, M, 2,
         [req(7, 2, rpcp=2, rdcp=2), req(3, 2, rpcp=2, rdcp=1)]),
        ("pcp_split_gqa", w(4, 4, 1, 8, False), True, None, 0, G, 2, [req(5, 3, rpcp=2)]),
        ("pcp_split_sparse", w(2, 2, 1, 1, True, True), True, None, 0, S, 2, [req(4, 2, rpcp=2)]),
        ("pcp_trivial_gqa_tpn2", w(8, 4, 1, 4, False), True, None, 0, [4096], 2, [req(3)]),
        ("pcp_trivial_mla", w(8, 2, 1, 1, True), True, None, 0, M, 2, [req(2), req(0, 2)]),
        ("pcp_point_to_point", w(4, 4, 1, 8, False, pcp=2, pcp_rank=1), True, None, 0, G, 2,
         [req(2, rpcp=2)]),
        ("pcp_point_to_point_r0", w(2, 2, 1, 8, False, pcp=2, pcp_rank=0), True, None, 0, G, 2,
         [req(3, rpcp=2)]),
        ("pcp_point_to_point_empty", w(2, 2, 1, 8, False, pcp=2, pcp_rank=1), True, None, 0, G, 2,
         [req(0, 0, rpcp=2)]),
        ("pcp_point_to_point_tpn2", w(8, 4, 1, 8, False, pcp=2), True, None, 0, [4096], 2,
         [req(2, rpcp=2)]),
    ]
    if vary:
        sc = vary_scenarios(rng, sc, w, req)
    out = []
    for name, wk, pcpe, part, er, bl, layers, reqs in sc:
        for tr in range(wk["tp_size"]):
            rr = []
            for r, rid in zip(reqs, rng.sample(ids, len(reqs))):
                r = dict(r, req_id=rid)
                rr.append(r)
            out.append({"scenario": name, "engine_return": er,
                        "prefill_context_parallel_enable": pcpe, "vllm_pp_layer_partition": part,
                        "worker": dict(wk, tp_rank=tr), "requests": rr, "block_len": bl,
                        "num_layers": layers})
    return out


def gen_start_and_transfer(mod, rng, ids, vary=False):
    s_cases, s_raising, t_cases, t_raising = [], [], [], []
    for sc in start_scenarios(rng, ids, vary):
        c, raised, queued = run_start_load(mod, sc)
        (s_raising if raised else s_cases).append(c)
        w = sc["worker"]
        for rm in queued:
            tc, te = case_transfer(mod, sc["scenario"], sc["vllm_pp_layer_partition"],
                                   sc["engine_return"], w["prefill_tp"], w["prefill_pp"],
                                   w["num_key_value_heads"], w["is_deepseek_mla"], w["tp_rank"],
                                   w["tp_size"], sc["block_len"], sc["num_layers"], rm)
            (t_cases.append(tc) if tc else t_raising.append(te))
    # transfer-only inputs the planner never queues
    extra = [("local_longer_than_remote", 0, [8192], 1, {"local": 3, "remote": 2, "P": 1, "off": 0}),
             ("engine_returns_negative", -5, [8192], 1, {"local": 2, "remote": 2, "P": 1, "off": 0}),
             ("prefix_hit_local_shorter", 0, [8192], 1, {"local": 2, "remote": 6, "P": 1, "off": 0}),
             ("prefix_hit_tpn2", 0, [4096], 1, {"local": 2, "remote": 5, "P": 2, "off": 1})]
    for name, er, bl, pp, r in extra:
        rm = {"request_id": rng.choice(ids), "local_block_ids": blocks(rng, r["local"], 0, 50),
              "remote_block_ids": blocks(rng, r["remote"], 0, 50), "remote_engine_id": P_ENGINE,
              "remote_host": P_HOST, "remote_handshake_port": 30000 + r["off"],
              "offset": r["off"], "tp_num_need_pulls": r["P"], "all_task_done": True}
        tc, te = case_transfer(mod, name, None, er, 2 * r["P"], pp, 4, False, 0, 2, bl, 2, rm)
        (t_cases.append(tc) if tc else t_raising.append(te))
    return s_cases, s_raising, t_cases, t_raising


def gen_tracker(mod, rng):
    cases = []
    for _ in range(40):
        timeout = rng.choice([0, 1, 2, 3, 5, 10, 30, 480])
        names = ["r%d" % i for i in range(rng.randrange(1, 5))]
        steps, now = [], 0.0
        for _ in range(rng.randrange(3, 12)):
            op = rng.choice(["add_delayed_request", "add_delayed_request", "update_done_task_count",
                             "add_not_transfer_request", "get_and_clear_finished_requests",
                             "get_and_clear_finished_requests"])
            now += rng.choice([0.0, 0.25, 0.5, 1.0, 2.0, timeout, timeout + 0.5, 7.0])
            if op == "add_delayed_request":
                steps.append({"op": op, "request_id": rng.choice(names), "delay_start_time": now})
            elif op == "get_and_clear_finished_requests":
                steps.append({"op": op, "now": now})
            elif op == "update_done_task_count":
                # the seed pops delayed requests on DONE; a DONE for a name
                # recorded twice raises KeyError only if popped twice, never here
                steps.append({"op": op, "request_id": rng.choice(names)})
            else:
                steps.append({"op": op, "request_id": rng.choice(names)})
        steps.append({"op": "get_and_clear_finished_requests", "now": now + timeout + 1.0})
        try:
            cases.append(case_tracker(mod, timeout, steps))
        except Exception:
            continue
    return cases


# ------------------------------------------------------------------ output

DESCRIPTIONS = {
    "string_to_int64_hash": "string_to_int64_hash(req_id): first 8 bytes of sha256(utf-8) read little-endian as uint64. `hash` is a JSON number that needs uint64 (it exceeds 2^53); `hash_dec`/`hash_hex` carry the same value as strings.",
    "py_random_sample": "Reference for the stdlib call the seed makes in _get_remote_ranks_for_req: random.Random(seed).sample(range(n), k) with seed = string_to_int64_hash(req_id). Not seed code: CPython's MT19937 seeding (init_by_array of the 32-bit words of the seed) and sample() (pool method when n <= setsize, set method otherwise; setsize = 21, +4**ceil(log(3k, 4)) when k > 5). first_getrandbits32 is a fresh generator's output.",
    "group_concurrent_contiguous": "group_concurrent_contiguous(src, dst): split both lists where either src[i+1]-src[i] != 1 or dst[i+1]-dst[i] != 1; empty input -> ([], []). Inputs have equal lengths.",
    "get_remote_ranks": "MooncakeConnectorWorker._get_remote_ranks_for_req(req_id) (list per decode tp rank of prefill ranks, pp offset tp + pp*prefill_tp included), _prefill_get_remote_rank (flattened) and _get_remote_rank with tp_rank = 0..decode_tp-1. Worker built by the seed's __init__ (tensor_parallel_size = decode tp), use_sparse set afterwards. Configs where any of these calls raised are left out of `cases`; a few are kept in `raising_cases` (raising_total counts all skipped case instances).",
    "prefill_send_decision": "start_load_kv on a prefill worker (kv_send_thread set, no requests to receive): a request goes to add_delayed_request when worker.tp_rank is in _prefill_get_remote_rank(req_id), else to add_not_transfer_request. pp_rank is only informational: the seed compares tp_rank (no pp offset) with ranks that include tp + pp*prefill_tp.",
    "tp_num_need_pulls": "MooncakeConnectorWorker.__init__ run for real (stubbed vllm/vllm_ascend getters): tp_num_need_pulls (1 if is_deepseek_mla else max(1,H//tp)//max(1,H//prefill_tp)), side_channel_port = kv_port + dp_rank*tp*pp*pcp, handshake_port = side_channel_port + (pp_rank+pcp_rank)*tp + tp_rank, max_device_id, pcp/dcp sizes and ranks. pcp_world_size/pcp_rank only count when prefill_context_parallel_enable is true.",
    "kv_split_metadata": "MooncakeConnectorWorker._get_kv_split_metadata(req_id, meta) -> (remote_handshake_port_list, local_block_ids_list, remote_block_ids_list). Branches: `branch` all_one (all cp/dcp sizes 1; uses _get_remote_rank), point_to_point (pcp/dcp equal on both sides; only the first port is kept), split (D pcp 1, each D rank pulls from remote pcp*(remote_dcp/dcp) P ranks, remainder blocks rotated to the end). worker.tp_size is the D tp size; remote_port is the P side-channel base port.",
    "start_load_kv": "MooncakeConnectorWorker.start_load_kv(metadata) on a decode worker: the kv_recv_thread.add_request(...) calls in order (prefill_context_parallel_enable picks the _get_kv_split_metadata path), then every queued request run through the seed's _handle_request (transfer, DONE_RECVING_MSG to the P port, tracker): done_messages are the msgpack bytes sent, finished_recving is get_and_clear_finished_requests() afterwards and recv_tracker_record_finished_requests the receiving tracker's record set (never drained on D).",
    "transfer_kv_cache": "KVCacheRecvingThread._transfer_kv_cache(req_meta): the exact batch_transfer_sync_read(session_id, src_list, dst_list, length_list) calls and the arguments _cat_kv_cache would get (monkeypatched to record). req_meta dicts are the ones start_load_kv queued. Local base address of flattened cache i = 0x10000000*(i+1); the P rank on side-channel port 30000+g serves kv_caches_base_addr[i] = 0x70000000 + 0x40000000*g + 0x1000000*i for its own pp stage's layers (get_pp_indices, VLLM_PP_LAYER_PARTITION when set) and te_rpc_port 17000+g; session_id = host:te_rpc_port. Empty calls list = early return.",
    "head_transpose": "Head re-interleave after a tp_num_need_pulls > 1 pull. kind=transpose: the seed's _transpose_kv_cache_between_head on a numpy-backed tensor: input [tokens, heads, head_dim] (tokens = num_blocks*block_size) viewed as [num_blocks, P, block_size, -1], axes 1,2 swapped, made contiguous, viewed as [tokens, heads, -1]; row-major int arrays. kind=cat_kv_cache: the seed's whole _cat_kv_cache on int32 caches [num_blocks, block_size, heads, head_dim] per layer (K, V); npu_paged_cache_load = gather the tokens of block_ids in order, _npu_reshape_and_cache = scatter token i to slot block_id*block_size+offset (ASSUMED semantics of the two NPU ops).",
    "task_tracker": "KVCacheTaskTracker scripts. time.time() is replaced by the step's `now` for get_and_clear_finished_requests; VLLM_NIXL_ABORT_REQUEST_TIMEOUT = case timeout. A delayed request expires when now - start > timeout (strict), scanning delayed_free_requests from the oldest insertion and stopping at the first unexpired one. `result` is the returned set (sorted); `state` is the tracker's internals after the step (sets sorted, the ordered dict in insertion order).",
}


def write(out, family, salt, seed_sha, cases, raising=None, raising_total=None):
    doc = {"description": DESCRIPTIONS[family], "set": "generated salt=%d" % salt,
           "generator": "scripts/seedref/gen.py (runs the seed's own code under scripts/seedref/stubs/)",
           "seed": "xc-llm-ascend vllm_ascend/distributed/mooncake_connector.py",
           "seed_sha256": seed_sha, "python": "%d.%d" % sys.version_info[:2]}
    if raising_total is not None:
        doc["raising_total"] = raising_total
    if raising is not None:
        doc["raising_cases"] = raising
    doc["cases"] = cases
    with open(os.path.join(out, family + ".json"), "w", encoding="utf-8") as f:
        json.dump(doc, f, indent=1)
        f.write("\n")
    n = len(cases) + len(raising or [])
    print("%-28s %5d cases %4d raising" % (family, len(cases), len(raising or [])))
    return n


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seed-file", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--salt", type=int, default=1)
    ap.add_argument("--vary", action="store_true",
                    help="also vary start_load_kv/transfer_kv_cache shapes and topologies "
                         "(block lengths, layer counts, random GQA/MLA TP/PP/heads)")
    a = ap.parse_args()
    with open(a.seed_file, "rb") as f:
        seed_sha = hashlib.sha256(f.read()).hexdigest()
    mod = load_seed(a.seed_file)
    os.makedirs(a.out, exist_ok=True)
    rng = random.Random("kvflow-seedref-%d" % a.salt)
    ids = req_ids(rng, 60)
    w = lambda fam, *x, **k: write(a.out, fam, a.salt, seed_sha, *x, **k)  # noqa: E731
    w("string_to_int64_hash", gen_hash(mod, rng, ids))
    w("py_random_sample", gen_py_random(mod, rng, ids))
    w("group_concurrent_contiguous", gen_group(mod, rng))
    c, r, total = gen_remote_ranks(mod, rng, ids)
    w("get_remote_ranks", c, r, raising_total=total)
    w("prefill_send_decision", gen_prefill_send(mod, rng, ids))
    c, r = gen_tpn(mod, rng)
    w("tp_num_need_pulls", c, r)
    c, r = gen_kv_split(mod, rng, ids)
    w("kv_split_metadata", c, r)
    sc, sr, tc, tr = gen_start_and_transfer(mod, rng, ids, a.vary)
    w("start_load_kv", sc, sr)
    w("transfer_kv_cache", tc, tr)
    w("task_tracker", gen_tracker(mod, rng))
    w("head_transpose", gen_head(mod, rng))


if __name__ == "__main__":
    main()
