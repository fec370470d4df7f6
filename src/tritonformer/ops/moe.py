"""Mixture-of-experts routing: the top-k experts of each token and their weights, forward and
backward, in one pass over the router's logits.

    p = softmax(z) (or sigmoid(z), or z itself for "topk_softmax") over the E experts, in float32
    experts = the top_k indices of p (+ selection_bias, where given), largest first
    weights = p[experts], divided by their sum when normalize, cast to z's dtype
              ("topk_softmax": the softmax of z[experts] over the k; normalize changes nothing)

as HF's Qwen3-MoE and OLMoE routers (softmax, top-k, optional renormalisation, cast back; Mixtral
always renormalises and keeps float32 weights: weights_dtype=torch.float32), GPT-OSS's
("topk_softmax": the top k of the raw logits, then a softmax over those k) and, with sigmoid and
a selection bias, DeepSeek-V3's scoring without its expert groups, its 1e-20 in the
renormalisation or its routed_scaling_factor. The backward
takes the weights' gradient to z's (the indices have none):

    dq = dw (or (dw - sum(dw * w)) / sum(q) when normalize), scattered to the chosen experts: dp
    dz = p * (dp - sum(p * dp)) (softmax), dp * p * (1 - p) (sigmoid)
    "topk_softmax": dz = w * (dw - sum(w * dw)) at the chosen experts, 0 elsewhere

One program takes BLOCK_T tokens with all E logits in registers (E up to 1024); the top k are
k rounds of a row max. p is recomputed in the backward from z (saved: z and the indices).
Design: docs/moe.md.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from .. import runtime

# The kernels' SCORING is the index of the scoring's name.
SCORINGS = ("softmax", "sigmoid", "topk_softmax")
_SIGMOID = tl.constexpr(SCORINGS.index("sigmoid"))
_TOPK_SOFTMAX = tl.constexpr(SCORINGS.index("topk_softmax"))
MAX_EXPERTS = 1024
MAX_TOP_K = 32


@triton.jit
def _scores(z_ptr, rows, cols, stride_zt, stride_ze, T, E, SCORING: tl.constexpr):
    """(p, column mask) of the rows' logits in float32: softmax, sigmoid (p = 0 past E) or the
    logits themselves (TOPK_SOFTMAX; -inf past E)."""
    ok = (rows[:, None] < T) & (cols[None, :] < E)
    z = tl.load(z_ptr + rows[:, None].to(tl.int64) * stride_zt + cols[None, :] * stride_ze, mask=ok,
                other=-float("inf")).to(tl.float32)
    if SCORING == _TOPK_SOFTMAX:
        p = z
    elif SCORING == _SIGMOID:
        p = tl.where(ok, 1.0 / (1.0 + tl.exp(-z)), 0.0)
    else:
        m = tl.max(z, axis=1)
        m = tl.where(m == -float("inf"), 0.0, m)
        e = tl.exp(z - m[:, None])
        total = tl.sum(e, axis=1)
        p = e / tl.where(total > 0.0, total, 1.0)[:, None]  # rows past T: 0, not 0 / 0
    return p, ok


@triton.jit
def _top_k(p, ok, bias_ptr, cols, E, HAS_BIAS: tl.constexpr, TOP_K: tl.constexpr, BLOCK_T: tl.constexpr,
           BLOCK_K: tl.constexpr):
    """(q, idx): the TOP_K largest p (by p + bias where given) of each row, largest first, and
    their columns, as (rows, BLOCK_K) tiles (0 and 0 past TOP_K). Each real column is chosen at
    most once: a NaN score ranks highest (as in torch.topk), -inf ranks just above the columns
    already chosen and the padding past E, which are never chosen while top_k <= E."""
    score = p
    if HAS_BIAS:
        score = score + tl.load(bias_ptr + cols, mask=cols < E, other=0.0).to(tl.float32)[None, :]
    score = tl.where(score != score, float("inf"), tl.maximum(score, -3.4028234663852886e38))
    score = tl.where(ok, score, -float("inf"))
    slots = tl.arange(0, BLOCK_K)
    q = tl.zeros((BLOCK_T, BLOCK_K), tl.float32)
    idx = tl.zeros((BLOCK_T, BLOCK_K), tl.int32)
    for j in tl.static_range(TOP_K):
        best = tl.argmax(score, axis=1)
        chosen = cols[None, :] == best[:, None]
        value = tl.sum(tl.where(chosen, p, 0.0), axis=1)
        q = tl.where(slots[None, :] == j, value[:, None], q)
        idx = tl.where(slots[None, :] == j, best[:, None].to(tl.int32), idx)
        score = tl.where(chosen, -float("inf"), score)
    return q, idx


@triton.jit
def _softmax_of_chosen(q, TOP_K: tl.constexpr, BLOCK_K: tl.constexpr):
    """The softmax of each row's TOP_K chosen logits (TOPK_SOFTMAX's weights); 0 past TOP_K."""
    live = (tl.arange(0, BLOCK_K) < TOP_K)[None, :]
    q = tl.where(live, q, -float("inf"))
    e = tl.where(live, tl.exp(q - tl.max(q, axis=1)[:, None]), 0.0)
    return e / tl.sum(e, axis=1)[:, None]


@triton.jit
def _route_fwd_kernel(z_ptr, bias_ptr, w_ptr, idx_ptr, T, E, stride_zt, stride_ze,
                      SCORING: tl.constexpr, HAS_BIAS: tl.constexpr, NORMALIZE: tl.constexpr,
                      TOP_K: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    cols = tl.arange(0, BLOCK_E)
    p, ok = _scores(z_ptr, rows, cols, stride_zt, stride_ze, T, E, SCORING)
    q, idx = _top_k(p, ok, bias_ptr, cols, E, HAS_BIAS, TOP_K, BLOCK_T, BLOCK_K)
    if SCORING == _TOPK_SOFTMAX:
        q = _softmax_of_chosen(q, TOP_K, BLOCK_K)
    elif NORMALIZE:
        total = tl.sum(q, axis=1)
        q = q / tl.where(total > 0.0, total, 1.0)[:, None]
    slots = tl.arange(0, BLOCK_K)
    out = rows[:, None].to(tl.int64) * TOP_K + slots[None, :]
    keep = (rows[:, None] < T) & (slots[None, :] < TOP_K)
    tl.store(w_ptr + out, q.to(w_ptr.dtype.element_ty), mask=keep)
    tl.store(idx_ptr + out, idx.to(idx_ptr.dtype.element_ty), mask=keep)


@triton.jit
def _route_bwd_kernel(z_ptr, idx_ptr, dw_ptr, dz_ptr, T, E, stride_zt, stride_ze, stride_dwt, stride_dwk,
                      SCORING: tl.constexpr, NORMALIZE: tl.constexpr, TOP_K: tl.constexpr,
                      BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    cols = tl.arange(0, BLOCK_E)
    slots = tl.arange(0, BLOCK_K)
    p, ok = _scores(z_ptr, rows, cols, stride_zt, stride_ze, T, E, SCORING)
    keep = (rows[:, None] < T) & (slots[None, :] < TOP_K)
    idx = tl.load(idx_ptr + rows[:, None].to(tl.int64) * TOP_K + slots[None, :], mask=keep, other=-1).to(tl.int32)
    dw = tl.load(dw_ptr + rows[:, None].to(tl.int64) * stride_dwt + slots[None, :] * stride_dwk, mask=keep,
                 other=0.0).to(tl.float32)
    # dp over the experts: each chosen expert's weight gradient (each expert is chosen once a row).
    dp = tl.zeros((BLOCK_T, BLOCK_E), tl.float32)
    q = tl.zeros((BLOCK_T, BLOCK_K), tl.float32)
    for j in tl.static_range(TOP_K):
        e_j = tl.sum(tl.where(slots[None, :] == j, idx, 0), axis=1)
        chosen = cols[None, :] == e_j[:, None]
        q_j = tl.sum(tl.where(chosen, p, 0.0), axis=1)
        q = tl.where(slots[None, :] == j, q_j[:, None], q)
    if SCORING == _TOPK_SOFTMAX:
        w = _softmax_of_chosen(q, TOP_K, BLOCK_K)
        dw = w * (dw - tl.sum(dw * w, axis=1)[:, None])
    elif NORMALIZE:
        total = tl.sum(q, axis=1)
        total = tl.where(total > 0.0, total, 1.0)
        w = q / total[:, None]
        dw = (dw - tl.sum(dw * w, axis=1)[:, None]) / total[:, None]
    for j in tl.static_range(TOP_K):
        e_j = tl.sum(tl.where(slots[None, :] == j, idx, 0), axis=1)
        dw_j = tl.sum(tl.where(slots[None, :] == j, dw, 0.0), axis=1)
        dp = tl.where(cols[None, :] == e_j[:, None], dw_j[:, None], dp)
    if SCORING == _TOPK_SOFTMAX:
        dz = dp
    elif SCORING == _SIGMOID:
        dz = dp * p * (1.0 - p)
    else:
        dz = p * (dp - tl.sum(p * dp, axis=1)[:, None])
    tl.store(dz_ptr + rows[:, None].to(tl.int64) * E + cols[None, :], dz.to(dz_ptr.dtype.element_ty), mask=ok)


_launch_fwd = runtime.FastLaunch(_route_fwd_kernel)
_launch_bwd = runtime.FastLaunch(_route_bwd_kernel)


def _blocks(E: int, top_k: int) -> dict:
    block_e = runtime.next_power_of_2(E)
    # About 4096 scores a program: a token's row of 128 experts, 32 tokens a program.
    return dict(BLOCK_T=max(1, min(64, 4096 // block_e)), BLOCK_E=block_e,
                BLOCK_K=runtime.next_power_of_2(top_k))


def _fake_route_fwd(z, bias, top_k, normalize, scoring, weights_dtype, index_dtype):
    T = z.shape[0]
    return z.new_empty((T, top_k), dtype=weights_dtype), z.new_empty((T, top_k), dtype=index_dtype)


@runtime.custom_op("moe_route_fwd", fake=_fake_route_fwd)
@runtime.planned
def moe_route_fwd(z: torch.Tensor, bias: torch.Tensor | None, top_k: int, normalize: bool, scoring: int,
                  weights_dtype: torch.dtype, index_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights, experts) of the (T, E) logits z (inputs checked by moe_route; scoring an index
    of SCORINGS)."""
    T, E = z.shape
    w = runtime.empty((T, top_k), weights_dtype, z.device)
    idx = runtime.empty((T, top_k), index_dtype, z.device)
    consts = dict(SCORING=scoring, HAS_BIAS=bias is not None, NORMALIZE=normalize, TOP_K=top_k, **_blocks(E, top_k))
    grid = (runtime.cdiv(T, consts["BLOCK_T"]),)
    scalars = (T, E, *z.stride())
    entry = _launch_fwd(grid, z, bias if bias is not None else z, w, idx, *scalars, **consts, num_warps=4)
    if entry is not None:
        runtime.keep_plan(functools.partial(_replay_fwd, entry, grid, scalars))
    return w, idx


