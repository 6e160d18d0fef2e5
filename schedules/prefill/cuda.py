"""CUDA schedule of prefill attention (sm_90a and sm_80): flash-attention-2 on tensor cores
(``mma.sync``, or ``wgmma`` on sm_90a).

HAND-WRITTEN TIR kernels, not transformations of the definition: built directly from the knobs
as thread-bound TIR (same signature and block names as the definition in
``kvtvm/kernels/prefill.py``; tests/kernels/ compile them and check them against the
definition compiled unscheduled where a GPU is present).

float16 / bfloat16: the tensor-core kernel of :mod:`.cuda_tensor_core` (``mma.sync``, or
``wgmma`` on sm_90a; the sm_90a/sm_80 difference is the knob default ``wgmma``).

float32 (``simt_prefill``): no tensor cores (fp32 operands would need TF32, which loses the
float32 accuracy callers ask for); one warp per (token, query head) row, lanes splitting
head_dim: correct, not tuned (float32 prefill is not a serving configuration).

8-bit K and/or V (``spec.k_storage`` / ``v_storage``): float16 / bfloat16 through the same
tensor-core kernel, its 8-bit tiles staged and converted by :mod:`.cuda_quant_tiles`; float32
through ``simt_prefill`` dequantizing each element as it loads it
(:func:`kvtvm.kernels.quant_access.dequant`: the value times its row's inline scale --
correct, not tuned).
"""

from __future__ import annotations

from kvtvm.kernels._tvm import ATTR_NOALIAS, T, alloc_buffer, block, prim_func, tir
from kvtvm.kernels.accessor import find_sequence
from kvtvm.kernels.errflag import ERR_INDPTR, ERR_PAGE, ERR_POSITION
from kvtvm.kernels.quant_access import dequant
from kvtvm.kernels.decode import NAN
from kvtvm.kernels.prefill import LOG2E, NEG_INF, match_params, sequence_ok, uses_wgmma

from ..common import pages_bad_macro, replace_function
from .cuda_tensor_core import tensor_core_prefill


def default_knobs(spec) -> dict:
    if spec.dtype == "float32":
        return {"warps": 4}
    if spec.head_dim > 128:
        return {"warps": 4, "tile_kv": 32, "stages": 2, "q_in_regs": 0, "m_tiles": 1,
                "one_barrier": 1, "wgmma": 0}
    if spec.quantized and spec.head_dim <= 128:
        # 8-bit K and/or V (.cuda_quant_tiles): the conversion and the per-row scales cost
        # registers -- 16 warps (128 registers a thread) or two m-tiles spill; two warp groups,
        # or 8 warps of one m-tile, fit (ptxas, tests/quant/test_quant_prefill_cuda.py)
        if uses_wgmma(spec):
            return {"warps": 8, "tile_kv": 64, "stages": 2, "q_in_regs": 0, "m_tiles": 1,
                    "one_barrier": 1, "wgmma": 1}
        return {"warps": 8, "tile_kv": 32, "stages": 2, "q_in_regs": 0, "m_tiles": 1,
                "one_barrier": 1, "wgmma": 0}
    if uses_wgmma(spec):
        # four warp groups of 64 rows and 64-position K/V tiles, one CTA an SM (H100, fp16
        # d128, 1x8K causal: 319 TFLOP/s against 250-266 with 2-3 warp groups, 215 with
        # 128-position tiles, 252 for the mma.sync kernel; tools/gpu_prefill_probe.py)
        return {"warps": 16, "tile_kv": 64, "stages": 2, "q_in_regs": 0, "m_tiles": 1,
                "one_barrier": 1, "wgmma": 1}
    # 8 warps of two 16-row m-tiles: each K/V fragment feeds two MMAs (H100, fp16 d128, 1x8K
    # causal: 243 TFLOP/s against 186 with one m-tile and 4 warps; tools/gpu_prefill_probe.py)
    return {"warps": 8, "tile_kv": 32, "stages": 2, "q_in_regs": 0, "m_tiles": 2,
            "one_barrier": 1, "wgmma": 0}


def schedule(mod, spec, knobs):
    if spec.dtype == "float32":
        func = simt_prefill(spec, int(knobs["warps"]))
    else:
        func = tensor_core_prefill(spec, int(knobs["warps"]), int(knobs["tile_kv"]),
                                   int(knobs["stages"]), bool(knobs["q_in_regs"]),
                                   int(knobs["m_tiles"]), bool(knobs["one_barrier"]),
                                   bool(knobs.get("wgmma", 0)))
    return replace_function(mod, func, "prefill")


