"""Fused per-token log-probs and entropy of sampled tokens, for PPO on LLMs; and ppo_tokens.py's other fast paths.

PPO needs, for every generated token t with logits x (V,) and temperature T, with z = x / T:

    logp    = z[t] - lse,            lse = log sum_j exp(z_j)
    entropy = lse - sum_j p_j z_j,   p = softmax(z)

and their gradients, many times per batch. The eager way (`log_softmax(x.float() / T)` then gather) writes and keeps
several float32 copies of a (tokens, vocab) tensor; at 152k vocab that is most of a GPU's memory and time. Here:

- `token_logprobs` reads each row of logits once in the forward with an online log-sum-exp (running max and rescaled
  sum, Milakov & Gimelshein 2018, "Online normalizer calculation for softmax"; the trick of flash-attention and of
  the cross-entropy kernels of flash-attn and Liger-Kernel), keeps three floats per row for the backward, and in the
  backward reads the logits once more and writes d(logits) once, optionally into the logits' own storage. With
  a = dL/dlogp and b = dL/dentropy:

      dL/dx_j = (1/T) * ( a * (1[j == t] - p_j)  -  b * p_j * (z_j - sum_i p_i z_i) )

- `linear_token_logprobs` does the same from the last hidden states and the lm_head weight, chunk by chunk over
  tokens, never holding the (tokens, vocab) logits (Liger-Kernel's fused linear cross-entropy; unlike Liger, which
  knows the scalar loss in the forward, our two outputs get arbitrary upstream gradients, so the backward recomputes
  each chunk's logits: one extra matmul per chunk).

Each has a Triton path (CUDA, or CPU tensors under TRITON_INTERPRET=1) that sums in float32 relative to the row max m
(x - m is exact for the logits that carry probability, so dividing by T rounds no large offset), and a plain PyTorch
path (CPU; with float64 input it is the reference the tests compare against). `python kernels.py --bench` measures.

The second half holds ppo_tokens.py's other fast paths (see "fast paths"). This file needs torch, triton and
transformers only, never ppo_tokens.py, which loads it as `ppo_tokens_kernels`.
"""
import argparse
import contextlib
import functools
import importlib.machinery
import importlib.util
import inspect
import json
import os
import sys
import tempfile
import threading
import time

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: the torch path still works
    triton = None

# The Hugging Face Hub's package, which transformers >= 5.25 imports, is also called `kernels`; a script run in this
# directory finds this file first. Imported by that name, this file hands it to the Hub's package (an import returns
# sys.modules[name] once the module body has run). Without that package it stays: transformers then finds no version
# of it, and an ImportError here would break that check. (ppo_tokens.py loads this file as `ppo_tokens_kernels`.)
if __name__ == "kernels":  # the Hub's is a package: skip every folder with a kernels.py (this project, renamed or
    # copied: two copies would hand the name back and forth)
    _elsewhere = [p for p in sys.path if not os.path.isfile(os.path.join(p or os.curdir, "kernels.py"))]
    _hub = importlib.machinery.PathFinder.find_spec("kernels", _elsewhere)
    if _hub is not None:
        sys.modules["kernels"] = importlib.util.module_from_spec(_hub)
        _hub.loader.exec_module(sys.modules["kernels"])

# 4096 float32 values per block: with 8 warps, 16 per thread, enough bytes in flight per SM to saturate HBM (Little's
# law: ~5 TB/s x ~1 us latency / 132 SMs ~ 40 KB) while the three per-block reductions stay a small part of the work.
# The online update is per block: one exp per logit (a second would make the H200's SFUs the limit). Tests lower it.
BLOCK_V = 4096
_TORCH_CHUNK_ELEMS = 1 << 22  # the torch path's row chunks: at most 16 MB of float32 temporaries per chunk
_LINEAR_CHUNK_BYTES = 256 << 20  # linear_token_logprobs: at most this many bytes of float32 logits per chunk
_LAUNCH_LOCK = threading.Lock()  # sampler and trainer threads launch the kernels: Triton's compile is not thread-safe


# ---------------------------------------------------------------------------------------------------- shared helpers

def _pick_backend(backend, x):  # float64 (the tests' reference) always takes the torch path
    if backend == "auto":
        use = x.is_cuda and triton is not None and x.dtype != torch.float64 and triton_works(x.device)
        return "triton" if use else "torch"
    return backend


@functools.cache
def triton_works(device) -> bool:
    """Whether the Triton kernels compile and run on device: once, at set-up (fused_head_agrees calls it first)."""
    try:  # (a forward compiles as the backward does)
        token_logprobs(torch.zeros(2, 64, device=device), torch.zeros(2, dtype=torch.long, device=device), 1.0,
                       backend="triton")
        return True
    except Exception as e:  # e.g. its first compile's launcher found no C compiler or no Python.h
        fall_back(f"Triton kernels off ({str(e).splitlines()[0][:200]}); log-probs on the torch path. Triton "
                  "compiles with a C compiler and the Python development headers")
        return False


def _flat_inputs(rows, tokens, mask, kept_ids):
    """The per-row inputs, checked against rows (the logits' shape without the vocab dim: a Triton kernel would read
    out of bounds), as contiguous (N,) and (N, K) tensors."""
    for name, t in (("tokens", tokens), ("mask", mask)):
        if t is not None and t.shape != rows:
            raise ValueError(f"{name} has shape {tuple(t.shape)}, expected {tuple(rows)}")
    if kept_ids is not None and kept_ids.shape[:-1] != rows:
        raise ValueError(f"kept_ids has shape {tuple(kept_ids.shape)}, expected {tuple(rows)} + (K,)")
    n = tokens.numel()
    mask = None if mask is None else mask.reshape(n).bool().contiguous()
    kept_ids = None if kept_ids is None else kept_ids.reshape(n, kept_ids.shape[-1]).long().contiguous()
    return tokens.reshape(n).long().contiguous(), mask, kept_ids


# ---------------------------------------------------------------------------------------------------- torch path