def _replay_fwd(entry, grid, scalars, z, bias, top_k, normalize, scoring, weights_dtype, index_dtype):
    w = runtime.empty((z.shape[0], top_k), weights_dtype, z.device)
    idx = runtime.empty((z.shape[0], top_k), index_dtype, z.device)
    _launch_fwd.replay(entry, grid, z, bias if bias is not None else z, w, idx, *scalars)
    return w, idx


def _fake_route_bwd(z, idx, dw, normalize, scoring):
    return torch.empty(z.shape, dtype=z.dtype, device=z.device)


@runtime.custom_op("moe_route_bwd", fake=_fake_route_bwd)
@runtime.planned
def moe_route_bwd(z: torch.Tensor, idx: torch.Tensor, dw: torch.Tensor, normalize: bool,
                  scoring: int) -> torch.Tensor:
    """The logits' gradient from the weights' (dw, any strides)."""
    T, E = z.shape
    top_k = idx.shape[1]
    dz = runtime.empty((T, E), z.dtype, z.device)
    consts = dict(SCORING=scoring, NORMALIZE=normalize, TOP_K=top_k, **_blocks(E, top_k))
    grid = (runtime.cdiv(T, consts["BLOCK_T"]),)
    scalars = (T, E, *z.stride(), *dw.stride())
    entry = _launch_bwd(grid, z, idx, dw, dz, *scalars, **consts, num_warps=4)
    if entry is not None:
        runtime.keep_plan(functools.partial(_replay_bwd, entry, grid, scalars))
    return dz