def simt_prefill(spec, NW: int):
    """float32: one warp per (token, query head) row, lanes splitting head_dim, dot products
    reduced with warp shuffles; online softmax over the row's visible KV positions."""
    H, G, D, dtype, layout = (spec.n_kv_heads, spec.group_size, spec.head_dim, spec.dtype,
                              spec.layout)
    HQ = H * G
    DL = (D + 31) // 32  # elements per lane
    SLIDE = 1 if "sliding_window" in spec.features else 0
    # which form ptxas allocates without spills depends on the kernel around it (checked by
    # tests/compiler and tests/integrations at d16 .. d128)
    pages_bad = pages_bad_macro(32, "warp", hoist=DL == 1)

    # fmt: off
    @prim_func
    def prefill(var_q: T.handle, var_k_cache: T.handle, var_v_cache: T.handle,
                var_qo_indptr: T.handle, var_cache_lengths: T.handle, var_lookup: T.handle,
                var_out: T.handle, var_lse: T.handle, causal: T.int32, sm_scale: T.float32,
                window: T.int32, var_err: T.handle):
        T.func_attr({ATTR_NOALIAS: True})
        (ntok, batch, num_pages, page_size, max_pages, q, k_cache, v_cache, qo_indptr,
         cache_lengths, lookup, out, lse, err) = match_params(
            spec, var_q, var_k_cache, var_v_cache, var_qo_indptr, var_cache_lengths,
            var_lookup, var_out, var_lse, var_err)
        for lbx in T.thread_binding((ntok * HQ + NW - 1) // NW, thread="blockIdx.x"):
            for lty in T.thread_binding(NW, thread="threadIdx.y"):
                for ltx in T.thread_binding(32, thread="threadIdx.x"):
                    with block("attn"):
                        bx, w, lane = T.axis.remap("SSS", [lbx, lty, ltx])
                        T.reads()
                        T.writes()
                        qs = alloc_buffer((DL,), "float32", scope="local")
                        acc = alloc_buffer((DL,), "float32", scope="local")
                        st = alloc_buffer((4,), "float32", scope="local")
                        ib = alloc_buffer((2,), "int32", scope="local")
                        bad = alloc_buffer((1,), "int32", scope="local")
                        row: T.int64 = bx * NW + w
                        if row < ntok * HQ:
                            vn: T.int64 = row // HQ
                            vh: T.int64 = row % HQ
                            find_sequence(qo_indptr, ib, batch, vn)
                            b: T.int32 = ib[0]
                            pos: T.int64 = T.Cast("int64", cache_lengths[b]) + vn \
                                - T.Cast("int64", qo_indptr[b])
                            kv_len: T.int64 = T.Cast("int64", cache_lengths[b]) \
                                + T.Cast("int64", qo_indptr[b + 1]) \
                                - T.Cast("int64", qo_indptr[b])
                            row_ok: T.bool = tir.all(T.Cast("int64", qo_indptr[b]) <= vn,
                                                     vn < T.Cast("int64", qo_indptr[b + 1]))
                            len_ok: T.bool = sequence_ok(qo_indptr, cache_lengths, b,
                                                         max_pages * page_size)
                            if lane == 0 and not row_ok:
                                err[ERR_INDPTR] = 1
                            elif lane == 0 and not len_ok:
                                err[ERR_POSITION] = 1
                            hi: T.int64 = T.if_then_else(
                                row_ok and len_ok, T.if_then_else(causal != 0, pos + 1, kv_len),
                                T.int64(0))
                            lo: T.int64 = T.max(pos - T.Cast("int64", window) + 1,
                                                T.int64(0)) * SLIDE
                            for i in T.unroll(DL):
                                if i * 32 + lane < D:
                                    qs[i] = T.Cast("float32", q[vn, vh, i * 32 + lane]) \
                                        * sm_scale * T.float32(LOG2E)
                                else:
                                    qs[i] = T.float32(0)
                                acc[i] = T.float32(0)
                            st[0] = T.float32(NEG_INF)
                            st[1] = T.float32(0)
                            # every page the row reads is checked first (one warp per row)
                            pages_bad(bad, lookup, b,
                                      T.truncdiv(T.Cast("int32", lo), T.Cast("int32", page_size)),
                                      T.if_then_else(hi > lo, T.truncdiv(T.Cast("int32", hi - 1), T.Cast("int32", page_size)), -1),
                                      num_pages, lane)
                            if lane == 0 and bad[0] != 0:
                                err[ERR_PAGE] = 1
                            # positions to visit, bound once (the loop test reads one value)
                            n_j: T.int64 = T.if_then_else(bad[0] != 0, T.int64(0),
                                                          T.max(hi - lo, T.int64(0)))
                            for j in range(n_j):
                                page: T.int64 = T.Cast("int64",
                                                       lookup[b, T.truncdiv(lo + j, page_size)])
                                slot: T.int64 = T.truncmod(lo + j, page_size)
                                st[2] = T.float32(0)
                                for i in T.unroll(DL):
                                    if i * 32 + lane < D:
                                        st[2] = st[2] + qs[i] * dequant(
                                            k_cache, layout, page, slot, vh // G, i * 32 + lane,
                                            D, spec.k_storage)
                                for sh in T.unroll(5):
                                    st[2] = st[2] + T.tvm_warp_shuffle_xor(
                                        T.uint32(0xFFFFFFFF), st[2], 1 << sh, 32, 32)
                                st[3] = T.exp2(st[0] - T.max(st[0], st[2]))
                                st[0] = T.max(st[0], st[2])
                                st[2] = T.exp2(st[2] - st[0])
                                st[1] = st[1] * st[3] + st[2]
                                for i in T.unroll(DL):
                                    if i * 32 + lane < D:
                                        acc[i] = acc[i] * st[3] + st[2] * dequant(
                                            v_cache, layout, page, slot, vh // G, i * 32 + lane,
                                            D, spec.v_storage)
                            for i in T.unroll(DL):
                                if i * 32 + lane < D:
                                    out[vn, vh, i * 32 + lane] = T.Cast(dtype, acc[i] / st[1])
                            if lane == 0:  # st[1] 0: every score -inf, out 0/0 and lse NaN
                                lse[vn, vh] = T.Select(st[1] == T.float32(0), T.float32(NAN), (st[0] + T.log2(st[1])) * T.float32(1.0 / LOG2E))
    # fmt: on
    return prefill
