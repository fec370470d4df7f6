"""scaled_matmul's path on Hopper for bf16 rows from WGMMA_MIN_M to WGMMA_MAX_M (decoding batches,
prefill) times block-scaled weights: a Gluon kernel (not under the interpreter), C^T = B X^T on
wgmma, B's codes decoded in registers into the register A operand (fp4 by the PTX decode of the
mma path, e4m3 by the hardware's conversions, each times its block scale), x from shared memory
with K permuted to match (_wgmma_x_columns), in tiles of up to WGMMA_MAX_TOKENS rows a program.
Launch shapes by tokens a program: WGMMA_SHAPES. See docs/scaled_matmul.md."""

from __future__ import annotations

from typing import Callable

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma, warpgroup_mma,
                                                             warpgroup_mma_wait)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from ... import quant, runtime
from ...quant import FORMATS, QuantizedTensor
from .common import launch_with_replay, split_k

# A wgmma step takes 128 of K: 16 int32 words of fp4 codes a row of B, or 32 of e4m3 codes.
WGMMA_STEP_K = 128
_E2M1_HALVES_PTX = gl.constexpr(quant._e2m1_word_times_ptx(False, halves=True))
_E2M1_HALVES_TIMES_2_126_PTX = gl.constexpr(quant._e2m1_word_times_ptx(True, halves=True))
_E4M3_HALVES_PTX = gl.constexpr(quant.E4M3_WORD_TIMES_HALVES_PTX)

# Rows of a bf16 A that take this kernel: from 2, fp4 weights beat _mma_kernel (N 28672 78-80 against 88-92 us).
WGMMA_MIN_M = 2
# Up to here: from 1024 rows dequantize-first wins (nvfp4 / mxfp8 M 1024: 939 / 952 us against 1005 / 976).
WGMMA_MAX_M = 1023
# Past 64 rows x comes in tiles of this many tokens a program (M 256, N 28672: 254 us against 676 in registers).
WGMMA_MAX_TOKENS = 128
# (BLOCK_N, STAGES, programs an SM that split-K aims at) by tokens a program: the best of the sweep or within
# 5 us of it (H100, K 8192); at 64 tokens two warpgroups share x's tile (N 28672 111 -> 93 us).
WGMMA_SHAPES = {16: (64, 3, 8), 32: (64, 2, 8), 64: (128, 4, 1), 128: (64, 3, 1)}
# Weights under this many elements aim split-K at fewer programs an SM (N 8192, 16 tokens: 28.6-30.6 against
# 32.5-34.8 us): WGMMA_SMALL_WEIGHT_SHAPE.
WGMMA_MIN_WEIGHT = 2**27
WGMMA_SMALL_WEIGHT_SHAPE = (64, 3, 4)
# Weights past these elements (by tokens a program) and under WGMMA_MIN_WEIGHT take that shape (32 tokens,
# 8192^2: 40-42 against 46-82 us).
WGMMA_SMALL_WEIGHT_FROM = {16: 0, 32: 2**24}
# mxfp8 weights: one shape up to 64 tokens, within 8% of the best of 12 (H100, K 8192).
WGMMA_E4M3_SHAPES = {**dict.fromkeys((16, 32, 64), (128, 3, 1)), 128: (128, 2, 1)}
# From this many tokens a program x comes by TMA from a permuted copy (M 32, N 28672: 93 -> 79 us); at 16
# tokens the copy's launch costs more than permuting in the program.
WGMMA_TMA_X_MIN_TOKENS = 32


def fits(b: QuantizedTensor, M: int, K: int) -> bool:
    """Whether _wgmma_kernel takes M bf16 rows times b: Hopper, K whole steps, b's words aligned."""
    return (not runtime.INTERPRET and WGMMA_MIN_M <= M <= WGMMA_MAX_M and K % WGMMA_STEP_K == 0
            and b.data.data_ptr() % 16 == 0 and runtime.capability(b.data.device.index or 0) == (9, 0))


@gluon.constexpr_function
def _wgmma_step_words(B_FMT):
    """int32 words of B a row a step of WGMMA_STEP_K: eight e2m1 codes a word, or four e4m3."""
    return 32 if B_FMT == "mxfp8" else 16