def _replay_bwd(entry, grid, scalars, z, idx, dw, normalize, scoring):
    dz = runtime.empty(z.shape, z.dtype, z.device)
    _launch_bwd.replay(entry, grid, z, idx, dw, dz, *scalars)
    return dz


class MoERouteFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, z, bias, top_k, normalize, scoring, weights_dtype, index_dtype):
        w, idx = moe_route_fwd(z, bias, top_k, normalize, scoring, weights_dtype, index_dtype)
        ctx.save_for_backward(z, idx)
        ctx.normalize, ctx.scoring = normalize, scoring
        ctx.mark_non_differentiable(idx)
        return w, idx

    @staticmethod
    def backward(ctx, dw, _didx):
        z, idx = ctx.saved_tensors
        if dw is None:
            return (None,) * 7
        return moe_route_bwd(z, idx, dw, ctx.normalize, ctx.scoring), *(None,) * 6


def moe_route(router_logits: torch.Tensor, top_k: int, normalize: bool = False, scoring: str = "softmax",
              selection_bias: torch.Tensor | None = None, weights_dtype: torch.dtype | None = None,
              index_dtype: torch.dtype = torch.int64) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights (T, top_k), experts (T, top_k)) of router logits (..., E), flattened to T rows;
    see the module doc. The weights carry the logits' gradient, in weights_dtype (default: the
    logits' dtype, as Qwen3-MoE and OLMoE cast them; Mixtral keeps float32); the experts are
    int64 as HF's expert modules take them (or int32). selection_bias (E,) moves the choice
    only (DeepSeek-V3's load balancing), never the weights."""
    runtime.check_tensor("router_logits", router_logits, runtime.FLOAT_DTYPES, min_dim=1)
    E = router_logits.shape[-1]
    if scoring not in SCORINGS:
        raise ValueError(f"moe_route: scoring must be one of {SCORINGS}, got {scoring!r}")
    if not 1 <= E <= MAX_EXPERTS:
        raise ValueError(f"moe_route: {E} experts; it takes 1 to {MAX_EXPERTS}")
    if isinstance(top_k, bool) or not isinstance(top_k, int) or not 1 <= top_k <= min(E, MAX_TOP_K):
        raise ValueError(f"moe_route: top_k must be an int in [1, {min(E, MAX_TOP_K)}], got {top_k!r}")
    weights_dtype = router_logits.dtype if weights_dtype is None else weights_dtype
    if weights_dtype not in runtime.FLOAT_DTYPES:
        raise TypeError(f"moe_route: weights_dtype must be one of {runtime.FLOAT_DTYPES}, got {weights_dtype}")
    if index_dtype not in (torch.int32, torch.int64):
        raise TypeError(f"moe_route: index_dtype must be torch.int32 or torch.int64, got {index_dtype}")
    if selection_bias is not None:
        runtime.check_tensor("selection_bias", selection_bias, runtime.FLOAT_DTYPES)
        runtime.check_same_device(router_logits=router_logits, selection_bias=selection_bias)
        runtime.check_no_grad("moe_route", selection_bias=selection_bias)
        if selection_bias.shape != (E,):
            raise ValueError(f"moe_route: selection_bias must have shape ({E},), got {tuple(selection_bias.shape)}")
        selection_bias = selection_bias.contiguous()
    z = router_logits.reshape(-1, E)
    grad = torch.is_grad_enabled() and z.requires_grad
    if z.shape[0] == 0:
        empty = z[:, :1].to(weights_dtype).expand(0, top_k)  # keeps the graph when z needs a gradient
        return empty if grad else empty.detach(), torch.empty((0, top_k), dtype=index_dtype, device=z.device)
    # topk_softmax's weights sum to 1: renormalising them would only round them again.
    normalize = bool(normalize) and scoring != "topk_softmax"
    args = (z, selection_bias, top_k, normalize, SCORINGS.index(scoring), weights_dtype, index_dtype)
    return runtime.apply(MoERouteFunction, *args) if grad else moe_route_fwd(*args)


def moe_route_reference(router_logits, top_k, normalize=False, scoring="softmax", selection_bias=None,
                        weights_dtype=None, index_dtype=torch.int64):
    """HF's router in torch: scores in float32, torch.topk, renormalised, cast back."""
    z = router_logits.reshape(-1, router_logits.shape[-1])
    wide = z.to(torch.promote_types(z.dtype, torch.float32))
    p = {"softmax": lambda: torch.softmax(wide, dim=-1), "sigmoid": lambda: torch.sigmoid(wide),
         "topk_softmax": lambda: wide}[scoring]()
    score = p if selection_bias is None else p + selection_bias.to(p.dtype)
    idx = torch.topk(score, top_k, dim=-1).indices
    w = p.gather(1, idx)
    if scoring == "topk_softmax":
        w = torch.softmax(w, dim=-1)
    elif normalize:
        w = w / w.sum(dim=-1, keepdim=True)
    return w.to(z.dtype if weights_dtype is None else weights_dtype), idx.to(index_dtype)
