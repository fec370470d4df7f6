import torch, triton, triton.language as tl
from triton.testing import do_bench
dev = "cuda"

@triton.jit
def sm(x_ptr, y_ptr, M, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, LOAD_CM: tl.constexpr, STORE_CM: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.arange(0, BLOCK_N)
    mask = (rows[:, None] < M) & (cols[None, :] < N)
    r = rows.to(tl.int64)[:, None] * N
    x = tl.load(x_ptr + r + cols[None, :], mask=mask, other=-float("inf"), cache_modifier=LOAD_CM).to(tl.float32)
    e = tl.exp(x - tl.max(x, axis=1)[:, None])
    y = e * (1.0 / tl.sum(e, axis=1))[:, None]
    tl.store(y_ptr + r + cols[None, :], y.to(y_ptr.dtype.element_ty), mask=mask, cache_modifier=STORE_CM)

@triton.jit
def sw(g_ptr, u_ptr, h_ptr, N, BLOCK: tl.constexpr, LOAD_CM: tl.constexpr, STORE_CM: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = cols < N
    g = tl.load(g_ptr + row * N + cols, mask=ok, other=0.0, cache_modifier=LOAD_CM).to(tl.float32)
    u = tl.load(u_ptr + row * N + cols, mask=ok, other=0.0, cache_modifier=LOAD_CM).to(tl.float32)
    tl.store(h_ptr + row * N + cols, (g / (1.0 + tl.exp(-g)) * u).to(h_ptr.dtype.element_ty), mask=ok, cache_modifier=STORE_CM)

def gbps(f, n): return n / do_bench(f, warmup=10, rep=60, return_mode="median") / 1e6
for dtype in (torch.bfloat16, torch.float32):
    for N, bm, w in ((4096, 1, 8), (4096, 2, 8), (4096, 1, 4), (1024, 4, 8), (16384, 1, 16)):
        x = torch.randn(4096, N, device=dev, dtype=dtype); y = torch.empty_like(x)
        res = []
        for lc in ("", ".ca", ".cg"):
            for sc in ("", ".cs", ".cg"):
                f = lambda: sm[(triton.cdiv(4096, bm),)](x, y, 4096, N, BLOCK_M=bm, BLOCK_N=N, LOAD_CM=lc, STORE_CM=sc, num_warps=w)
                res.append((round(gbps(f, 2 * x.nbytes)), lc or "-", sc or "-"))
        print("softmax", dtype, N, bm, w, sorted(res, reverse=True)[:3], "plain", res[0][0], flush=True)
g = torch.randn(8192, 14336, device=dev, dtype=torch.bfloat16); u = torch.randn_like(g); h = torch.empty_like(g)
res = []
for lc in ("", ".cg"):
    for sc in ("", ".cs", ".cg"):
        f = lambda: sw[(8192, 2)](g, u, h, 14336, BLOCK=8192, LOAD_CM=lc, STORE_CM=sc, num_warps=16)
        res.append((round(gbps(f, 3 * g.nbytes)), lc or "-", sc or "-"))
print("swiglu", sorted(res, reverse=True), flush=True)
