"""Monolithic vs disaggregated runs of the tiny engine, and the demo
(python3 -m kvflow.tiny.run)."""

import argparse
import os
import random
import shutil
import sys
import tempfile
import time

from ..sidecar import SidecarError
from .engine import Instance
from .model import TinyConfig, TinyModel


def prompts(n, length, vocab, seed=7, shared_prefix=0):
    rng = random.Random(seed)
    pre = [rng.randrange(vocab) for _ in range(shared_prefix)]
    return [pre + [rng.randrange(vocab) for _ in range(length - shared_prefix)] for _ in range(n)]


def workdir():
    base = "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else None
    return tempfile.mkdtemp(prefix="kvflow-tiny-", dir=base)


class Pair:
    """A prefill instance (TP p, PP prefill_pp) and a decode instance (TP
    d, PP decode_pp), layers split by the partitions or vLLM's default,
    each rank with its own kvflow serve."""

    def __init__(self, model, p, d, dtype="bf16", num_blocks=64, decode_zero_copy=True, prefill_zero_copy=True,
                 prefix_caching=False, kvflow_opts=None, dir=None, decode_pp=1, decode_pp_layer_partition=None,
                 prefill_pp=1, prefill_pp_layer_partition=None):
        self.dir = dir or workdir()
        self._own_dir = dir is None
        self.prefill = self.decode = None
        for attempt in range(3):
            try:
                self.prefill = Instance(model, "prefill", tp=p, dtype=dtype, num_blocks=num_blocks, other_tp=d,
                                        pp=prefill_pp, pp_layer_partition=prefill_pp_layer_partition,
                                        other_pp=decode_pp, other_pp_layer_partition=decode_pp_layer_partition,
                                        engine_id="tiny-p-%d" % os.getpid(), workdir=self.dir,
                                        zero_copy=prefill_zero_copy, kvflow_opts=kvflow_opts)
                self.decode = Instance(model, "decode", tp=d, dtype=dtype, num_blocks=num_blocks, other_tp=p,
                                       pp=decode_pp, pp_layer_partition=decode_pp_layer_partition,
                                       other_pp=prefill_pp, other_pp_layer_partition=prefill_pp_layer_partition,
                                       engine_id="tiny-d-%d" % os.getpid(), workdir=self.dir,
                                       zero_copy=decode_zero_copy, prefix_caching=prefix_caching,
                                       kvflow_opts=kvflow_opts)
                return
            except SidecarError as e:
                self._close_instances()
                # the free ports were taken meanwhile by another process: pick others
                if "in use" not in str(e) or attempt == 2:
                    self.close()
                    raise
            except BaseException:
                self.close()
                raise

    def run(self, request_id, prompt, max_tokens, after_load=None, tamper_params=None):
        t0 = time.perf_counter()
        first, params = self.prefill.prefill(request_id, prompt)
        t_prefill = time.perf_counter() - t0
        if tamper_params:
            params = tamper_params(dict(params))
        toks = self.decode.decode(request_id, prompt, params, max_tokens, peer=self.prefill, after_load=after_load)
        t_all = time.perf_counter() - t0
        # let the prefill free its blocks (DONE may trail the load)
        deadline = time.monotonic() + 10
        while self.prefill._held and time.monotonic() < deadline:
            self.prefill.poll()
            time.sleep(0.001)
        info = dict(self.decode.last, prefill_s=t_prefill, total_s=t_all, prefill_first_token=first,
                    ttft_s=t_prefill + self.decode.last["load_s"] + self.decode.last["first_token_s"])
        return toks, info

    def _close_instances(self):
        for inst in (self.decode, self.prefill):
            if inst is not None:
                inst.close()
        self.prefill = self.decode = None

    def close(self):
        self._close_instances()
        if self._own_dir:
            shutil.rmtree(self.dir, ignore_errors=True)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def monolith(model, dtype, ps, max_tokens, prefix_caching=False):
    with Instance(model, "mono", dtype=dtype, prefix_caching=prefix_caching) as m:
        return [m.generate(p, max_tokens, "m%d" % i) for i, p in enumerate(ps)]


def main(argv=None):
    ap = argparse.ArgumentParser(description="kvflow tiny engine: monolithic vs disaggregated generation")
    ap.add_argument("--prefill-tp", type=int, default=4)
    ap.add_argument("--decode-tp", type=int, default=2)
    ap.add_argument("--decode-pp", type=int, default=1, help="decode pipeline stages")
    ap.add_argument("--decode-pp-layer-partition", default=None,
                    help="decode's VLLM_PP_LAYER_PARTITION, e.g. 1,3 (default: vLLM's split)")
    ap.add_argument("--kv-heads", type=int, default=4, help="KV heads (8 query heads)")
    ap.add_argument("--dtype", default="bf16", choices=["bf16", "fp16", "fp32"])
    ap.add_argument("--requests", type=int, default=8)
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--layers", type=int, default=4)
    a = ap.parse_args(argv)
    cfg = TinyConfig(layers=a.layers, block_size=16, kv_heads=a.kv_heads, q_heads=8, head_dim=32, hidden=128, ffn=256)
    model = TinyModel(cfg)
    ps = prompts(a.requests, a.prompt_len, cfg.vocab)
    t0 = time.perf_counter()
    want = monolith(model, a.dtype, ps, a.max_tokens)
    t_mono = time.perf_counter() - t0
    got, infos = [], []
    with Pair(model, a.prefill_tp, a.decode_tp, dtype=a.dtype, num_blocks=16 * a.requests, decode_pp=a.decode_pp,
              decode_pp_layer_partition=a.decode_pp_layer_partition) as pair:
        t0 = time.perf_counter()
        for i, p in enumerate(ps):
            toks, info = pair.run("req-%d" % i, p, a.max_tokens)
            got.append(toks)
            infos.append(info)
        t_dis = time.perf_counter() - t0
    n_tok = a.requests * a.max_tokens
    ttft = sum(i["ttft_s"] for i in infos) / len(infos)
    load = sum(i["load_s"] for i in infos) / len(infos)
    ok = got == want and all(i["loaded"] for i in infos)
    print("tiny engine: %d layers, %d KV heads x %d, %s, block %d; %d requests x %d prompt tokens, %d new tokens"
          % (cfg.layers, cfg.kv_heads, cfg.head_dim, a.dtype, cfg.block_size, a.requests, a.prompt_len,
             a.max_tokens))
    print("monolith TP 1:          %7.1f tokens/s" % (n_tok / t_mono))
    print("disaggregated TP %d->%d%s:  %7.1f tokens/s (kvflow: %d + %d kvflow serve sidecars)"
          % (a.prefill_tp, a.decode_tp, " PP %d" % a.decode_pp if a.decode_pp > 1 else "", n_tok / t_dis,
             a.prefill_tp, a.decode_tp * a.decode_pp))
    print("time to first token:    %7.2f ms mean, transfer %.2f ms = %.0f%% of it"
          % (ttft * 1e3, load * 1e3, 100 * load / ttft))
    print("tokens identical: %s" % ("yes" if ok else "NO"))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
