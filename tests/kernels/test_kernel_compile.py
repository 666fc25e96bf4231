"""The kernels compile to sm_90 (H100/H200) cubins on a machine without a GPU.

The interpreter runs a kernel as numpy and accepts code the GPU compiler
rejects (a non-constexpr global, a tl.dot shape, a dtype a conversion does
not support). This test records the launches the launchers make on CPU
tensors and compiles each one ahead of time with Triton's own ptxas, in a
subprocess with TRITON_INTERPRET=0.
"""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import subprocess  # noqa: E402
import sys  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

TYPES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16", torch.int32: "i32",
         torch.int64: "i64", torch.int8: "i8", torch.float8_e4m3fn: "fp8e4nv"}


class Recorder:
    """Stands in for a kernel: `kernel[grid](*args, **kwargs)` records the call."""

    def __init__(self, fn):
        self.fn, self.calls = fn, []

    def __getitem__(self, grid):
        return lambda *args, num_warps=4, **kwargs: self.calls.append((args, kwargs, num_warps))


def signature(fn, args, kwargs):
    """Triton's (signature, constexprs) for one recorded call, as the launcher would specialize it."""
    sig, const = {}, {}
    for name, arg in zip(fn.arg_names, args):
        if arg is None:
            sig[name], const[name] = "constexpr", None
        elif isinstance(arg, torch.Tensor):
            sig[name] = "*" + TYPES[arg.dtype]
        elif isinstance(arg, int):
            sig[name] = "i32" if -2 ** 31 <= arg < 2 ** 31 else "i64"
        else:
            sig[name] = "fp32"
    for name, value in kwargs.items():
        sig[name], const[name] = "constexpr", value
    return sig, const


def record_launches():
    """Every kernel's launches for a Llama-8B-shaped layer: bf16 pool, int8 pool, fp32 model."""
    from streamchat.kernels import decode, prefill, write_kv

    recorders = {}
    for module, name in ((decode, "_decode_split_kernel"), (decode, "_decode_reduce_kernel"),
                         (prefill, "_prefill_kernel"), (write_kv, "_write_kv_kernel")):
        recorders[name] = Recorder(getattr(module, name))
        setattr(module, name, recorders[name])
    num_kv_heads, head_dim, block_size = 8, 128, 16
    cos = sin = torch.zeros(4096, head_dim)
    tables, seq_lens = torch.zeros(4, 8, dtype=torch.int32), torch.ones(4, dtype=torch.int32)
    cu = torch.arange(5, dtype=torch.int32)
    for q_dtype, kv_dtype in ((torch.bfloat16, torch.bfloat16), (torch.bfloat16, torch.int8),
                              (torch.float32, torch.float32)):
        key = torch.zeros(64, block_size, num_kv_heads, head_dim, dtype=kv_dtype)
        scales = (None, None) if kv_dtype == q_dtype else (torch.ones(key.shape[:3]), torch.ones(key.shape[:3]))
        q = torch.zeros(4, 4 * num_kv_heads, head_dim, dtype=q_dtype)
        decode.paged_decode(q, key, key, tables, seq_lens, cos, sin, 0.1, *scales)
        prefill.paged_prefill(q, key, key, tables, seq_lens, cu, cos, sin, 0.1, *scales)
        write_kv.write_kv(key, key, q[:, :num_kv_heads], q[:, :num_kv_heads], torch.arange(4), cos, sin, *scales)
    return recorders


def main() -> None:
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    assert os.environ["TRITON_INTERPRET"] == "0"
    for name, recorder in record_launches().items():
        for args, kwargs, num_warps in recorder.calls:
            sig, const = signature(recorder.fn, args, kwargs)
            compiled = triton.compile(ASTSource(recorder.fn, sig, const), target=GPUTarget("cuda", 90, 32),
                                      options=dict(num_warps=num_warps))
            assert compiled.asm["cubin"], name
            if name == "_write_kv_kernel" and kwargs["QUANT"]:  # quantizing divides exactly, as torch does
                ptx = compiled.asm["ptx"]
                assert "div.rn.f32" in ptx and "div.full.f32" not in ptx and "div.approx" not in ptx, name
    print("compiled")


def test_kernels_compile_for_sm90():
    """Every launch the launchers make (bf16, int8 and fp32 pools) compiles to an sm_90 cubin; the int8
    write's divisions are IEEE round-to-nearest (div.rn), not the GPU's default approximate division."""
    pytest.importorskip("triton.backends.nvidia")
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    # the subprocess imports this checkout's package, as pytest does (its sys.path[0] is tests/kernels)
    path = os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p)
    env = dict(os.environ, TRITON_INTERPRET="0", TRITON_DEFAULT_FP_FUSION="1", PYTHONPATH=path)
    result = subprocess.run([sys.executable, __file__], env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0 and "compiled" in result.stdout, result.stderr[-4000:]


if __name__ == "__main__":
    main()
