"""Kernels that the CPU interpreter cannot fault but the GPU compile must (tests/test_aot.py runs them through
``python -m vtengine.kernels.aot --cases-from aot_faults``): PTX that ptxas refuses, and a tile whose shared memory
exceeds what one sm_90 block may have. Beside them a kernel that compiles, so a run that fails everything fails
the test too."""
import torch
import triton
import triton.language as tl


@triton.jit
def copy_kernel(x_ptr, y_ptr, BLOCK: tl.constexpr):
    i = tl.arange(0, BLOCK)
    tl.store(y_ptr + i, tl.load(x_ptr + i))


@triton.jit
def bad_ptx_kernel(x_ptr, y_ptr, BLOCK: tl.constexpr):
    i = tl.arange(0, BLOCK)
    x = tl.load(x_ptr + i)
    y = tl.inline_asm_elementwise("not.an.instruction.b32 $0, $1;", "=r,r", [x], dtype=tl.int32, is_pure=True,
                                  pack=1)
    tl.store(y_ptr + i, y)


@triton.jit
def huge_tile_kernel(a_ptr, b_ptr, c_ptr, M: tl.constexpr, N: tl.constexpr, K: tl.constexpr):
    rm, rn, rk = tl.arange(0, M), tl.arange(0, N), tl.arange(0, K)
    a = tl.load(a_ptr + rm[:, None] * K + rk[None, :])
    b = tl.load(b_ptr + rk[:, None] * N + rn[None, :])
    tl.store(c_ptr + rm[:, None] * N + rn[None, :], tl.dot(a, b))


def cases():
    x, y = torch.zeros(128, dtype=torch.int32), torch.zeros(128, dtype=torch.int32)
    yield "copy", lambda: copy_kernel[(1,)](x, y, BLOCK=128)
    yield "bad ptx", lambda: bad_ptx_kernel[(1,)](x, y, BLOCK=128)
    m, n, k = 256, 256, 512
    a, b = torch.zeros(m, k, dtype=torch.bfloat16), torch.zeros(k, n, dtype=torch.bfloat16)
    c = torch.zeros(m, n, dtype=torch.float32)
    yield "huge tile", lambda: huge_tile_kernel[(1,)](a, b, c, M=m, N=n, K=k)
