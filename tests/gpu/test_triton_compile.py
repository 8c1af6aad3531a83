"""Every Triton kernel compiles for the GPU (sm_90, Hopper) with triton's own compiler and
bundled ptxas, no GPU needed: catches what the interpreter accepts but the compiler does
not (non-constexpr globals, dtype mismatches in tl.dot, unsupported control flow)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

from gpu_marks import requires_triton

ROOT = Path(__file__).resolve().parents[2]

SCRIPT = textwrap.dedent('''
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from kvmesh.layers import triton_attention as A, triton_ops as O
    from kvmesh.quant import triton_gemm as Q

    def compile_(fn, sig, consts):
        sig = {**sig, **{k: "constexpr" for k in consts}}
        triton.compile(ASTSource(fn=fn, signature=sig, constexprs=consts), target=GPUTarget("cuda", 90, 32))
        print("ok", fn.__name__, flush=True)

    i32 = "i32"
    strides = dict(stride_qt=i32, stride_qh=i32, stride_cb="i64", stride_ct=i32, stride_ch=i32, stride_tb=i32,
                   stride_ot=i32, stride_oh=i32)
    for dt in ("bf16", "fp32"):
        compile_(A._store_kv, dict(k_ptr="*" + dt, v_ptr="*" + dt, kc_ptr="*" + dt, vc_ptr="*" + dt,
                                   slot_ptr="*i64", stride_kt=i32, stride_vt=i32), dict(ROW=256, BLOCK=256))
        # the model's dtype in the cache, and the 8-bit caches (int8; fp8 e4m3 on sm_89+) with their scales
        for cdt in (dt, "i8", "fp8e4nv"):
            quant = cdt != dt
            if quant:
                compile_(A._store_kv_quant, dict(k_ptr="*" + dt, v_ptr="*" + dt, kc_ptr="*" + cdt, vc_ptr="*" + cdt,
                                                 ks_ptr="*fp32", vs_ptr="*fp32", slot_ptr="*i64", stride_kt=i32,
                                                 stride_kh=i32, stride_vt=i32, stride_vh=i32),
                         dict(QMAX=127.0 if cdt == "i8" else 448.0, INT8=cdt == "i8", D=128, BLOCK_D=128))
            cache = dict(kc_ptr="*" + cdt, vc_ptr="*" + cdt, ks_ptr="*fp32", vs_ptr="*fp32")
            for direct in (True, False):
                compile_(A._decode_split, dict(q_ptr="*" + dt, **cache, table_ptr="*i32",
                                               lens_ptr="*i32", o_ptr="*" + dt, mid_ptr="*fp32", lse_ptr="*fp32",
                                               scale="fp32", split_len=i32, num_splits=i32, window=i32, **strides),
                         dict(BS=16, G=4, G_PAD=16, D=128, BLOCK_D=128, BLOCK_N=64, DIRECT=direct, IEEE=dt == "fp32",
                              QUANT=quant))
            compile_(A._prefill, dict(q_ptr="*" + dt, **cache, o_ptr="*" + dt, table_ptr="*i32",
                                      qstart_ptr="*i32", qlen_ptr="*i32", startpos_ptr="*i32", scale="fp32",
                                      window=i32, **strides),
                     dict(BS=16, G=4, D=128, BLOCK_D=128, BLOCK_M=64 if dt == "bf16" else 32, BLOCK_N=32,
                          IEEE=dt == "fp32", QUANT=quant))
        compile_(A._decode_reduce, dict(mid_ptr="*fp32", lse_ptr="*fp32", o_ptr="*" + dt, num_splits=i32,
                                        stride_ot=i32, stride_oh=i32), dict(D=128, BLOCK_D=128, S_PAD=32))
        for add in (False, True):
            compile_(O._rms_norm, dict(x_ptr="*" + dt, r_ptr="*" + dt, w_ptr="*" + dt, out_ptr="*" + dt,
                                       sum_ptr="*" + dt, stride_x=i32, stride_r=i32, eps="fp32"),
                     dict(N=2048, BLOCK=2048, ADD=add))
        compile_(O._rope_qk, dict(qkv_ptr="*" + dt, cos_ptr="*" + dt, sin_ptr="*" + dt, out_ptr="*" + dt,
                                  stride_t=i32, stride_c=i32), dict(D=128, HALF=64, BLOCK_D=128, NQK=40))
        compile_(O._silu_and_mul, dict(gu_ptr="*" + dt, out_ptr="*" + dt, stride_t=i32), dict(INNER=8192, BLOCK=1024))
        for int4, grouped, mins in ((False, False, False), (False, True, False), (True, True, False), (True, True, True)):
            compile_(Q._wq_gemm, dict(x_ptr="*" + dt, q_ptr="*u8" if int4 else "*i8", s_ptr="*fp16" if int4 else "*fp32",
                                      o_ptr="*fp16" if int4 else "*fp32", y_ptr="*" + dt, M=i32, N=i32, K=i32, G=i32,
                                      stride_xm=i32, stride_qn=i32, stride_sn=i32, stride_ym=i32),
                     dict(INT4=int4, MINS=mins, GROUPED=grouped, BLOCK_M=16, BLOCK_N=64, BLOCK_K=64, IEEE=dt == "fp32"))
    print("ALL OK")
''')


@requires_triton
def test_every_kernel_compiles_for_hopper():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = f"{ROOT / 'platform'}{os.pathsep}{env.get('PYTHONPATH', '')}"
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    r = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, env=env, timeout=600)
    assert r.returncode == 0 and "ALL OK" in r.stdout, (r.stdout[-2000:], r.stderr[-4000:])