@gluon.constexpr_function
def _wgmma_words_per_thread(B_FMT):
    """The consecutive words of a row a thread decodes (WPT): one scale block's."""
    return FORMATS[B_FMT][0] // (4 if B_FMT == "mxfp8" else 8)


@gluon.constexpr_function
def _wgmma_words_layout(BLOCK_N, WPT, WORDS):
    """Where B's (BLOCK_N, WORDS) words of a step live: the wgmma A operand's layout (register A,
    bf16: lanes hold k 2t, 2t + 1 (t = lane % 4) and + 8 of each k16 of rows lane // 4 and + 8,
    warps 16 rows each, a warpgroup per 64 rows) read as words. A thread takes WPT consecutive
    words (one scale block) at word WPT t of each 4 WPT words of a row, so that the codes of a
    word fill whole bf16 pairs of its k16 chunks (eight e2m1 codes four pairs of two chunks, four
    e4m3 codes two pairs of one), K permuted (x is permuted to match, _wgmma_kernel)."""
    regs = [[0, 1 << i] for i in range(WPT.bit_length() - 1)] + [[8, 0]] + [[0, 4 * WPT]] * (4 * WPT < WORDS)
    return gl.DistributedLinearLayout(regs, [[0, WPT], [0, 2 * WPT], [1, 0], [2, 0], [4, 0]], _row_warps(BLOCK_N), [],
                                      [BLOCK_N, WORDS])


@gluon.constexpr_function
def _wgmma_scales_layout(BLOCK_N, BLOCKS):
    """The step's (BLOCK_N, BLOCKS) block scales where _wgmma_words_layout has their words (one
    register a block: joined WPT times, they are the words' multipliers)."""
    regs = [[8, 0]] + [[0, b] for b in (4, 8) if b < BLOCKS]
    return gl.DistributedLinearLayout(regs, [[0, 1], [0, 2], [1, 0], [2, 0], [4, 0]], _row_warps(BLOCK_N), [],
                                      [BLOCK_N, BLOCKS])


@gluon.constexpr_function
def _row_warps(BLOCK_N):
    """Warp bases of BLOCK_N rows: a warp 16 rows, a warpgroup 64, one warpgroup per 64 rows."""
    return [[16 << i, 0] for i in range(BLOCK_N.bit_length() - 5)]


