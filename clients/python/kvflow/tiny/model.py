"""A tiny decoder-only transformer with a block-paged KV cache, for proving
KV transfers right by computation. Seeded random weights (float64 compute,
so that batched and single-token paths agree to the last bit that matters),
a few layers, grouped-query attention over several KV heads, rotary
position embeddings, greedy decoding. The KV cache is held per tensor-
parallel rank: rank r of an instance of TP t holds KV heads
[r*H/t, (r+1)*H/t) of every layer as K and V tensors of
[num_blocks, block_size, H/t, head_dim] in the cache dtype (bf16, fp16 or
fp32), exactly as kvflow lays out one rank's cache file; when t > H, the
heads are replicated as vLLM does: rank r holds head r // (t/H) alone.
Each rank attends its own query heads [r*Q/t, (r+1)*Q/t) over its own
cache, so every rank's cache is used. With pipeline parallelism each
stage's ranks hold only that stage's layers (vLLM's get_pp_indices) and
the activations pass from stage to stage.

TP here splits the KV cache and attention (what kvflow moves and
stitches); the projections are computed once per instance, the same for
every TP, so that a TP 4 prefill and a TP 2 decode compute what a TP 1
monolith computes."""

import math
import types

import torch

from ..parallel import kv_head_start, kv_heads_per_rank


class TinyConfig:
    def __init__(self, vocab=96, hidden=64, layers=2, q_heads=8, kv_heads=4, head_dim=16, ffn=128,
                 block_size=4, rope_theta=10000.0, seed=1234, mla=False, kv_lora_rank=32, rope_dim=8):
        self.mla, self.kv_lora_rank, self.rope_dim = mla, kv_lora_rank, rope_dim
        if mla:
            kv_heads = 1  # one latent "head", replicated on every TP rank
        if q_heads % kv_heads:
            raise ValueError("q_heads %d not a multiple of kv_heads %d" % (q_heads, kv_heads))
        self.vocab, self.hidden, self.layers = vocab, hidden, layers
        self.q_heads, self.kv_heads, self.head_dim, self.ffn = q_heads, kv_heads, head_dim, ffn
        self.block_size, self.rope_theta, self.seed = block_size, rope_theta, seed