def _torch_chunks(logits, mask, kept):
    """logits as (N, V) rows, the compute dtype (float32; float64 for float64), the real row ids (None = all) and
    row chunks of at most _TORCH_CHUNK_ELEMS elements over them, slices or id tensors (masked rows are never read)."""
    x2d = logits.reshape(-1, logits.shape[-1])  # a copy (input dtype) only if the leading dims cannot be merged
    cdtype = torch.promote_types(logits.dtype, torch.float32)
    n_rows = x2d.shape[0]
    step = max(1, _TORCH_CHUNK_ELEMS // (x2d.shape[1] if kept is None else kept.shape[1]))
    rows = None if mask is None else mask.nonzero().squeeze(1)
    if rows is None or rows.numel() == n_rows:
        return x2d, cdtype, None, [slice(r0, min(r0 + step, n_rows)) for r0 in range(0, n_rows, step)]
    return x2d, cdtype, rows, [rows[r0:r0 + step] for r0 in range(0, rows.numel(), step)]


def _torch_log_probs(x2d, tokens, kept, temperature, cdtype, ids, row_max=None):
    """log p (n, V) of rows `ids`, or (n, K) over their kept ids, in cdtype, with -inf clamped to the most negative
    finite value (p * log p = 0 there, not NaN); with T != 1 the row max is subtracted before dividing, as in Triton.
    Returns log p, logp of the sampled tokens (n,), the row max (None when T = 1), the chunk's tokens and kept ids."""
    z = x2d[ids]                                                                # (n, V)
    tok = tokens[ids]                                                           # (n,)
    if kept is not None:
        kept = kept[ids]                                                        # (n, K)
        z = z.gather(1, kept.clamp(min=0)).masked_fill_(kept < 0, float("-inf"))
    if temperature != 1.0:
        row_max = z.amax(dim=1).to(cdtype) if row_max is None else row_max[ids]  # (n,) in logit units
        z = torch.sub(z, row_max[:, None]).div_(temperature)                   # (n, V) in cdtype
    log_p = torch.log_softmax(z, dim=1, dtype=cdtype).clamp_(min=torch.finfo(cdtype).min)
    if kept is None:
        logp = log_p.gather(1, tok[:, None]).squeeze(1)
    else:  # the sampled token's slot in the kept set, if it has one
        hit = kept == tok[:, None]                                              # (n, K)
        logp = log_p.gather(1, hit.long().argmax(dim=1, keepdim=True)).squeeze(1)
        logp = torch.where(hit.any(dim=1), logp, float("-inf"))
    return log_p, logp, row_max, tok, kept


def _torch_forward(logits, tokens, mask, kept, temperature):
    """logp and entropy (N,), masked rows 0, then what _torch_backward needs: the row max (None when T = 1) and a
    copy of the entropy (the caller may modify the output in place)."""
    x2d, cdtype, _, chunks = _torch_chunks(logits, mask, kept)
    logp, entropy, row_max = [x2d.new_zeros(x2d.shape[0], dtype=cdtype) for _ in range(3)]  # (N,) each
    for ids in chunks:
        log_p, chunk_logp, chunk_max, _, _ = _torch_log_probs(x2d, tokens, kept, temperature, cdtype, ids)
        logp[ids] = chunk_logp
        entropy[ids] = log_p.exp().mul_(log_p).sum(dim=1).neg_()                 # -sum p log p
        if temperature != 1.0:
            row_max[ids] = chunk_max
    return logp, entropy, row_max if temperature != 1.0 else None, entropy.clone()


def _torch_backward(logits, tokens, mask, kept, temperature, row_max, entropy, g_logp, g_ent, inplace):
    x2d, cdtype, rows, chunks = _torch_chunks(logits, mask, kept)
    N = x2d.shape[0]
    a = g_logp / temperature                                                    # (N,)
    b = g_ent / temperature                                                     # (N,)
    # Masked rows and the vocab outside a kept set get exactly 0; a single dense chunk is the gradient itself. In
    # place, each chunk's gradient overwrites its logits after they were read (kept ids: never in place, the kept
    # logits of later chunks would be zeroed before they are read).
    grad = None
    if inplace and kept is None:
        grad = x2d
        if rows is not None:
            grad.index_fill_(0, (~mask).nonzero().squeeze(1), 0.0)
    elif rows is not None or kept is not None or len(chunks) > 1:
        grad = torch.zeros(x2d.shape, dtype=logits.dtype, device=logits.device)
    for ids in chunks:
        log_p, _, _, tok, k = _torch_log_probs(x2d, tokens, kept, temperature, cdtype, ids, row_max)
        a_c = a[ids][:, None]                                                   # (n, 1)
        b_c = b[ids][:, None]                                                   # (n, 1)
        p = log_p.exp()                                                         # (n, V)
        # z - sum p z = log p + entropy, so dz = -p (a + b (log p + H)) (+ a at the sampled token); multiplied by
        # p first: at clamped -inf logits (log p + H) * b could overflow
        dz = log_p.add_(entropy[ids][:, None]).mul_(p).mul_(b_c).addcmul_(p, a_c).neg_()
        if k is None:
            dz.scatter_add_(1, tok[:, None], a_c)
            if grad is None:
                return dz.to(logits.dtype).view(logits.shape)
            grad[ids] = dz.to(grad.dtype)
        else:
            dz.add_((k == tok[:, None]) * a_c).masked_fill_(k < 0, 0.0)
            row_idx = torch.arange(N, device=grad.device)[ids][:, None].expand_as(k)
            grad.index_put_((row_idx, k.clamp(min=0)), dz.to(grad.dtype), accumulate=True)
    return grad.view(logits.shape)


# ---------------------------------------------------------------------------------------------------- triton path

if triton is not None:
    @triton.jit
    def _logprob_fwd_kernel(
        x_ptr, n_inner, x_stride_outer, x_stride_inner,
        logp_ptr, ent_ptr, max_ptr, lse_ptr, zbar_ptr,
        tok_ptr, mask_ptr, kept_ptr, kept_stride, n_cols, inv_temp,
        HAS_KEPT: tl.constexpr, BLOCK: tl.constexpr,
    ):
        # One program per row; row r starts at (r // n_inner) * stride_outer + (r % n_inner) * stride_inner, which
        # reads slices like logits[:, P-1:-1] in place. int64: rows x vocab passes 2^31 quickly.
        row = tl.program_id(0).to(tl.int64)
        x_row = x_ptr + (row // n_inner) * x_stride_outer + (row % n_inner) * x_stride_inner
        tok = tl.load(tok_ptr + row)
        active = tl.load(mask_ptr + row) != 0
        n_todo = tl.where(active, n_cols, 0)  # a masked row runs zero iterations: it costs nothing
        x_tok = tl.load(x_row + tok, mask=active, other=0.0).to(tl.float32)
        # Online softmax over the row in blocks: m = running max of x (logit units), z = (x - m) / T,
        # l = sum exp(z), s = sum exp(z) z. When the max grows, old terms scale by alpha and s's old z shift.
        m = float("-inf")
        l = 0.0
        s = 0.0
        found = 0
        for start in range(0, n_todo, BLOCK):
            offs = start + tl.arange(0, BLOCK)
            if HAS_KEPT:  # gather only the K kept logits of this row
                cols = tl.load(kept_ptr + row * kept_stride + offs, mask=offs < n_cols, other=-1)
                valid = cols >= 0
                found += tl.sum((cols == tok).to(tl.int32), axis=0)
            else:
                cols = offs
                valid = offs < n_cols
            x = tl.load(x_row + cols, mask=valid, other=float("-inf")).to(tl.float32)
            m_new = tl.maximum(m, tl.max(x, axis=0))
            m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)  # all -inf so far: exps are 0, not NaN
            z = (x - m_ref) * inv_temp
            z_old = (m - m_ref) * inv_temp
            alpha = tl.exp(z_old)
            e = tl.exp(z)
            shift = tl.where(l > 0, z_old * l, 0.0)  # (-inf * 0 before the first finite value)
            s = alpha * (s + shift) + tl.sum(tl.where(e > 0, e * z, 0.0), axis=0)  # e = 0: no 0 * -inf
            l = l * alpha + tl.sum(e, axis=0)
            m = m_new
        l = tl.maximum(l, 1e-30)  # only a masked (or all -inf) row has l = 0; keeps its discarded values finite
        lse = tl.log(l)           # log sum exp((x - m) / T), in [0, log V]
        zbar = s / l              # sum p z
        logp = (x_tok - m) * inv_temp - lse
        if HAS_KEPT:
            logp = tl.where(found > 0, logp, float("-inf"))  # sampled token outside the kept set
        tl.store(logp_ptr + row, tl.where(active, logp, 0.0))
        tl.store(ent_ptr + row, tl.where(active, lse - zbar, 0.0))
        tl.store(max_ptr + row, tl.where(active, m, 0.0))
        tl.store(lse_ptr + row, lse)
        tl.store(zbar_ptr + row, zbar)

    @triton.jit
    def _logprob_bwd_kernel(
        x_ptr, n_inner, x_stride_outer, x_stride_inner,
        dx_ptr, dx_stride_outer, dx_stride_inner, max_ptr, lse_ptr, zbar_ptr, glogp_ptr, gent_ptr,
        tok_ptr, mask_ptr, kept_ptr, kept_stride, n_cols, inv_temp,
        HAS_KEPT: tl.constexpr, BLOCK: tl.constexpr,
    ):
        # Recomputes p from the saved row max and lse (no saved probabilities): reads the row once, writes d(row)
        # once. dx may be x itself (in-place backward): each element is read before it is written, by one program.
        row = tl.program_id(0).to(tl.int64)
        x_row = x_ptr + (row // n_inner) * x_stride_outer + (row % n_inner) * x_stride_inner
        dx_row = dx_ptr + (row // n_inner) * dx_stride_outer + (row % n_inner) * dx_stride_inner
        tok = tl.load(tok_ptr + row)
        active = tl.load(mask_ptr + row) != 0
        a = tl.where(active, tl.load(glogp_ptr + row), 0.0) * inv_temp  # where, not *: masked rows' values may be NaN
        b = tl.where(active, tl.load(gent_ptr + row), 0.0) * inv_temp
        n_read = tl.where(active, n_cols, 0)
        # A masked dense row still loops, to write zeros (without reading); with kept ids the gradient buffer is
        # pre-zeroed, so a masked row does nothing.
        n_todo = n_read if HAS_KEPT else n_cols
        m = tl.load(max_ptr + row)
        lse = tl.load(lse_ptr + row)
        zbar = tl.load(zbar_ptr + row)
        for start in range(0, n_todo, BLOCK):
            offs = start + tl.arange(0, BLOCK)
            if HAS_KEPT:  # (a masked row never gets here)
                cols = tl.load(kept_ptr + row * kept_stride + offs, mask=offs < n_cols, other=-1)
                valid = cols >= 0
                readable = valid
            else:
                cols = offs
                valid = offs < n_cols
                readable = offs < n_read  # nothing for a masked row
            z = (tl.load(x_row + cols, mask=readable, other=float("-inf")).to(tl.float32) - m) * inv_temp
            p = tl.exp(z - lse)
            dz = tl.where(p > 0, -p * (a + b * (z - zbar)), 0.0) + tl.where(cols == tok, a, 0.0)
            tl.store(dx_row + cols, dz.to(dx_ptr.dtype.element_ty), mask=valid)


def _rows(logits):
    """logits (..., V) as (outer, inner, V) with unit stride along V: a view for contiguous logits and for a slice
    along one middle dim (logits[:, P-1:-1], the usual PPO case); else a copy (one read and write of the logits)."""
    x = logits.reshape(-1, *logits.shape[-2:]) if logits.dim() > 2 else logits.reshape(1, -1, logits.shape[-1])
    return x if x.stride(-1) == 1 else x.contiguous()


def _launch(kernel, x, tokens, mask, kept, temperature, *args):
    """kernel with one program per row of x (outer, inner, V); args: its arguments between x's layout and tok_ptr."""
    n_cols = x.shape[-1] if kept is None else kept.shape[1]
    block = max(16, min(BLOCK_V, triton.next_power_of_2(n_cols)))
    if mask is None:
        mask = torch.ones(tokens.shape, dtype=torch.bool, device=tokens.device)
    # (a pointer argument cannot be None: without kept ids, kept_ptr gets the tokens, which the kernel never reads)
    with _LAUNCH_LOCK:  # Triton compiles a variant (per dtype, constant and shape class) at its first launch
        kernel[(tokens.numel(),)](  # 1-D grid: dim 0 may be up to 2^31 - 1, unlike dims 1 and 2 (65535)
            x, x.shape[1], x.stride(0), x.stride(1), *args,
            tokens, mask.view(torch.uint8), tokens if kept is None else kept, 0 if kept is None else kept.stride(0),
            n_cols, 1.0 / temperature, HAS_KEPT=kept is not None, BLOCK=block,
            num_warps=max(1, min(16, block // 512)),  # 4096 -> 8 warps, 8192 -> 16, 256 -> 1
        )


def _triton_forward(logits, tokens, mask, kept, temperature):
    outputs = [torch.empty(tokens.numel(), dtype=torch.float32, device=logits.device) for _ in range(5)]
    _launch(_logprob_fwd_kernel, _rows(logits), tokens, mask, kept, temperature, *outputs)
    return outputs  # logp, entropy, row max, lse, zbar


def _triton_backward(logits, tokens, mask, kept, temperature, row_max, lse, zbar, g_logp, g_ent, inplace):
    x = _rows(logits)
    if kept is not None:  # only the K kept ids get a gradient, into zeros (not into x: the kernel still reads it)
        dx = torch.zeros(x.shape, dtype=x.dtype, device=x.device)
    elif inplace:
        dx = x
    else:
        dx = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    _launch(_logprob_bwd_kernel, x, tokens, mask, kept, temperature,
            dx, dx.stride(0), dx.stride(1), row_max, lse, zbar, g_logp, g_ent)
    return dx.view(logits.shape)


# ---------------------------------------------------------------------------------------------------- public API
# backend -> (forward, backward). A forward returns logp and entropy, (N,) in the compute dtype with masked rows 0,
# then the per-row statistics that the same backend's backward needs: Triton: m = max x (logit units),
# lse = log sum exp((x - m) / T), zbar = sum p (x - m) / T; torch: the row max (None when T = 1) and the entropy.
_BACKENDS = {"triton": (_triton_forward, _triton_backward), "torch": (_torch_forward, _torch_backward)}


class _TokenLogprobsFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, tokens, mask, kept, temperature, backend, inplace):
        logp, ent, *stats = _BACKENDS[backend][0](logits, tokens, mask, kept, temperature)
        ctx.save_for_backward(logits, tokens, mask, kept, *stats)
        ctx.args = (temperature, backend, inplace, logp.dtype)
        return logp, ent

    @staticmethod
    def backward(ctx, g_logp, g_ent):
        logits, tokens, mask, kept, *stats = ctx.saved_tensors
        temperature, backend, inplace, cdtype = ctx.args
        # Upstream gradients may be broadcast views (loss = x.sum()); the kernels want contiguous (N,) vectors.
        g_logp = g_logp.reshape(-1).to(cdtype).contiguous()
        g_ent = g_ent.reshape(-1).to(cdtype).contiguous()
        grad = _BACKENDS[backend][1](logits, tokens, mask, kept, temperature, *stats, g_logp, g_ent, inplace)
        return grad, *([None] * 6)


def token_logprobs(logits, tokens, temperature=1.0, *, mask=None, kept_ids=None, backend="auto",
                   inplace_backward=False):
    """Log-prob of each sampled token and the entropy of its distribution, fused.

    logits (..., V) float16/bfloat16/float32/float64; tokens (...) int64 ids in [0, V).
    Returns (logprobs, entropy) each (...) float32 (float64 when logits are float64).
    temperature: logits are divided by it before the softmax (the same as sampling).
    mask (...) bool: rows with False are not computed at all (their logits may be NaN/inf garbage); their outputs
      are exactly 0 and their gradient exactly 0.
    kept_ids (..., K) int64, -1 = unused slot: the token set the sampler kept (top-k, or top-p ids up to a cap); then
      logprobs and entropy are of the distribution renormalised over that set (softmax over z[kept] / T only), so a
      PPO ratio compares the same distributions the sampler drew from. Ids in a row must be distinct, and each real
      row needs at least one (a row without any finite logit gives NaN). If the sampled token is not in its row's
      set, its logprob is -inf.
    Both outputs are differentiable w.r.t. logits; tokens, mask and kept_ids are constants.
    backend: "auto" (Triton for CUDA logits if it compiles there, triton_works; else torch), "triton", "torch".
    inplace_backward: the backward writes d(logits) into the logits' storage (the caller promises not to reuse
      logits); saves one logits-sized buffer. Ignored with kept_ids.
    """
    backend = _pick_backend(backend, logits)
    shape = tokens.shape
    tokens, mask, kept_ids = _flat_inputs(logits.shape[:-1], tokens, mask, kept_ids)
    if tokens.numel() == 0:
        logp = logits.new_zeros(shape, dtype=torch.promote_types(logits.dtype, torch.float32))
        return logp, logp.clone()
    logp, ent = _TokenLogprobsFn.apply(logits, tokens, mask, kept_ids, float(temperature), backend, inplace_backward)
    return logp.view(shape), ent.view(shape)


class _LinearTokenLogprobsFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, tokens, kept, temperature, backend, chunk):  # hidden (n, H): real rows only
        forward = _BACKENDS[backend if hidden.shape[0] else "torch"][0]  # (no rows: one empty chunk, torch path)
        chunks = []
        for r0 in range(0, max(1, hidden.shape[0]), chunk):
            r = slice(r0, r0 + chunk)
            logits = hidden[r] @ weight.T                                               # (c, V) in hidden's dtype
            chunks.append(forward(logits, tokens[r], None, None if kept is None else kept[r], temperature))
        # logp, entropy, then the backward's statistics (None: the torch path's row max at T = 1)
        logp, ent, *stats = [None if c[0] is None else torch.cat(c) for c in zip(*chunks)]
        ctx.save_for_backward(hidden, weight, tokens, kept, *stats)
        ctx.args = (temperature, backend, chunk, logp.dtype)
        return logp, ent

    @staticmethod
    def backward(ctx, g_logp, g_ent):
        hidden, weight, tokens, kept, *stats = ctx.saved_tensors
        temperature, backend, chunk, cdtype = ctx.args
        g_logp = g_logp.to(cdtype).contiguous()
        g_ent = g_ent.to(cdtype).contiguous()
        need_h, need_w = ctx.needs_input_grad[:2]
        d_hidden = torch.empty_like(hidden) if need_h else None
        d_weight = torch.zeros_like(weight, dtype=torch.float32) if need_w else None  # summed over chunks in fp32
        for r0 in range(0, hidden.shape[0], chunk):
            r = slice(r0, r0 + chunk)
            logits = hidden[r] @ weight.T                                               # (c, V) recomputed
            chunk_stats = [None if t is None else t[r] for t in stats]
            d_logits = _BACKENDS[backend][1](logits, tokens[r], None, None if kept is None else kept[r], temperature,
                                             *chunk_stats, g_logp[r], g_ent[r], True)  # (c, V), in logits
            if need_h:
                d_hidden[r] = d_logits @ weight                                         # (c, H)
            if need_w:
                d_weight.addmm_(d_logits.T.float(), hidden[r].float())                  # (V, H)
        return d_hidden, None if d_weight is None else d_weight.to(weight.dtype), *([None] * 5)


def linear_token_logprobs(hidden, weight, tokens, temperature=1.0, *, mask=None, kept_ids=None, backend="auto",
                          chunk_tokens=1024):
    """Same outputs as token_logprobs(hidden @ weight.T, tokens, ...) but never holds the full (tokens, vocab) logits.

    hidden (..., H), weight (V, H) (an lm_head weight, no bias). Masked-out rows are dropped before any matmul. The
    real rows are cut into chunks of at most chunk_tokens rows, further capped so one chunk's float32 logits stay
    under 256 MB (at V = 152k: 441 rows). Extra memory: about one chunk of logits (in hidden's dtype), which the
    backward recomputes and overwrites with d(logits). Differentiable w.r.t. hidden and weight; see token_logprobs
    for the other arguments and the outputs.
    """
    backend = _pick_backend(backend, weight)
    shape = tokens.shape
    tokens, mask, kept_ids = _flat_inputs(hidden.shape[:-1], tokens, mask, kept_ids)
    hidden2d = hidden.reshape(-1, hidden.shape[-1])                                     # (N, H)
    rows = None if mask is None else mask.nonzero().squeeze(1)
    if rows is not None:  # index_select's backward scatters into zeros: masked rows get exactly 0 gradient
        hidden2d = hidden2d.index_select(0, rows)
        tokens = tokens[rows]
        kept_ids = None if kept_ids is None else kept_ids[rows]
    chunk = max(1, min(chunk_tokens, _LINEAR_CHUNK_BYTES // (4 * weight.shape[0])))
    logp, ent = _LinearTokenLogprobsFn.apply(hidden2d, weight, tokens, kept_ids, float(temperature), backend, chunk)
    if rows is not None:  # scatter the real rows back; masked rows are exactly 0
        logp = logp.new_zeros(mask.shape[0]).index_copy(0, rows, logp)
        ent = ent.new_zeros(mask.shape[0]).index_copy(0, rows, ent)
    return logp.view(shape), ent.view(shape)


# ------------------------------------------------------------------------------------------------------ fast paths
# The same results as ppo_tokens.py's plain paths, faster; each is checked against its plain path before it is used
# (fast_decoder, use_packed_attention, fused_head_agrees). Packed forwards run every layer on the real tokens only;
# ppo_attention keeps the sequences apart (transformers' own packed SDPA computes every block of an (N, N) mask).


def fall_back(message: str):
    """A fast path is off (fast sampler, CUDA graph, compile, flash-attn, the fused head): say why in one line. With
    PPO_TOKENS_STRICT=1 (the tests set it) it is an error instead, so nothing passes on a slow path by accident."""
    if os.environ.get("PPO_TOKENS_STRICT") == "1":
        raise RuntimeError(f"PPO_TOKENS_STRICT=1: {message}")
    print(message, flush=True)


@contextlib.contextmanager
def ieee_fp32():  # start-up checks compare two paths in IEEE float32: TF32 would round each path its own way
    tf32 = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32 = tf32


@torch.no_grad()
def fused_head_agrees(model, vocab=None) -> bool:
    """Whether linear_token_logprobs from the last hidden states equals token_logprobs of the model's own logits on
    a tiny batch (IEEE fp32 matmuls): a model that post-processes its logits (Gemma 2's softcapping, Cohere's
    logit_scale, Granite's logits_scaling, Falcon-H1's lm_head_multiplier, ...) needs the full logits. The known
    config keys first: small logits (a freshly initialised model) can hide a softcap. A head that is not a bias-free
    Linear agrees trivially: the fused path does not serve it (ppo_tokens.sequence_logprobs)."""
    config, head = model.config, getattr(model, "lm_head", None)
    if any(getattr(config, k, None) not in (None, 1.0) for k in ("final_logit_softcapping", "logit_scale",
                                                                 "logits_scaling")):
        return False
    if not isinstance(head, torch.nn.Linear) or head.bias is not None:
        return True
    ids = torch.randint(0, vocab or config.vocab_size, (2, 6), device=model.device)
    inputs = dict(input_ids=ids, attention_mask=torch.ones_like(ids), use_cache=False,
                  position_ids=torch.arange(6, device=ids.device).expand(2, 6))
    with ieee_fp32():  # the hidden state at column 2 + t predicts ids[:, 3 + t]
        hidden = getattr(model, model.base_model_prefix)(**inputs).last_hidden_state[:, 2:-1]
        fused = linear_token_logprobs(hidden.to(head.weight.dtype), head.weight[:vocab], ids[:, 3:], 1.0)[0]
        full = token_logprobs(model(**inputs).logits[:, 2:-1, :vocab], ids[:, 3:], 1.0)[0]
    low = head.weight.dtype in (torch.bfloat16, torch.float16)  # (--lora-rank's bf16 base: logits to ~3 digits)
    return bool(torch.allclose(fused, full, rtol=0 if low else 1e-4, atol=5e-2 if low else 1e-4))


@functools.cache
def flash_attn_varlen():
    """flash-attn's varlen kernel, or None: imported and called once, at set-up, on the current CUDA device (a wheel
    built for another torch fails to import, one without this GPU's kernels fails its first call)."""
    if importlib.util.find_spec("flash_attn") is None:
        return None
    try:
        from flash_attn import flash_attn_varlen_func
        q = torch.zeros(2, 1, 64, dtype=torch.bfloat16, device="cuda")  # (2 tokens, 1 head, d 64)
        cu_seqlens = torch.tensor([0, 2], dtype=torch.int32, device="cuda")
        flash_attn_varlen_func(q, q, q, cu_seqlens, cu_seqlens, 2, 2, causal=True)
        return flash_attn_varlen_func
    except Exception as e:
        fall_back(f"flash-attn is installed but does not import or run ({str(e).splitlines()[0][:200]}); packed "
                  "attention runs through SDPA")


def ppo_attention(module, query, key, value, attention_mask, packed_layout=None, grouped_decode=False, **kwargs):
    """The transformers attention function (registered as "ppo_tokens") of packed forwards and of the fast sampler's
    decode step; plain SDPA for every other call. query (B, heads, q_len, d), key and value (B, kv_heads, k_len, d).
    Returns ((B, q_len, heads, d), None)."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    scaling, groups = kwargs.get("scaling"), query.shape[1] // key.shape[1]
    if grouped_decode and query.shape[2] == 1 and groups > 1:
        # one new token per row (StaticDecoder): the query heads that share a K/V head act as that head's queries,
        # so SDPA reads the cache once. (transformers repeats the whole cache `groups` times when given a mask.)
        B, heads, _, d = query.shape
        out = torch.nn.functional.scaled_dot_product_attention(query.view(B, heads // groups, groups, d), key, value,
                                                               attn_mask=attention_mask, scale=scaling)
        return out.reshape(B, heads, 1, d).transpose(1, 2), None
    if packed_layout is None:  # (pack_sequences' empty mask cannot pass for a real one: SDPA would fail on it)
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)
    if kwargs.get("sliding_window") is not None:
        raise ValueError("sliding-window attention is not supported packed")
    layout, device = packed_layout, query.device.type
    # under --bf16 autocast q and k leave RoPE in fp32 while v is bf16: flash-attn gets all three in the autocast dtype
    dtype = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else query.dtype
    if query.is_cuda and dtype in (torch.bfloat16, torch.float16) and flash_attn_varlen() is not None:
        q, k, v = (x[0].transpose(0, 1).to(dtype) for x in (query, key, value))  # (N, heads, d)
        return flash_attn_varlen()(q, k, v, layout["cu_seqlens"], layout["cu_seqlens"], layout["width"],
                                   layout["width"], softmax_scale=scaling, causal=True)[None], None
    q, k, v = (_right_padded(x, layout) for x in (query, key, value))  # (rows, heads, width, d)
    if dtype == torch.float32 and groups > 1:  # SDPA has no fused fp32 kernel for GQA (only its math one)
        k, v = k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1)
    # right-padded rows need no mask: causal attention never looks at the pads after a sequence's last token
    out = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scaling,
                                                           enable_gqa=k.shape[1] != q.shape[1])
    out = out.transpose(1, 2).flatten(0, 1)                                    # (rows * width, heads, d)
    return out.index_select(0, layout["to_packed"])[None], None


def _right_padded(x, layout):
    """(1, h, N, d) packed -> (rows, h, width, d): one sequence per row, zeros after it. (index_copy here and
    index_select in ppo_attention: their backwards are a gather and an index_add, both cheap.)"""
    x = x[0].transpose(0, 1)                                                   # (N, h, d)
    rows_view = x.new_zeros(layout["rows"] * layout["width"], *x.shape[1:]).index_copy(0, layout["to_packed"], x)
    return rows_view.view(layout["rows"], layout["width"], *x.shape[1:]).transpose(1, 2)


def decoder_kwargs(model):  # (the name of the forward's cache argument, {"logits_to_keep": 1} if it takes one)
    params = inspect.signature(model.forward).parameters  # transformers 5.24 renamed past_key_values to cache
    keep = {"logits_to_keep": 1} if "logits_to_keep" in params else {}  # not (B, P, V) prefill logits
    return ("cache" if "cache" in params else "past_key_values"), keep


def use_ppo_attention(model) -> bool:  # model (or a backbone) attends through ppo_attention, if it used SDPA
    from transformers import AttentionInterface, AttentionMaskInterface
    from transformers.masking_utils import sdpa_mask
    if model.config._attn_implementation not in ("sdpa", "ppo_tokens"):
        return False
    AttentionInterface.register("ppo_tokens", ppo_attention)
    AttentionMaskInterface.register("ppo_tokens", sdpa_mask)
    model.set_attn_implementation("ppo_tokens")
    return True


def use_packed_attention(backbone, bf16=False) -> str:
    """Let a transformers backbone run packed forwards (ppo_attention) if on a ragged batch their hidden states lie
    within 4x the padded forward's own bf16 rounding (measured here) of the padded fp32 ones, also under --bf16's
    autocast (flash-attn's path where it runs). Returns "" or why not."""
    if not use_ppo_attention(backbone):
        raise SystemExit(f"--micro-batch-tokens packs sequences through SDPA; {type(backbone).__name__} uses "
                         f"{backbone.config._attn_implementation!r} attention. Leave --micro-batch-tokens at 0")
    device = backbone.device
    prompt_mask = torch.tensor([[0, 1, 1], [1, 1, 1]], device=device)
    response_mask = torch.tensor([[1, 1], [1, 0]], device=device)
    attention_mask = torch.cat([prompt_mask, response_mask], 1)  # (2, 5): a left pad and a right pad
    input_ids = torch.randint(1, backbone.config.vocab_size, (2, 5), device=device).masked_fill(attention_mask == 0, 0)
    position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)
    padded = dict(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids)
    packed = dict(zip(("input_ids", "attention_mask", "position_ids", "packed_layout"),
                      pack_sequences(input_ids, attention_mask, prompt_mask.sum(1), response_mask)))
    try:  # the real tokens' (n, H) hidden states in fp32: padded, padded in bf16, packed (and packed in bf16)
        hidden = []
        for inputs, mixed in [(padded, False), (padded, True), (packed, False)] + [(packed, True)] * bf16:
            with torch.no_grad(), ieee_fp32(), torch.autocast(device.type, dtype=torch.bfloat16, enabled=mixed):
                out = backbone(**inputs, use_cache=False).last_hidden_state.float()
            hidden.append(out[0] if inputs is packed else out[attention_mask.bool()])
        exact = hidden[0]
        noise = (hidden[1] - exact).norm() / exact.norm()  # the padded path's own bf16 rounding: ~2^-8, more if deep
        noise = max(noise, torch.finfo(next(backbone.parameters()).dtype).eps)  # (a bf16 model: its own rounding)
        for mixed, out in zip((False, True), hidden[2:]):
            error = (out - exact).norm() / exact.norm()
            if not error <= 4 * noise:  # (NaN fails too)
                raise ValueError(f"hidden states{' under --bf16' if mixed else ''} {error:.2g} from padded ones, over "
                                 f"4x the padded bf16 rounding {noise:.2g} (relative)")
    except (ValueError, RuntimeError) as e:
        return f"{type(backbone).__name__} cannot run packed ({str(e).splitlines()[0][:200]})"
    return ""


class StaticDecoder:
    """The fast sampler's model calls: a preallocated KV cache (transformers' StaticCache) and attention mask, so a
    decode step allocates nothing and never waits for the host; on CUDA the step is captured once as a CUDA graph
    and replayed (one launch instead of ~10 kernels per layer, each with its Python dispatch). One decoder serves
    every batch of batch_size rows whose prompt + response fit in max_len. It needs full-attention layers that take
    a ready 4D boolean mask through SDPA (Llama, Qwen2/3, Mistral, ...), which fast_decoder checks against
    the plain loop (ppo_tokens.PlainDecoder), whose interface it shares: start(prompt ids, mask, position ids) and
    step(token), each returning the next token's logits (B, V)."""

    def __init__(self, model, batch_size: int, max_len: int):
        from transformers import StaticCache
        config = model.config
        window = getattr(config, "sliding_window", None)
        layer_types = getattr(config, "layer_types", None) or ()
        sliding = "sliding_attention" in layer_types or getattr(config, "use_sliding_window", True)
        if window and sliding and window < max_len:  # its mask below would let those layers see past their window
            raise ValueError(f"sliding-window layers (window {window} < {max_len} cache columns)")
        self.model, (self.cache_kwarg, self.keep) = model, decoder_kwargs(model)
        device, self.max_len = model.device, max_len
        self.cache = {self.cache_kwarg: StaticCache(config=model.config, max_cache_len=max_len), "use_cache": True}
        self.mask = torch.zeros(batch_size, max_len, dtype=torch.bool, device=device)  # (B, L) keys a row may see
        self.token = torch.zeros(batch_size, 1, dtype=torch.long, device=device)  # the step's inputs, updated in place
        self.position = torch.zeros(batch_size, 1, dtype=torch.long, device=device)
        self.column = torch.zeros(1, dtype=torch.long, device=device)  # the cache column the next token goes to
        self.graph, self.prefill, self.decode = None, model, model  # fast_decoder may swap in compiled model calls
        self.grouped = {"grouped_decode": True} if use_ppo_attention(model) else {}  # GQA without repeating K/V
        self.shared = None  # share_prefill: a decoder of batch_size / group rows for the groups' prompts
        self.warm_up()  # allocates the cache (transformers does it lazily)

    def share_prefill(self, group: int):
        """Rows in groups of `group` that share one prompt (--samples-per-prompt) prefill it once: the prompt's keys
        and values are computed for one row of each group, then copied to the others (vLLM's n samples of a prompt
        share its prefill the same way). A batch whose rows do not repeat prefills every row."""
        self.group = group
        self.shared = StaticDecoder(self.model, self.mask.shape[0] // group, self.max_len)

    def warm_up(self):  # a 2-token prompt: a compiled prefill would specialise (and recompile) on length 1
        # (contiguous, as every prompt: an expanded view would fail a compiled prefill's stride guards)
        ids = self.token.repeat(1, 2)
        return self.start(ids, torch.ones_like(ids), torch.arange(2, device=ids.device).repeat(ids.shape[0], 1))

    def capture(self):  # CUDA: record one decode step as a graph, after a warm-up on a side stream (as required)
        self.warm_up()  # 2 columns, then the 3 steps below: 5, which fast_decoder makes every cache hold
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # the outer context: a failed capture still gives the stream back
            for _ in range(2):
                self._step()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, stream=side, capture_error_mode="thread_local"):  # other threads may run
                self.logits = self._step()
        torch.cuda.current_stream().wait_stream(side)
        self.graph = graph

    def start(self, prompt_ids, prompt_mask, position_ids):
        P = prompt_ids.shape[1]
        self.mask.zero_()
        self.mask[:, :P] = prompt_mask.bool()
        self.position.copy_(position_ids[:, -1:])
        self.column.fill_(P)
        if self.shared is not None and repeats_in_groups(prompt_ids, prompt_mask, self.group):
            g, self.shared.prefill = self.group, self.prefill  # (a compiled prefill too)
            # (copies with standard strides, even for one row a group: a compiled prefill guards on strides)
            logits = self.shared.start(*(x[::g].clone(memory_format=torch.contiguous_format)
                                         for x in (prompt_ids, prompt_mask, position_ids)))
            # every tensor of the cache is overwritten in place: no reset needed, the graph's addresses stay valid
            repeat_cache_rows(self.shared.cache[self.cache_kwarg], self.cache[self.cache_kwarg], g)
            return logits.repeat_interleave(g, 0)
        self.cache[self.cache_kwarg].reset()  # zeroes in place: the graph's addresses stay valid
        query = torch.arange(P, device=self.mask.device)[:, None]
        key = torch.arange(self.max_len, device=self.mask.device)
        # (B, 1, P, L): causal over the real prompt tokens; a pad attends to itself (a fully masked row would be NaN,
        # and 0 * NaN poisons the real rows that give it zero weight)
        allowed = (self.mask[:, None, None, :] & (key <= query)) | (key == query)
        return self.prefill(input_ids=prompt_ids, attention_mask=allowed, position_ids=position_ids, **self.cache,
                            **self.keep).logits[:, -1]

    def step(self, token):
        self.token.copy_(token[:, None])
        if self.graph is None:
            return self._step()
        self.graph.replay()
        return self.logits

    def _step(self):  # reads and updates the static inputs in place, so a CUDA graph of it replays correctly
        self.mask.index_fill_(1, self.column, True)
        self.column.add_(1)
        self.position.add_(1)
        return self.decode(input_ids=self.token, attention_mask=self.mask[:, None, None, :],
                           position_ids=self.position, **self.cache, **self.keep, **self.grouped).logits[:, -1]


def repeats_in_groups(prompt_ids, prompt_mask, group: int) -> bool:  # rows g*group .. g*group + group-1 are alike
    P = prompt_ids.shape[1]
    alike = [(x.view(-1, group, P) == x[::group, None]).all() for x in (prompt_ids, prompt_mask)]
    return bool(alike[0] & alike[1])  # (one host sync per batch)


def repeat_cache_rows(source, target, group: int):
    """target (a StaticCache of group x source's rows) <- source with each row repeated `group` times: every tensor
    its layers hold (keys, values, the write position). Other layer kinds (recurrent states, ...) are refused."""
    for source_layer, target_layer in zip(source.layers, target.layers, strict=True):
        if type(target_layer).__name__ not in ("StaticLayer", "StaticSlidingWindowLayer"):
            raise ValueError(f"a {type(target_layer).__name__} cache layer")
        for name, tensor in vars(target_layer).items():
            if isinstance(tensor, torch.Tensor):
                rows = getattr(source_layer, name)
                if rows.shape == tensor.shape:  # (the write position)
                    tensor.copy_(rows)
                elif rows.dim() and tensor.shape == (group * rows.shape[0], *rows.shape[1:]):
                    tensor.unflatten(0, (-1, group)).copy_(rows.unsqueeze(1))  # in place, by broadcasting
                else:
                    raise ValueError(f"cache tensor {name} of shape {tuple(rows.shape)} for {tuple(tensor.shape)}")
        if hasattr(target_layer, "cumulative_length_int"):  # (a sliding-window layer's count, a Python int)
            target_layer.cumulative_length_int = source_layer.cumulative_length_int


def share_prefill_checked(decoder, model, batch_size: int, plain, name: str):
    """Keeps decoder.shared while it samples what the plain loop samples and leaves the cache a prefill of every row
    builds, within 2x what an unshared prefill changes from n / group rows to n (bf16 sums depend on the row count);
    else turns sharing off (fall_back). Called after share_prefill, a compile and a capture."""
    shared, group = decoder.shared, getattr(decoder, "group", 1)
    if shared is None:
        return
    try:
        agrees_with_plain_loop(decoder, model, batch_size, plain, group)
        batch, states = check_batch(model, batch_size, group), []
        for prefill_by in (shared, None):
            decoder.shared = prefill_by
            decoder.start(*batch)
            states.append(_cache_tensors(decoder))
        decoder.shared = shared
        for a, b, sub in zip(*states, _cache_tensors(shared), strict=True):  # sub: the n / group rows' own prefill
            noise = (b[::group] - sub).norm() if b.shape != sub.shape else 0.0  # (the write position: equal)
            if not (a - b).norm() <= 2 * group**0.5 * noise:  # (NaN fails too)
                raise ValueError(f"its cache differs from a prefill of every row by {float((a - b).abs().max()):.3g}")
    except Exception as e:  # a cache layout repeat_cache_rows does not know
        decoder.shared = None
        fall_back(f"shared prefill off for {name} ({str(e).splitlines()[0][:200]}); every row prefills its prompt")


def _cache_tensors(decoder):  # copies, in fp32, of every tensor the decoder's cache layers hold
    layers = decoder.cache[decoder.cache_kwarg].layers
    return [t.to(torch.float32, copy=True) for layer in layers for t in vars(layer).values() if torch.is_tensor(t)]


def check_batch(model, batch_size: int, group=1):  # (ids, mask, position ids): random 3-token prompts, one left pad
    # (its own generator: a check, at start-up or mid-run, never moves the global RNG a resumed run restored)
    own = torch.Generator().manual_seed(0)
    ids = torch.randint(0, model.config.vocab_size, (batch_size // group, 3), generator=own).to(model.device)
    # (group 1: randint's own tensor; through repeat_interleave, a compiled prefill recompiled for later prompts)
    ids = ids.repeat_interleave(group, 0) if group > 1 else ids  # rows in groups of `group` alike
    mask = torch.ones_like(ids)
    mask[:group, 0] = 0  # a left pad
    return ids, mask, (mask.cumsum(-1) - 1).clamp(min=0)


def agrees_with_plain_loop(decoder, model, batch_size: int, plain, group=1):
    """Raises if decoder's logits are not those of plain(model) (ppo_tokens.PlainDecoder) on a left-padded batch
    (group > 1: of rows that repeat in groups of that many)."""
    ids, mask, position_ids = check_batch(model, batch_size, group)
    outputs = [[d.start(ids, mask, position_ids), d.step(ids[:, 1]).clone(), d.step(ids[:, 2])]
               for d in (decoder, plain(model))]
    exact = model.dtype in (torch.float32, torch.float64)
    # fp32/64: log-probs within 1e-3; bf16 (one rounding step can be 0.25): distributions within 0.02 total variation
    for a, b in zip(*outputs):
        a, b = torch.log_softmax(a.float(), -1), torch.log_softmax(b.float(), -1)
        diff = torch.where(a == b, 0.0, a - b).abs().max() if exact else 0.5 * (a.exp() - b.exp()).abs().sum(-1).max()
        if not diff <= (1e-3 if exact else 0.02):  # (a NaN fails; a token both paths mask, -inf in each, agrees)
            raise ValueError(f"its next-token distributions differ from the plain loop's by {float(diff):.3g}")


@torch.no_grad()
def fast_decoder(model, batch_size: int, max_len: int, plain, compiled=False, threads=0, group=1):
    """A StaticDecoder for model, with a CUDA graph on GPU, when it gives the logits of plain(model), the plain loop
    (ppo_tokens.PlainDecoder), on a test batch; else that plain decoder (or no graph), with a message that says why.
    group > 1: groups of that many rows with one prompt prefill it once (StaticDecoder.share_prefill). compiled: the
    prefill (dynamic shapes) and the decode step (static) go through torch.compile, under `threads` intra-op threads
    (0 = as now), the number the sampler runs with: the compiled code is specialised to it."""
    name = type(model).__name__
    try:
        decoder = StaticDecoder(model, batch_size, max(max_len, 5))  # (the check and capture() write 5 columns)
        agrees_with_plain_loop(decoder, model, batch_size, plain)
    except Exception as e:  # a model family the fast path does not support: sample with the plain loop
        fall_back(f"fast sampler off for {name} ({str(e).splitlines()[0][:200]}); using the plain decode loop")
        return plain(model)
    if group > 1 and batch_size % group == 0:
        decoder.share_prefill(group)
        share_prefill_checked(decoder, model, batch_size, plain, name)
    if compiled:
        t0 = time.perf_counter()
        now = torch.get_num_threads()
        print(f"compiling the sampler ({name}, {batch_size} rows) with torch.compile ...", flush=True)
        try:
            torch.set_num_threads(threads or now)
            decoder.prefill = torch.compile(model, dynamic=True)
            decoder.decode = torch.compile(model, dynamic=False)
            agrees_with_plain_loop(decoder, model, batch_size, plain)  # compiles both, then checks them
            share_prefill_checked(decoder, model, batch_size, plain, name)  # (its prefill, n times smaller)
            print(f"compiled in {time.perf_counter() - t0:.0f} s")
        except Exception as e:  # e.g. no C++ compiler on a CPU machine, or an op inductor does not support
            decoder.prefill = decoder.decode = model
            fall_back(f"torch.compile off for the sampler ({str(e).splitlines()[0][:200]}); the static cache decodes "
                      "eagerly")
        finally:
            torch.set_num_threads(now)
    if model.device.type == "cuda":
        try:
            decoder.capture()
            agrees_with_plain_loop(decoder, model, batch_size, plain)
        except Exception as e:  # e.g. a host sync inside the model's forward (dynamic RoPE)
            torch.cuda.synchronize()
            decoder.graph = None
            fall_back(f"CUDA graph off for {name} ({str(e).splitlines()[0][:200]}); the static cache decodes eagerly")
        share_prefill_checked(decoder, model, batch_size, plain, name)  # (its copies into the captured cache)
    return decoder


def gather_shards(params, out):
    """out (the parameters' numel, flat) <- every FSDP2 parameter whole, as torch.cat([p.full_tensor().reshape(-1)
    ...]) but in one all-gather, not one per parameter. FSDP2 cuts each parameter along dim 0 as torch.chunk does:
    ceil(rows / world) rows per rank, fewer or none on the last ranks."""
    world = torch.distributed.get_world_size()
    widths = [-(-p.shape[0] // world) * (p.numel() // p.shape[0]) for p in params]  # a rank's share, padded
    shards = out.new_zeros(sum(widths))
    for p, piece in zip(params, shards.split(widths)):
        piece[:p.to_local().numel()].copy_(p.to_local().reshape(-1))
    gathered = out.new_empty(world, shards.numel())
    # all_gather_single: torch 2.13's name for all_gather_into_tensor (which warns there); gloo wants a flat output
    gather = getattr(torch.distributed, "all_gather_single", None) or torch.distributed.all_gather_into_tensor
    gather(gathered.view(-1), shards)
    for p, full, view in zip(params, gathered.split(widths, 1), out.split([p.numel() for p in params])):
        view.copy_(full.reshape(-1)[:p.numel()])  # the ranks' pieces in order, their padding at the end


def pack_sequences(input_ids, attention_mask, prompt_lengths, response_mask):
    """The real tokens of a left-padded batch (input_ids, attention_mask (B, L): prompt + response, each row's real
    tokens contiguous; prompt_lengths (B,); response_mask (B, T)) as one row, sequence after sequence, with position
    ids restarting at 0 for each. Returns (input_ids (1, N), an empty 4D mask that tells transformers not to build one,
    position_ids (1, N), layout): layout["predict"] (n,) the packed column whose hidden state predicts each real
    response token (row-major), cu_seqlens for flash-attn, and where each token goes in the right-padded view."""
    real, device = attention_mask.bool(), input_ids.device
    lengths = real.sum(1)  # (B,)
    starts = lengths.cumsum(0) - lengths  # (B,) where each sequence starts in the packed row
    position_ids = torch.arange(int(lengths.sum()), device=device) - starts.repeat_interleave(lengths)  # (N,)
    t = torch.arange(response_mask.shape[1], device=device)
    predict = (starts + prompt_lengths - 1)[:, None] + t  # (B, T): column P-1+t of each sequence
    width = int(lengths.max())  # (this, the total length and the boolean indexing each sync with the host)
    column = torch.arange(width, device=device)
    inside = column < lengths[:, None]  # (B, width)
    layout = {"predict": predict[response_mask.bool()], "rows": len(lengths), "width": width,
              "cu_seqlens": torch.nn.functional.pad(lengths.cumsum(0), (1, 0)).int(),
              "to_packed": (torch.arange(len(lengths), device=device)[:, None] * width + column)[inside]}  # (N,)
    return input_ids[real][None], real.new_ones(1, 1, 0, 0), position_ids[None], layout


def token_budget_bins(lengths, budget: int, bins=0):
    """Row indices (into lengths) grouped into micro-batches of at most `budget` tokens, longest rows first, so each
    micro-batch holds sequences of similar length (little padding in the attention's view). A row longer than the
    budget would get one of its own (setup refuses such a budget). bins: make at least this many (by halving the
    largest), so that every rank runs the same number of forwards (FSDP2 gathers the weights in each)."""
    groups, total = [], budget + 1
    for i in sorted(range(len(lengths)), key=lambda i: -lengths[i]):
        if total + lengths[i] > budget:
            groups.append([])
            total = 0
        groups[-1].append(i)
        total += lengths[i]
    while len(groups) < bins:
        largest = max((g for g in groups if len(g) > 1), key=lambda g: sum(lengths[i] for i in g))
        groups.remove(largest)
        groups += [largest[:len(largest) // 2], largest[len(largest) // 2:]]
    return groups


def timed(fns: dict, device, reps=5):
    """{name: median seconds of fns[name]()}: one warm-up each, then reps rounds that run each once, interleaved, so a
    slow spell of the machine hits all alike (the benchmarks of ppo_tokens.py and of this file)."""
    times = {name: [] for name in fns}
    for rep in range(reps + 1):
        for name, fn in fns.items():
            torch.get_device_module(device).synchronize(device)  # (a no-op on CPU)
            t0 = time.perf_counter()
            fn()
            torch.get_device_module(device).synchronize(device)
            if rep:  # (rep 0: the warm-up)
                times[name].append(time.perf_counter() - t0)
    return {name: sorted(t)[reps // 2] for name, t in times.items()}


@torch.no_grad()
def bench_sampler(model, ids, mask, sample, plain, max_len: int, group: int, compiled: bool, **hf_args):
    """ppo_tokens.py --bench-rollout: sample(decoder, ids, mask) (ppo_tokens.generate) with the plain loop and each
    fast decoder, against HF generate (hf_args: temperature, max_new_tokens, ...); prints tokens/s."""
    B, T, device = ids.shape[0], hf_args["max_new_tokens"], ids.device
    eager = fast_decoder(model, B, max_len, plain)
    decoders = {"plain loop": model, type(eager).__name__: eager}
    if group > 1 and isinstance(eager, StaticDecoder):  # and with each group's prompt prefilled once
        shared = fast_decoder(model, B, max_len, plain, group=group)
        if shared.shared is not None:  # (unless it fell back)
            decoders["shared prefill"] = shared
    if compiled and isinstance(eager, StaticDecoder):
        fast = fast_decoder(model, B, max_len, plain, compiled=True, group=group)
        if fast.decode is not model:  # (unless it fell back)
            decoders["compiled"] = fast
    name = list(decoders)[-1]  # what ppo_tokens.py samples with
    runs = {"HF generate": functools.partial(model.generate, input_ids=ids, attention_mask=mask, do_sample=True,
                                             top_k=0, top_p=1.0, min_new_tokens=T, **hf_args),
            **{row: functools.partial(sample, d, ids, mask) for row, d in decoders.items()}}
    seconds = timed(runs, device)
    print(f"\nsampling {B} x {T} tokens after {ids.shape[1]}-token prompts, "
          f"{sum(p.numel() for p in model.parameters()) / 1e6:.1f}M parameters in {model.dtype} on {device}:")
    for row, s in seconds.items():
        print(f"  {row:<14} {s * 1e3:9.1f} ms  {B * T / s:9.0f} tokens/s  {seconds['HF generate'] / s:5.2f}x")
    print(f"sampler vs generate: {seconds['HF generate'] / seconds[name]:.2f}x")


# ---------------------------------------------------------------------------------------------------- benchmark
# python kernels.py --bench: time and peak memory only; test_ppo_tokens.py checks the results. Goals on an H200: the
# Triton forward at >= 90% and forward + backward at >= 80% of the copy's GB/s; linear_token_logprobs' peak beyond the
# gradients (d(W), d(hidden)) >= 16x below eager's at 152k vocab.

def _eager_logprobs(logits, tokens):
    """What RL libraries usually write; the baseline of the benchmark."""
    logp_all = torch.log_softmax(logits.float(), dim=-1)                                # (N, V) float32
    entropy = -(logp_all.exp() * logp_all).sum(-1)
    return logp_all.gather(-1, tokens[..., None]).squeeze(-1), entropy


def _eager_linear_logprobs(hidden, weight, tokens):
    return _eager_logprobs(hidden @ weight.T, tokens)


def _call(fn, tensors, backward):  # fn on new leaves: without grad, or with the backward of the sum of its outputs
    inputs = [t.detach().requires_grad_(t.is_floating_point()) for t in tensors]
    if not backward:
        with torch.no_grad():
            return fn(*inputs)
    sum(o.float().sum() for o in fn(*inputs)).backward()


def _peak_mb(fn, device):
    """Peak MB allocated by torch during fn(), above what was live before it: CUDA's max_memory_allocated; on CPU the
    running 'Total Allocated' that torch.profiler(profile_memory=True) records with each allocation (in its trace)."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        fn()
        return (torch.cuda.max_memory_allocated() - base) / 2**20
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    with tempfile.TemporaryDirectory() as tmp:
        prof.export_chrome_trace(os.path.join(tmp, "trace.json"))
        with open(os.path.join(tmp, "trace.json")) as f:
            events = [e["args"] for e in json.load(f)["traceEvents"] if e.get("name") == "[memory]"]
    if not events:
        return 0.0
    base = events[0]["Total Allocated"] - events[0]["Bytes"]
    return (max(e["Total Allocated"] for e in events) - base) / 2**20


def _measure(fn, tensors, device, reps, backward):
    """(ms, peak MB) of one _call, or ("OOM", "OOM"); any other error stops the benchmark."""
    call = functools.partial(_call, fn, tensors, backward)
    try:
        return 1e3 * timed({"call": call}, device, reps)["call"], _peak_mb(call, device)
    except torch.OutOfMemoryError:
        return "OOM", "OOM"


def _cell(value, spec):  # a number in spec, or "OOM" / "-" as it is
    return format(value, spec) if isinstance(value, float) else str(value)


def _bench():
    gpu = torch.cuda.is_available()
    device = torch.device("cuda" if gpu else "cpu")
    reps = 5 if gpu else 3
    methods = {"eager": _eager_logprobs, "torch.compile(eager)": torch.compile(_eager_logprobs),
               "ours, torch path": functools.partial(token_logprobs, backend="torch")}
    if gpu:
        shapes = [(n, v, "bf16") for v in (32000, 151936) for n in (8192, 32768, 65536)] + [(8192, 32000, "fp32")]
        linear_shapes, linear_dtype = [(8192, 32000, 4096), (8192, 151936, 4096)], torch.bfloat16
        methods["ours, triton"] = functools.partial(token_logprobs, backend="triton")
    else:  # small enough for a laptop; the last one is the CPU demo's shape (many tiny calls)
        shapes = [(512, 32000, "fp32"), (2048, 8192, "bf16"), (2048, 16, "fp32")]
        linear_shapes, linear_dtype = [(512, 32000, 256)], torch.float32
    print(f"device: {torch.cuda.get_device_name() if gpu else 'cpu'}, torch {torch.__version__}, "
          f"triton {getattr(triton, '__version__', 'not installed')}; ms: median of {reps} runs after a warm-up")
    print("peak MB: torch's allocations above the inputs. GB/s: the logits' bytes read (fwd), or read twice and the "
          "gradient written (fwd+bwd), over the time")
    head = (f"{'tokens x vocab dtype':>22} | {'method':<24} | {'fwd ms':>10} {'MB':>8} {'GB/s':>6} | "
            f"{'fwd+bwd ms':>10} {'MB':>8} {'GB/s':>6}")
    print(head)
    print("-" * len(head))
    dtypes = {"bf16": torch.bfloat16, "fp32": torch.float32}
    for n, v, dtype in shapes:
        logits = torch.randn(n, v, device=device, dtype=dtypes[dtype]).mul_(2)  # no fp32 temporary (40 GB at the top)
        tokens = torch.randint(0, v, (n,), device=device)
        nbytes = logits.numel() * logits.element_size()
        copy_ms = 1e3 * timed({"copy": logits.clone}, device, reps)["copy"]  # the bandwidth baseline
        print(f"{f'{n} x {v} {dtype}':>22} | {'copy (read + write)':<24} | {copy_ms:>10.3f} {'':>8} "
              f"{2 * nbytes / copy_ms / 1e6:>6.0f} |")
        for name, fn in methods.items():
            cells = []
            for backward, traffic in ((False, nbytes), (True, 3 * nbytes)):
                ms, mb = _measure(fn, [logits, tokens], device, reps, backward)
                gbs = traffic / ms / 1e6 if isinstance(ms, float) else "-"
                cells += [_cell(ms, ".3f"), _cell(mb, ".1f"), _cell(gbs, ".0f")]
            print(f"{'':>22} | {name:<24} | {cells[0]:>10} {cells[1]:>8} {cells[2]:>6} | {cells[3]:>10} "
                  f"{cells[4]:>8} {cells[5]:>6}")
        del logits
    print(f"\nfused linear (hidden @ W.T inside), forward + backward w.r.t. hidden and W, {str(linear_dtype)[6:]}:")
    for n, v, h in linear_shapes:
        hidden = torch.randn(n, h, device=device, dtype=linear_dtype)
        weight = torch.randn(v, h, device=device, dtype=linear_dtype) / h**0.5
        tokens = torch.randint(0, v, (n,), device=device)
        eager_ms, eager_mb = _measure(_eager_linear_logprobs, [hidden, weight, tokens], device, reps, True)
        fused_ms, fused_mb = _measure(linear_token_logprobs, [hidden, weight, tokens], device, reps, True)
        print(f"  {n} x {v}, H={h}: eager {_cell(eager_ms, '.1f')} ms, peak {_cell(eager_mb, '.0f')} MB; "
              f"linear_token_logprobs {_cell(fused_ms, '.1f')} ms, peak {_cell(fused_mb, '.0f')} MB")
        if isinstance(eager_mb, float) and isinstance(fused_mb, float):
            grads_mb = (v * h + n * h) * hidden.element_size() / 2**20  # d(W) and d(hidden): needed by any method
            print(f"    peak beyond the {grads_mb:.0f} MB of gradients: eager {eager_mb - grads_mb:.0f} MB, "
                  f"fused {fused_mb - grads_mb:.0f} MB")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description="Benchmark of the fused log-prob kernels (the tests check them).")
    parser.add_argument("--bench", action="store_true", help="print the benchmark tables (the shapes are in _bench)")
    if parser.parse_args().bench:
        _bench()
    else:
        parser.print_help()