@gluon.jit
def _wgmma_kernel(x, b_desc, b_scale_ptr, c_ptr, ws_ptr, counter_ptr, bias_ptr, tensor_scale_ptr,
                  M, N, K, steps_per_split, stride_xm, stride_bs, stride_bstep, stride_cm,
                  B_FMT: gl.constexpr, SPLIT_K: gl.constexpr, HAS_BIAS: gl.constexpr, TENSOR_SCALE: gl.constexpr,
                  BLOCK_N: gl.constexpr, TOKENS: gl.constexpr, STAGES: gl.constexpr, X_BY_TMA: gl.constexpr):
    """TOKENS bf16 rows of x times BLOCK_N rows of block-scaled B over one K split, Hopper only
    (Gluon: it does not run under the interpreter, where mma.py's _mma_kernel does the same product):
    C^T = B X^T on wgmma with B's decoded codes as the register A operand and x from shared memory,
    a warpgroup per 64 rows of B (they share x's tile). The grid's first axis takes x's tiles of
    TOKENS rows, so that the programs of one tile of B run together and B comes from DRAM once. B's
    words come by TMA, STAGES steps ahead; a thread reads its words (_wgmma_words_layout), decodes
    them with the block scale's multiply (fp4: the PTX of _mma_kernel's decode, element by element;
    e4m3: the hardware's conversions) and joins the elements into the operand's layout without
    moving data between threads (_wgmma_decoded_step). x's K must be permuted as the decode leaves
    B's (_wgmma_x_columns). X_BY_TMA: x is a TMA descriptor of a copy of x so permuted, and its
    tiles come with B's words. Otherwise x is a pointer to x (K contiguous): its tiles are loaded a
    step ahead into registers and permuted on their way into shared memory (a relabelling of the
    registers: the stores put each element in place). The scales are loaded a step ahead into
    registers, from the step-major copy that quant.QuantizedTensor.scales_by_step makes (a row's
    scales of a step stride_bs bytes after the last row's, a step's stride_bstep after the last
    step's): a warp's bytes of a step are consecutive, whole sectors."""
    WORDS: gl.constexpr = _wgmma_step_words(B_FMT)
    WPT: gl.constexpr = _wgmma_words_per_thread(B_FMT)
    BLOCKS: gl.constexpr = WORDS // WPT
    pid_m = gl.program_id(0)
    pid_n = gl.program_id(1)
    pid_k = gl.program_id(2)
    m0 = pid_m * TOKENS
    n0 = pid_n * BLOCK_N
    step_lo = pid_k * steps_per_split
    steps = gl.minimum(steps_per_split, K // 128 - step_lo)

    mma: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[BLOCK_N // 16, 1],
                                                  instr_shape=[16, TOKENS, 16])
    a_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma, k_width=2)
    scales_layout: gl.constexpr = _wgmma_scales_layout(BLOCK_N, BLOCKS)
    if X_BY_TMA:
        x_smem = gl.allocate_shared_memory(gl.bfloat16, [STAGES, TOKENS, 128], x.layout)
    else:
        # Two buffers: a step's stores never meet the wgmma of the step before, still reading.
        x_smem = gl.allocate_shared_memory(gl.bfloat16, [2, TOKENS, 128],
                                           gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2))
    b_smem = gl.allocate_shared_memory(gl.int32, [STAGES, BLOCK_N, WORDS], b_desc.layout)
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for s in gl.static_range(STAGES):
        mbarrier.init(ready.index(s), count=1)
    for s in gl.static_range(STAGES - 1):
        if s < steps:
            _wgmma_load_step(x, x_smem, b_desc, b_smem, ready, s, step_lo + s, m0, n0, X_BY_TMA)

    if not X_BY_TMA:
        x_layout: gl.constexpr = gl.BlockedLayout([1, 8], [2, 16], [BLOCK_N // 16, 1], [1, 0])
        tokens_x = m0 + gl.arange(0, TOKENS, layout=gl.SliceLayout(1, x_layout))
        x_ptrs = (x + tokens_x.to(gl.int64)[:, None] * stride_xm
                  + (step_lo * 128 + gl.arange(0, 128, layout=gl.SliceLayout(0, x_layout)))[None, :])
        x_mask = (tokens_x < M)[:, None]
        next_x = gl.load(x_ptrs, mask=x_mask, other=0.0)
    rows_s = n0 + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, scales_layout))
    blocks = gl.arange(0, BLOCKS, layout=gl.SliceLayout(0, scales_layout))
    scale_ptrs = (b_scale_ptr + rows_s.to(gl.int64)[:, None] * stride_bs
                  + (step_lo.to(gl.int64) * stride_bstep + blocks)[None, :])
    scale_mask = (rows_s < N)[:, None] & (blocks < BLOCKS)[None, :]
    next_scales = gl.load(scale_ptrs, mask=scale_mask, other=0)
    acc = gl.zeros([BLOCK_N, TOKENS], gl.float32, mma)
    for i in range(steps):
        raw = next_scales
        scale_ptrs += stride_bstep
        next_scales = gl.load(scale_ptrs, mask=scale_mask & (i + 1 < steps), other=0)
        stage = i % STAGES
        if X_BY_TMA:
            x_buffer = x_smem.index(stage)
        else:
            x_tile = next_x
            x_ptrs += 128
            next_x = gl.load(x_ptrs, mask=x_mask & (i + 1 < steps), other=0.0)
            if B_FMT == "mxfp8":
                # Column 16 c + 8 p + 2 t + h takes x's 32 t + 4 c + 2 p + h.
                x_tile = gl.permute(gl.reshape(x_tile, [TOKENS, 4, 8, 2, 2]), (0, 2, 3, 1, 4))
            else:
                # Column 32 WPT j + 32 u + 16 p1 + 8 p0 + 2 t + h takes x's 32 WPT j + 8 WPT t + 8 u + 4 h + 2 p1 + p0.
                x_tile = gl.permute(gl.reshape(x_tile, [TOKENS, 128 // (32 * WPT), 4, WPT, 2, 2, 2]),
                                    (0, 1, 3, 5, 6, 2, 4))
            x_buffer = x_smem.index(i % 2)
            x_buffer.store(gl.reshape(x_tile, [TOKENS, 128]))
            fence_async_shared()
            gl.thread_barrier()
        mbarrier.wait(ready.index(stage), (i // STAGES) & 1)
        a = _wgmma_decoded_step(b_smem.index(stage), raw, B_FMT, BLOCK_N, a_layout)
        acc = warpgroup_mma(a, x_buffer.permute((1, 0)), acc, is_async=True)
        # Waiting here keeps a's registers (read by the asynchronous wgmma) alive until it is done.
        acc, a = warpgroup_mma_wait(num_outstanding=0, deps=(acc, a))
        ahead = i + STAGES - 1
        if ahead < steps:
            if X_BY_TMA:
                # Every warp is past its reads of the stage the load refills (step i - 1's); x's
                # barrier of this step did that otherwise.
                gl.thread_barrier()
            _wgmma_load_step(x, x_smem, b_desc, b_smem, ready, ahead % STAGES, step_lo + ahead, m0, n0, X_BY_TMA)
    for s in gl.static_range(STAGES):
        mbarrier.invalidate(ready.index(s))

    if B_FMT == "nvfp4":
        acc = acc * 256.0  # the 2^-8 of the e4m3 multipliers
    rows = n0 + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, mma))
    tokens = m0 + gl.arange(0, TOKENS, layout=gl.SliceLayout(0, mma))
    mask = (rows < N)[:, None] & (tokens < M)[None, :]
    # The partials have split_k_total's layout (SPLIT_K, M, N).
    offsets = tokens.to(gl.int64)[None, :] * N + rows[:, None]
    finish = True
    if SPLIT_K > 1:
        gl.store(ws_ptr + pid_k.to(gl.int64) * M * N + offsets, acc, mask=mask)
        gl.thread_barrier()
        tile = pid_n * gl.num_programs(0) + pid_m
        arrived = gl.atomic_add(counter_ptr + tile, 1, sem="acq_rel", scope="gpu")
        finish = arrived == SPLIT_K - 1
        if finish:
            acc = gl.zeros([BLOCK_N, TOKENS], gl.float32, mma)
            for split in gl.static_range(SPLIT_K):
                acc += gl.load(ws_ptr + split * M * N + offsets, mask=mask, other=0.0, cache_modifier=".cg")
            gl.store(counter_ptr + tile, 0)
    if finish:
        if TENSOR_SCALE:
            acc = acc * gl.load(tensor_scale_ptr)
        if HAS_BIAS:
            acc = acc + gl.load(bias_ptr + rows, mask=rows < N, other=0.0).to(gl.float32)[:, None]
        gl.store(c_ptr + tokens.to(gl.int64)[None, :] * stride_cm + rows[:, None], acc.to(c_ptr.dtype.element_ty),
                 mask=mask)


@gluon.jit
def _wgmma_decoded_step(words_smem, raw_scales, B_FMT: gl.constexpr, BLOCK_N: gl.constexpr, a_layout: gl.constexpr):
    """A step's (BLOCK_N, 128) bf16 register operand of B: its words from shared memory
    (_wgmma_words_layout), decoded with the block scales' multiply (raw_scales: the step's
    (BLOCK_N, BLOCKS) scale bytes in _wgmma_scales_layout) and joined into a_layout."""
    WORDS: gl.constexpr = _wgmma_step_words(B_FMT)
    WPT: gl.constexpr = _wgmma_words_per_thread(B_FMT)
    words_layout: gl.constexpr = _wgmma_words_layout(BLOCK_N, WPT, WORDS)
    raw = raw_scales.to(gl.int32)
    # Multipliers as mma.py's _lane_scale_pairs makes them: e4m3 s as s 2^118, e8m0 as it is.
    if B_FMT == "nvfp4":
        bits = raw.to(gl.uint8).to(gl.float8e4nv, bitcast=True).to(gl.float32) * 2.0 ** 118
        bits = (bits.to(gl.int32, bitcast=True) >> 16) & 0xFFFF
    else:
        bits = gl.where(raw == 0, 0x40, gl.where(raw == 255, 0x7FC0, raw << 7))
    multipliers = bits | (bits << 16)
    multipliers = gl.join(multipliers, multipliers)
    if WPT >= 4:
        multipliers = gl.join(multipliers, multipliers)
    if WPT == 8:
        multipliers = gl.join(multipliers, multipliers)
    multipliers = gl.convert_layout(gl.reshape(multipliers, [BLOCK_N, WORDS]), words_layout)
    words = words_smem.load(words_layout)
    if B_FMT == "mxfp8":
        e = gl.inline_asm_elementwise(_E4M3_HALVES_PTX, "=h,=h,=h,=h,r,r", [words, multipliers],
                                      dtype=(gl.bfloat16,) * 4, is_pure=True, pack=1)
        # Element 2 p + h of word (t, c) goes to k 16 c + 8 p + 2 t + h (an outer join's index is last).
        joined = gl.join(gl.join(e[0], e[2]), gl.join(e[1], e[3]))
        joined = gl.permute(gl.reshape(joined, [BLOCK_N, 4, 8, 2, 2]), (0, 2, 3, 1, 4))
    else:
        asm: gl.constexpr = _E2M1_HALVES_PTX if B_FMT == "nvfp4" else _E2M1_HALVES_TIMES_2_126_PTX
        e = gl.inline_asm_elementwise(asm, "=h,=h,=h,=h,=h,=h,=h,=h,r,r", [words, multipliers],
                                      dtype=(gl.bfloat16,) * 8, is_pure=True, pack=1)
        # Element 4 h + 2 p1 + p0 of word (j, t, u) goes to k 32 WPT j + 32 u + 16 p1 + 8 p0 + 2 t + h.
        joined = gl.join(gl.join(gl.join(e[0], e[4]), gl.join(e[1], e[5])),
                         gl.join(gl.join(e[2], e[6]), gl.join(e[3], e[7])))
        joined = gl.permute(gl.reshape(joined, [BLOCK_N, 16 // (4 * WPT), 4, WPT, 2, 2, 2]), (0, 1, 3, 6, 5, 2, 4))
    return gl.convert_layout(gl.reshape(joined, [BLOCK_N, 128]), a_layout)


@gluon.jit
def _wgmma_load_step(x, x_smem, b_desc, b_smem, ready, stage, step, m0, n0, X_BY_TMA: gl.constexpr):
    """TMA loads of a step's words of B (BLOCK_N, WORDS) into a stage, with x's tile (TOKENS, 128
    from row m0; its rows past M arrive as zeros) when X_BY_TMA."""
    if X_BY_TMA:
        mbarrier.expect(ready.index(stage), b_desc.block_type.nbytes + x.block_type.nbytes)
        tma.async_copy_global_to_shared(x, [m0, step * 128], ready.index(stage), x_smem.index(stage))
    else:
        mbarrier.expect(ready.index(stage), b_desc.block_type.nbytes)
    words: gl.constexpr = b_desc.block_shape[1]
    tma.async_copy_global_to_shared(b_desc, [n0, step * words], ready.index(stage), b_smem.index(stage))


_launch_wgmma = runtime.FastLaunch(_wgmma_kernel)


def _wgmma_shape(fmt: str, tokens: int, N: int, K: int) -> tuple[int, int, int]:
    """(BLOCK_N, STAGES, programs an SM that split-K aims at) of _wgmma_kernel."""
    if fmt == "mxfp8":
        return WGMMA_E4M3_SHAPES[tokens]
    if WGMMA_SMALL_WEIGHT_FROM.get(tokens, WGMMA_MIN_WEIGHT) < N * K < WGMMA_MIN_WEIGHT:
        return WGMMA_SMALL_WEIGHT_SHAPE
    return WGMMA_SHAPES[tokens]


def _wgmma_x_columns(K: int, fmt: str, device: torch.device) -> torch.Tensor:
    """The columns of x that _wgmma_kernel's copy of x holds, in order: K permuted in each step
    of 128 as the kernel's decode of B leaves it. fp4, with WPT a scale block's words: column 32
    WPT j + 32 u + 16 p1 + 8 p0 + 2 t + h of a step holds x's 32 WPT j + 8 WPT t + 8 u + 4 h + 2
    p1 + p0; mxfp8: column 16 c + 8 p + 2 t + h holds x's 32 t + 4 c + 2 p + h."""
    steps = torch.arange(K, device=device).view(K // WGMMA_STEP_K, WGMMA_STEP_K)
    if fmt == "mxfp8":
        return steps.view(-1, 4, 8, 2, 2).permute(0, 2, 3, 1, 4).flatten()
    wpt = _wgmma_words_per_thread(fmt)
    return steps.view(-1, WGMMA_STEP_K // (32 * wpt), 4, wpt, 2, 2, 2).permute(0, 1, 3, 5, 6, 2, 4).flatten()


def run(x, b: QuantizedTensor, c, M, N, K, bias, tensor_scale) -> Callable | None:
    """bf16 x (M, K) times block-scaled B on Hopper: _wgmma_kernel; returns the launch's replay,
    which holds B's TMA descriptor (the product keys its plans by the weight's address) and, from
    WGMMA_TMA_X_MIN_TOKENS, a buffer for the permuted copy of x with its own descriptor: a call
    writes x there by one index_select (this path's time is near its host time; torch's permuted
    copy cost 30-40 us more of it)."""
    tokens = min(WGMMA_MAX_TOKENS, max(16, runtime.next_power_of_2(M)))
    block_n, stages, per_sm = _wgmma_shape(b.fmt, tokens, N, K)
    token_tiles = runtime.cdiv(M, tokens)
    while block_n > 64 and runtime.cdiv(N, block_n) * token_tiles < runtime.num_sms(c.device.index or 0):
        block_n //= 2
    tiles = runtime.cdiv(N, block_n)
    split, k_per_split = split_k(tiles * token_tiles, K, WGMMA_STEP_K, c.device, per_sm)
    words = b.data.view(torch.int32)
    step_words = _wgmma_step_words(b.fmt)
    b_desc = TensorDescriptor(words, list(words.shape), list(words.stride()), [block_n, step_words],
                              gl.NVMMASharedLayout.get_default_for([block_n, step_words], gl.int32))
    x_columns = x_desc = None
    if tokens >= WGMMA_TMA_X_MIN_TOKENS:
        x_columns = _wgmma_x_columns(K, b.fmt, c.device)
        x_permuted = torch.empty(M, K, dtype=torch.bfloat16, device=c.device)
        x_desc = TensorDescriptor(x_permuted, [M, K], [K, 1], [tokens, WGMMA_STEP_K],
                                  gl.NVMMASharedLayout.get_default_for([tokens, WGMMA_STEP_K], gl.bfloat16))
    constexprs = dict(B_FMT=b.fmt, SPLIT_K=split, BLOCK_N=block_n, TOKENS=tokens, STAGES=stages,
                      X_BY_TMA=x_desc is not None, num_warps=block_n // 16)
    plan = ((token_tiles, tiles, split), split, k_per_split // WGMMA_STEP_K, b_desc, x_columns, x_desc)
    return launch_with_replay(_launch_wgmma, plan, _arguments, (x, b, c, M, N, K, bias, tensor_scale), constexprs)


def _arguments(plan, x, b, c, M, N, K, bias, tensor_scale) -> tuple:
    grid, split, steps_per_split, b_desc, x_columns, x_desc = plan
    if x_desc is not None:
        # detach: torch refuses out= for an input that requires grad (this copy needs no gradient).
        torch.index_select(x.detach(), 1, x_columns, out=x_desc.base)
    elif x.stride(1) != 1:
        x = x.contiguous()
    b_scales = b.scales_by_step(WGMMA_STEP_K).view(torch.uint8)
    ws, counters = runtime.split_k_scratch(c, split, split * M * N, grid[0] * grid[1])
    return (x if x_desc is None else x_desc, b_desc, b_scales, c, ws, counters, bias if bias is not None else c,
            tensor_scale if tensor_scale is not None else c, M, N, K, steps_per_split, x.stride(0),
            b_scales.stride(1), b_scales.stride(0), c.stride(0))