class TinyModel:
    def __init__(self, cfg):
        self.cfg = cfg
        g = torch.Generator().manual_seed(cfg.seed)

        def w(*shape):
            return torch.randn(*shape, generator=g, dtype=torch.float64) / math.sqrt(shape[0])

        c = cfg
        self.embed = torch.randn(c.vocab, c.hidden, generator=g, dtype=torch.float64)
        self.layers = []
        for _ in range(c.layers):
            L = {"wo": w(c.q_heads * c.head_dim, c.hidden),
                 "w1": w(c.hidden, c.ffn), "w3": w(c.hidden, c.ffn), "w2": w(c.ffn, c.hidden)}
            if c.mla:
                # latent KV (kv_lora_rank) + a shared rotary key (rope_dim),
                # expanded per head at attention time, as DeepSeek's MLA
                L.update({"wq_nope": w(c.hidden, c.q_heads * c.head_dim), "wq_rope": w(c.hidden, c.q_heads * c.rope_dim),
                          "wdkv": w(c.hidden, c.kv_lora_rank), "wkr": w(c.hidden, c.rope_dim),
                          "wuk": w(c.kv_lora_rank, c.q_heads * c.head_dim),
                          "wuv": w(c.kv_lora_rank, c.q_heads * c.head_dim)})
            else:
                L.update({"wq": w(c.hidden, c.q_heads * c.head_dim), "wk": w(c.hidden, c.kv_heads * c.head_dim),
                          "wv": w(c.hidden, c.kv_heads * c.head_dim)})
            self.layers.append(L)
        self.out = w(c.hidden, c.vocab) * 4.0  # sharper logits: fewer near-ties
        self.inv_freq = self._freqs(c.head_dim)
        self.inv_freq_mla = self._freqs(c.rope_dim)

    def _freqs(self, dim):
        half = dim // 2
        return 1.0 / (self.cfg.rope_theta ** (torch.arange(half, dtype=torch.float64) / half))

    def _rope(self, x, pos, inv_freq=None):
        # x: [n, heads, head_dim]; rotate pairs (first half, second half)
        inv_freq = self.inv_freq if inv_freq is None else inv_freq
        ang = pos.to(torch.float64)[:, None] * inv_freq[None, :]
        cos, sin = ang.cos()[:, None, :], ang.sin()[:, None, :]
        half = x.shape[-1] // 2
        a, b = x[..., :half], x[..., half:]
        return torch.cat([a * cos - b * sin, a * sin + b * cos], dim=-1)

    @staticmethod
    def _norm(x):
        return x / torch.sqrt((x * x).mean(-1, keepdim=True) + 1e-6)

    def forward(self, tokens, start, block_table, ranks=None, stages=None):
        """Run tokens (list of ids) at positions start..start+n-1 of a
        sequence whose positions 0..start-1 are already in the cache.
        block_table: the sequence's block ids; ranks: per TP rank, per
        layer, (K, V) tensors; or stages: per PP stage (first layer, end
        layer, ranks), each rank holding that stage's layers only (the
        activations pass from stage to stage). Writes the new positions'
        K/V and returns the logits of the last token (float64)."""
        c = self.cfg
        if stages is None:
            stages = [(0, c.layers, ranks)]
        n = len(tokens)
        end = start + n
        pos = torch.arange(start, end)
        bs = c.block_size
        nblk = (end + bs - 1) // bs
        st = types.SimpleNamespace(
            n=n, end=end, pos=pos, nblk=nblk, table=torch.tensor(block_table[:nblk], dtype=torch.long),
            causal=torch.arange(end)[None, :] <= pos[:, None])  # [n, end]
        st.slots_blk, st.slots_off = st.table[pos // bs], pos % bs
        x = self.embed[torch.tensor(tokens, dtype=torch.long)]
        for lo, hi, stage_ranks in stages:
            x = self._stage(x, lo, hi, stage_ranks, st)
        return (self._norm(x[-1]) @ self.out)

    def _stage(self, x, lo, hi, ranks, st):
        """Layers [lo, hi) over one PP stage's TP ranks (ranks[r][li - lo])."""
        c = self.cfg
        n, end, bs = st.n, st.end, c.block_size
        tp = len(ranks)
        group = c.q_heads // c.kv_heads
        qpr = c.q_heads // tp
        for li in range(lo, hi):
            L = self.layers[li]
            h = self._norm(x)
            if c.mla:
                a = self._mla(L, h, st.pos, li - lo, ranks, st.table, st.nblk, st.slots_blk, st.slots_off,
                              st.causal, end)
            else:
                q = self._rope((h @ L["wq"]).view(n, c.q_heads, c.head_dim), st.pos)
                k = self._rope((h @ L["wk"]).view(n, c.kv_heads, c.head_dim), st.pos)
                v = (h @ L["wv"]).view(n, c.kv_heads, c.head_dim)
                hpr = kv_heads_per_rank(c.kv_heads, tp)
                outs = []
                for r, rank in enumerate(ranks):
                    # rank r: query heads [r*qpr, (r+1)*qpr) over its own KV
                    # heads [h0, h0+hpr), as a TP rank computes them
                    kc, vc = rank[li - lo]
                    h0 = kv_head_start(c.kv_heads, tp, r)
                    kc[st.slots_blk, st.slots_off] = k[:, h0:h0 + hpr].to(kc.dtype)
                    vc[st.slots_blk, st.slots_off] = v[:, h0:h0 + hpr].to(vc.dtype)
                    K = kc[st.table].reshape(st.nblk * bs, hpr, c.head_dim)[:end].to(torch.float64)
                    V = vc[st.table].reshape(st.nblk * bs, hpr, c.head_dim)[:end].to(torch.float64)
                    idx = torch.tensor([(r * qpr + j) // group - h0 for j in range(qpr)], dtype=torch.long)
                    K, V = K[:, idx], V[:, idx]  # [end, qpr, d]
                    s = torch.einsum("nhd,thd->hnt", q[:, r * qpr:(r + 1) * qpr], K) / math.sqrt(c.head_dim)
                    s = s.masked_fill(~st.causal[None], float("-inf"))
                    outs.append(torch.einsum("hnt,thd->nhd", torch.softmax(s, dim=-1), V))
                a = torch.cat(outs, dim=1).reshape(n, -1)
            x = x + a @ L["wo"]
            h2 = self._norm(x)
            x = x + (torch.nn.functional.silu(h2 @ L["w1"]) * (h2 @ L["w3"])) @ L["w2"]
        return x

    def _mla(self, L, h, pos, li, ranks, table, nblk, slots_blk, slots_off, causal, end):
        """MLA attention: every rank caches the same latent and rotary key
        (written by all, as TP ranks do); rank r's query heads read rank r's
        copy, so every rank's pulled cache is used."""
        c = self.cfg
        n = h.shape[0]
        bs = c.block_size
        lat = (h @ L["wdkv"]).view(n, 1, c.kv_lora_rank)
        kr = self._rope((h @ L["wkr"]).view(n, 1, c.rope_dim), pos, self.inv_freq_mla)
        qn = (h @ L["wq_nope"]).view(n, c.q_heads, c.head_dim)
        qr = self._rope((h @ L["wq_rope"]).view(n, c.q_heads, c.rope_dim), pos, self.inv_freq_mla)
        hpr = c.q_heads // len(ranks)
        outs = []
        for r, rank in enumerate(ranks):
            lc, rc = rank[li]
            lc[slots_blk, slots_off] = lat.to(lc.dtype)
            rc[slots_blk, slots_off] = kr.to(rc.dtype)
        for r, rank in enumerate(ranks):
            lc, rc = rank[li]
            C = lc[table].reshape(nblk * bs, c.kv_lora_rank)[:end].to(torch.float64)   # [end, R]
            KR = rc[table].reshape(nblk * bs, c.rope_dim)[:end].to(torch.float64)      # [end, P]
            hs = slice(r * hpr, (r + 1) * hpr)
            K = (C @ L["wuk"]).view(end, c.q_heads, c.head_dim)[:, hs]
            V = (C @ L["wuv"]).view(end, c.q_heads, c.head_dim)[:, hs]
            s = (torch.einsum("nhd,thd->hnt", qn[:, hs], K) + torch.einsum("nhd,td->hnt", qr[:, hs], KR))
            s = s / math.sqrt(c.head_dim + c.rope_dim)
            s = s.masked_fill(~causal[None], float("-inf"))
            outs.append(torch.einsum("hnt,thd->nhd", torch.softmax(s, dim=-1), V))
        return torch.cat(outs, dim=1).reshape(n, -1)
