"""The Triton kernels compile to GPU machine code (sm_80 and sm_90 cubins) on a machine without a GPU.

The interpreter tests check what the kernel computes; this checks that the compiled path (tensor-core
products in bf16, integer loop bounds, constexpr layouts) is valid Triton for real GPUs. Compiling
needs a kernel built without TRITON_INTERPRET, hence a fresh interpreter process.
"""

import os
import subprocess
import sys
import textwrap

import pytest

pytestmark = pytest.mark.slow  # a fresh interpreter process compiles the kernel

pytest.importorskip("triton")  # the 'kernels' extra

SCRIPT = textwrap.dedent('''
    import sys
    import triton
    import triton.language as tl
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from polykv.adapters.quantizers import kivi_triton as kt

    PTR = {"KC": "*u8", "VC": "*u8", "KG": "*i32", "KNQ": "*i64", "KNR": "*i64", "VNQ": "*i64", "VNR": "*i64",
           "OACC": "*fp32", "OM": "*fp32", "OL": "*fp32"}
    FLOATS = ("Q", "KS", "KZ", "KR", "VS", "VZ", "VR")


    def compile_one(arch, dtype, k_layout, v_layout, has_gid):
        fn = kt._decode_kernel
        const = dict(K_LAYOUT=int(k_layout), K_BITS=4, K_GROUP=32, K_HAS_GID=has_gid == "1", V_LAYOUT=int(v_layout),
                     V_BITS=2, V_GROUP=32, DOT_DTYPE=tl.bfloat16 if dtype == "bf16" else tl.float32,
                     DOT_PREC="tf32" if dtype == "bf16" else "ieee", BLOCK_M=16, BLOCK_N=32, BLOCK_D=64)
        ptr = {**PTR, **{n: "*" + dtype for n in FLOATS}}
        sig = {n: "constexpr" if n in const else ptr.get(n, "fp32" if n == "scaling" else "i32")
               for n in fn.arg_names}
        kernel = triton.compile(ASTSource(fn, sig, constexprs=const), target=GPUTarget("cuda", int(arch), 32),
                                options={"enable_fp_fusion": False})
        assert kernel.asm["cubin"], (arch, dtype)


    assert not kt.interpreting()
    for variant in sys.argv[1:]:
        compile_one(*variant.split(","))
    sig = {"OACC": "*fp32", "OM": "*fp32", "OL": "*fp32", "OUT": "*bf16", "S": "i32", "M": "i32", "D": "i32",
           "BLOCK_M": "constexpr", "BLOCK_D": "constexpr"}
    combine = triton.compile(ASTSource(kt._combine_kernel, sig, constexprs=dict(BLOCK_M=16, BLOCK_D=64)),
                             target=GPUTarget("cuda", 90, 32))
    assert combine.asm["cubin"]
    print("ok")
''')


def test_kernel_compiles_for_gpus():
    variants = ["90,bf16,1,2,1",   # K4 with group ids after a gather, V2, bf16 (H100/H200)
                "80,fp32,0,0,0"]   # 16-bit keys and values in float32 (A100)
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, "-c", SCRIPT, *variants], env=env, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0 and proc.stdout.startswith("ok"), proc.stderr[-3000:]
