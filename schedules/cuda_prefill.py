"""CUDA schedule of prefill attention (sm_90a and sm_80): flash-attention-2 on tensor cores.

Built directly from the knobs as thread-bound TIR (same signature and block names as the
definition in ``kvtvm/kernels/prefill.py``, tested against the same numpy reference).

float16 / bfloat16 (``tensor_core_prefill``):

- grid ``(query tiles, n_kv_heads)``; a CTA of ``warps`` warps owns ``16 * m_tiles * warps``
  query rows (each warp ``m_tiles`` 16-row MMA tiles, so every K/V fragment it loads feeds
  ``m_tiles`` MMAs), a row being one (token, query head of the KV head) pair, so the
  ``group_size`` heads that
  share a KV head share every K/V tile (GQA). Tiles are consecutive token rows of the ragged
  batch; one that spans several sequences is processed a sequence segment at a time; heavy
  (late) tiles are launched first.
- Q and K/V tiles are staged in dynamic shared memory (rows padded by 16 bytes, so ldmatrix
  is bank-conflict free) with ``cp.async`` (16-byte, zero-filling out-of-range rows); the K/V
  tiles of ``stages`` iterations are in flight (double buffering with ``stages = 2``); each
  K/V row is found through the page table. ``one_barrier``: one ``__syncthreads`` per KV tile
  (the next copy is issued after the barrier that follows the wait, into the stage every warp
  has left) instead of two.
- S = Q K^T and O += P V run as ``mma.sync.m16n8k16`` (f32 accumulate) with operands loaded
  by ``ldmatrix`` (``.trans`` for V); P never leaves registers (the S accumulator fragment
  is the A fragment of the PV product). The online softmax (base 2) runs on the fragments,
  row max / sum reduced with warp shuffles over the 4 threads sharing a row.
- ``q_in_regs``: Q fragments kept in registers for the whole KV loop (head_dim <= 128);
  reloaded from shared memory per KV tile otherwise (keeps head_dim 256 free of spills).

float32 (``simt_prefill``): no tensor cores (fp32 operands would need TF32, which loses the
float32 accuracy callers ask for); one warp per (token, query head) row, lanes splitting
head_dim: correct, not tuned (float32 prefill is not a serving configuration).
"""

from __future__ import annotations

import tvm
from tvm.script import tirx as T

from kvtvm.kernels.accessor import cache_index, find_sequence
from kvtvm.kernels.prefill import LOG2E, NEG_INF, match_params

#: a masked score: exp2(MASKED - running max) is exactly 0 (running max >= NEG_INF)
MASKED = -3.0e38



def prefill_knobs(spec) -> dict:
    if spec.dtype == "float32":
        return {"warps": 4}
    if spec.head_dim > 128:
        return {"warps": 4, "tile_kv": 32, "stages": 2, "q_in_regs": 0, "m_tiles": 1,
                "one_barrier": 1}
    # 8 warps of two 16-row m-tiles: each K/V fragment feeds two MMAs (H100, fp16 d128, 1x8K
    # causal: 243 TFLOP/s against 186 with one m-tile and 4 warps; tools/gpu_prefill_probe.py)
    return {"warps": 8, "tile_kv": 32, "stages": 2, "q_in_regs": 0, "m_tiles": 2,
            "one_barrier": 1}


#: Knob overrides of the variant the ops layer launches when a call's sequences add few tokens
#: each (chunked prefill, speculative verification, mixed steps): a CTA of the default's 256
#: rows would mostly hold rows of other sequences, processed one segment at a time.
SHORT_QUERY_KNOBS = {"warps": 4, "m_tiles": 1}



def prefill_knob_space(spec) -> dict:
    if spec.dtype == "float32":
        return {"warps": [2, 4, 8]}
    return {"warps": [2, 4, 8], "tile_kv": [32, 64] if spec.head_dim <= 128 else [16, 32],
            "stages": [2, 3], "q_in_regs": [0, 1] if spec.head_dim <= 128 else [0],
            "m_tiles": [1, 2] if spec.head_dim <= 128 else [1], "one_barrier": [0, 1]}


def schedule_prefill(mod, spec, knobs):
    if spec.dtype == "float32":
        func = simt_prefill(spec, int(knobs["warps"]))
    else:
        func = tensor_core_prefill(spec, int(knobs["warps"]), int(knobs["tile_kv"]),
                                   int(knobs["stages"]), bool(knobs["q_in_regs"]),
                                   int(knobs["m_tiles"]), bool(knobs["one_barrier"]))
    (name, old), = mod.functions_items()
    assert len(old.params) == len(func.params), "prefill signature drifted from the definition"
    return tvm.IRModule({name: func.with_attr("global_symbol", name.name_hint)})


def simt_prefill(spec, NW: int):
    """float32: one warp per (token, query head) row, lanes splitting head_dim, dot products
    reduced with warp shuffles; online softmax over the row's visible KV positions."""
    H, G, D, dtype, layout = (spec.n_kv_heads, spec.group_size, spec.head_dim, spec.dtype,
                              spec.layout)
    HQ = H * G
    DL = (D + 31) // 32  # elements per lane
    SLIDE = 1 if "sliding_window" in spec.features else 0

    # fmt: off
    @T.prim_func(s_tir=True)
    def prefill(var_q: T.handle, var_k_cache: T.handle, var_v_cache: T.handle,
                var_qo_indptr: T.handle, var_cache_lengths: T.handle, var_lookup: T.handle,
                var_out: T.handle, var_lse: T.handle, causal: T.int32, sm_scale: T.float32,
                window: T.int32):
        T.func_attr({"tirx.noalias": True})
        (ntok, batch, num_pages, page_size, max_pages, q, k_cache, v_cache, qo_indptr,
         cache_lengths, lookup, out, lse) = match_params(
            spec, var_q, var_k_cache, var_v_cache, var_qo_indptr, var_cache_lengths,
            var_lookup, var_out, var_lse)
        for lbx in T.thread_binding((ntok * HQ + NW - 1) // NW, thread="blockIdx.x"):
            for lty in T.thread_binding(NW, thread="threadIdx.y"):
                for ltx in T.thread_binding(32, thread="threadIdx.x"):
                    with T.sblock("attn"):
                        bx, w, lane = T.axis.remap("SSS", [lbx, lty, ltx])
                        T.reads()
                        T.writes()
                        qs = T.sblock_alloc_buffer((DL,), "float32", scope="local")
                        acc = T.sblock_alloc_buffer((DL,), "float32", scope="local")
                        st = T.sblock_alloc_buffer((4,), "float32", scope="local")
                        ib = T.sblock_alloc_buffer((2,), "int32", scope="local")
                        row: T.int64 = bx * NW + w
                        if row < ntok * HQ:
                            vn: T.int64 = row // HQ
                            vh: T.int64 = row % HQ
                            find_sequence(qo_indptr, ib, batch, vn)
                            b: T.int32 = ib[0]
                            pos: T.int64 = T.Cast("int64", cache_lengths[b]) + vn \
                                - T.Cast("int64", qo_indptr[b])
                            kv_len: T.int64 = T.Cast("int64", cache_lengths[b] + qo_indptr[b + 1]
                                                     - qo_indptr[b])
                            hi: T.int64 = T.if_then_else(causal != 0, pos + 1, kv_len)
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
                            for j in range(hi - lo):
                                page: T.int64 = T.Cast("int64",
                                                       lookup[b, T.truncdiv(lo + j, page_size)])
                                slot: T.int64 = T.truncmod(lo + j, page_size)
                                st[2] = T.float32(0)
                                for i in T.unroll(DL):
                                    if i * 32 + lane < D:
                                        st[2] = st[2] + qs[i] * T.Cast("float32", k_cache[
                                            cache_index(layout, page, slot, vh // G,
                                                        i * 32 + lane)])
                                for sh in T.unroll(5):
                                    st[2] = st[2] + T.tvm_warp_shuffle_xor(
                                        T.uint32(0xFFFFFFFF), st[2], 1 << sh, 32, 32)
                                st[3] = T.exp2(st[0] - T.max(st[0], st[2]))
                                st[0] = T.max(st[0], st[2])
                                st[2] = T.exp2(st[2] - st[0])
                                st[1] = st[1] * st[3] + st[2]
                                for i in T.unroll(DL):
                                    if i * 32 + lane < D:
                                        acc[i] = acc[i] * st[3] + st[2] * T.Cast(
                                            "float32", v_cache[cache_index(
                                                layout, page, slot, vh // G, i * 32 + lane)])
                            for i in T.unroll(DL):
                                if i * 32 + lane < D:
                                    out[vn, vh, i * 32 + lane] = T.Cast(dtype, acc[i] / st[1])
                            if lane == 0:
                                lse[vn, vh] = (st[0] + T.log2(st[1])) * T.float32(1.0 / LOG2E)
    # fmt: on
    return prefill


def tensor_core_prefill(spec, NW: int, BN: int, STAGES: int, Q_REGS: bool, MT: int = 1,
                        ONE_BARRIER: bool = False):
    """The fp16/bf16 tensor-core prefill PrimFunc (see the module docstring); each warp owns
    ``MT`` 16-row m-tiles (every K/V fragment loaded from shared memory feeds MT MMAs)."""
    H, G, D, dtype, layout = (spec.n_kv_heads, spec.group_size, spec.head_dim, spec.dtype,
                              spec.layout)
    assert dtype in ("float16", "bfloat16") and D % 16 == 0 and BN % 16 == 0
    AB = "fp16" if dtype == "float16" else "bf16"
    BM = 16 * NW * MT     # query rows per CTA
    WR = 16 * MT          # query rows per warp
    TQ = BM // G          # tokens per CTA (each token brings G rows)
    R = TQ * G            # rows actually used (<= BM)
    DP = D + 8            # padded shared-memory row (16 bytes)
    NT = 32 * NW
    DC = D // 8           # 16-byte chunks per row
    KS = D // 16          # k-steps of Q K^T
    NB = BN // 8          # n-blocks of S
    DB = D // 8           # n-blocks of O
    QF = (KS * 8 if Q_REGS else 8) * MT
    QR = int(Q_REGS)
    SLIDE = 1 if "sliding_window" in spec.features else 0
    Q_ITERS = (BM * DC + NT - 1) // NT
    KV_ITERS = (BN * DC + NT - 1) // NT
    LN2 = 1.0 / LOG2E

    def visible(row, pos, m, p0, kv_hi, causal, window):
        """Row ``row`` of the tile (token ``row // G`` of the segment) sees KV ``pos`` (int32)."""
        token = row // G
        cond = tvm.tirx.all(row < R, token < m, pos < kv_hi,
                            tvm.tirx.any(causal == 0, pos <= p0 + token))
        if SLIDE:
            cond = tvm.tirx.all(cond, pos > p0 + token - window)
        return cond

    def full_tile(j0, p0, m, kv_hi, causal, window):
        """Every (row, key) pair of the KV tile at ``j0`` is visible (CTA-uniform)."""
        cond = tvm.tirx.all(m >= TQ, j0 + BN <= kv_hi,
                            tvm.tirx.any(causal == 0, j0 + BN - 1 <= p0))
        if R < BM:
            cond = tvm.tirx.const(False)
        if SLIDE:
            cond = tvm.tirx.all(cond, j0 > p0 + m - 1 - window)
        return cond

    @T.macro
    def kv_load(Ks, Vs, k_cache, v_cache, lookup, b, h, page_size, stage, pos, kv_hi, row,
                chunk):
        # one 16-byte chunk of K and of V row ``row`` of the stage; zero past kv_hi
        pc = T.min(pos, kv_hi - 1)
        page = T.Cast("int64", lookup[b, T.truncdiv(pc, page_size)])
        slot = T.truncmod(pc, page_size)
        T.evaluate(T.ptx["cp.async.cg.shared.global"](
            Ks.ptr_to([stage * (BN * DP) + row * DP + chunk * 8]),
            k_cache.ptr_to(list(cache_index(layout, page, slot, h, chunk * 8))), 16,
            T.Cast("uint32", T.if_then_else(pos < kv_hi, 16, 0))))
        T.evaluate(T.ptx["cp.async.cg.shared.global"](
            Vs.ptr_to([stage * (BN * DP) + row * DP + chunk * 8]),
            v_cache.ptr_to(list(cache_index(layout, page, slot, h, chunk * 8))), 16,
            T.Cast("uint32", T.if_then_else(pos < kv_hi, 16, 0))))

    # fmt: off
    @T.prim_func(s_tir=True)
    def prefill(var_q: T.handle, var_k_cache: T.handle, var_v_cache: T.handle,
                var_qo_indptr: T.handle, var_cache_lengths: T.handle, var_lookup: T.handle,
                var_out: T.handle, var_lse: T.handle, causal: T.int32, sm_scale: T.float32,
                window: T.int32):
        T.func_attr({"tirx.noalias": True})
        (ntok, batch, num_pages, page_size, max_pages, q, k_cache, v_cache, qo_indptr,
         cache_lengths, lookup, out, lse) = match_params(
            spec, var_q, var_k_cache, var_v_cache, var_qo_indptr, var_cache_lengths,
            var_lookup, var_out, var_lse)
        for lbx in T.thread_binding((ntok + TQ - 1) // TQ, thread="blockIdx.x"):
            for lby in T.thread_binding(H, thread="blockIdx.y"):
                for lty in T.thread_binding(NW, thread="threadIdx.y"):
                    for ltx in T.thread_binding(32, thread="threadIdx.x"):
                        with T.sblock("attn"):
                            bx, h, w, lane = T.axis.remap("SSSS", [lbx, lby, lty, ltx])
                            T.reads()
                            T.writes()
                            Qs = T.sblock_alloc_buffer((BM * DP,), dtype, scope="shared.dyn")
                            Ks = T.sblock_alloc_buffer((STAGES * BN * DP,), dtype,
                                                       scope="shared.dyn")
                            Vs = T.sblock_alloc_buffer((STAGES * BN * DP,), dtype,
                                                       scope="shared.dyn")
                            qf = T.sblock_alloc_buffer((QF,), dtype, scope="local")
                            kf = T.sblock_alloc_buffer((8,), dtype, scope="local")
                            vf = T.sblock_alloc_buffer((8,), dtype, scope="local")
                            sf = T.sblock_alloc_buffer((MT * NB * 4,), "float32", scope="local")
                            pf = T.sblock_alloc_buffer((MT * NB * 4,), dtype, scope="local")
                            of = T.sblock_alloc_buffer((MT * DB * 4,), "float32", scope="local")
                            mr = T.sblock_alloc_buffer((2 * MT,), "float32", scope="local")
                            lr = T.sblock_alloc_buffer((2 * MT,), "float32", scope="local")
                            mx = T.sblock_alloc_buffer((2 * MT,), "float32", scope="local")
                            ib = T.sblock_alloc_buffer((2,), "int32", scope="local")
                            ir = T.sblock_alloc_buffer((1,), "int64", scope="local")
                            tid: T.int32 = w * 32 + lane
                            ntiles: T.int64 = (ntok + TQ - 1) // TQ
                            t: T.int64 = ntiles - 1 - bx
                            row1: T.int64 = T.min(t * TQ + TQ, ntok)
                            # locate: largest b with qo_indptr[b] <= first row of the tile
                            find_sequence(qo_indptr, ib, batch, t * TQ)
                            ir[0] = t * TQ
                            while T.tvm_thread_invariant(ir[0] < row1
                                                         and T.Cast("int64", ib[0]) < batch):
                                b: T.int32 = ib[0]
                                r0: T.int64 = ir[0]
                                r1: T.int64 = T.min(T.Cast("int64", qo_indptr[b + 1]), row1)
                                if T.tvm_thread_invariant(r1 > r0):
                                    m: T.int64 = r1 - r0
                                    p0: T.int64 = T.Cast("int64", cache_lengths[b]) + r0 \
                                        - T.Cast("int64", qo_indptr[b])
                                    kv_hi: T.int64 = T.if_then_else(
                                        causal != 0, p0 + m,
                                        T.Cast("int64", cache_lengths[b] + qo_indptr[b + 1]
                                               - qo_indptr[b]))
                                    kv_lo: T.int64 = T.max(p0 - T.Cast("int64", window) + 1,
                                                           T.int64(0)) * SLIDE
                                    n_kv: T.int64 = (kv_hi - kv_lo + BN - 1) // BN
                                    # positions fit int32 (the ops layer caps lengths at 2**31)
                                    mi: T.int32 = T.Cast("int32", m)
                                    p0i: T.int32 = T.Cast("int32", p0)
                                    kv_hii: T.int32 = T.Cast("int32", kv_hi)
                                    # ---- Q tile -> shared (zero rows past the segment) ----
                                    for it in T.unroll(Q_ITERS):
                                        if it * NT + tid < BM * DC:
                                            T.evaluate(T.ptx["cp.async.cg.shared.global"](
                                                Qs.ptr_to([(it * NT + tid) // DC * DP
                                                           + (it * NT + tid) % DC * 8]),
                                                q.ptr_to([T.if_then_else(
                                                    (it * NT + tid) // DC < R
                                                    and T.Cast("int64", (it * NT + tid) // DC // G) < m,
                                                    r0 + (it * NT + tid) // DC // G, r0),
                                                    h * G + (it * NT + tid) // DC % G,
                                                    (it * NT + tid) % DC * 8]),
                                                16,
                                                T.Cast("uint32", T.if_then_else(
                                                    (it * NT + tid) // DC < R
                                                    and T.Cast("int64", (it * NT + tid) // DC // G) < m,
                                                    16, 0))))
                                    T.evaluate(T.ptx.cp.async_.commit_group())
                                    # ---- K/V tiles of the first STAGES - 1 iterations ----
                                    for st in T.unroll(STAGES - 1):
                                        if T.Cast("int64", st) < n_kv:
                                            for it in T.unroll(KV_ITERS):
                                                if it * NT + tid < BN * DC:
                                                    kv_load(Ks, Vs, k_cache, v_cache, lookup, b,
                                                            h, page_size, st,
                                                            kv_lo + T.Cast("int64", st * BN
                                                            + (it * NT + tid) // DC),
                                                            kv_hi, (it * NT + tid) // DC,
                                                            (it * NT + tid) % DC)
                                        T.evaluate(T.ptx.cp.async_.commit_group())
                                    # ---- state ----
                                    for i in T.unroll(MT * DB * 4):
                                        of[i] = T.float32(0)
                                    for i in T.unroll(2 * MT):
                                        mr[i] = T.float32(NEG_INF)
                                        lr[i] = T.float32(0)
                                    if Q_REGS:
                                        T.evaluate(T.ptx.cp.async_.wait_group(STAGES - 1))
                                        T.tvm_storage_sync("shared")
                                        for mt in T.unroll(MT):
                                            for kstep in T.unroll(KS):
                                                T.evaluate(T.ptx_legacy.ldmatrix(
                                                    False, 4, ".b16", qf.data, (mt * KS + kstep) * 8,
                                                    Qs.access_ptr("r"),
                                                    (w * WR + mt * 16 + lane % 16) * DP + kstep * 16
                                                    + lane // 16 * 8, dtype=dtype))
                                    # ---- main loop over KV tiles ----
                                    for kt in range(n_kv):
                                        if ONE_BARRIER:
                                            # tile kt landed and every warp is past tile kt - 1,
                                            # whose stage the next copy reuses: one barrier
                                            T.evaluate(T.ptx.cp.async_.wait_group(STAGES - 2))
                                            T.tvm_storage_sync("shared")
                                        if kt + STAGES - 1 < n_kv:
                                            for it in T.unroll(KV_ITERS):
                                                if it * NT + tid < BN * DC:
                                                    kv_load(Ks, Vs, k_cache, v_cache, lookup, b,
                                                            h, page_size,
                                                            (kt + STAGES - 1) % STAGES,
                                                            kv_lo + (kt + STAGES - 1) * BN
                                                            + (it * NT + tid) // DC,
                                                            kv_hi, (it * NT + tid) // DC,
                                                            (it * NT + tid) % DC)
                                        T.evaluate(T.ptx.cp.async_.commit_group())
                                        if not ONE_BARRIER:
                                            T.evaluate(T.ptx.cp.async_.wait_group(STAGES - 1))
                                            T.tvm_storage_sync("shared")
                                        j0i: T.int32 = T.Cast("int32", kv_lo + kt * BN)
                                        sbase: T.int32 = T.Cast("int32", kt % STAGES) * (BN * DP)
                                        # S = Q K^T
                                        for i in T.unroll(MT * NB * 4):
                                            sf[i] = T.float32(0)
                                        for kstep in T.unroll(KS):
                                            if not Q_REGS:
                                                for mt in T.unroll(MT):
                                                    T.evaluate(T.ptx_legacy.ldmatrix(
                                                        False, 4, ".b16", qf.data, mt * 8,
                                                        Qs.access_ptr("r"),
                                                        (w * WR + mt * 16 + lane % 16) * DP
                                                        + kstep * 16 + lane // 16 * 8, dtype=dtype))
                                            for kb in T.unroll(NB // 2):
                                                T.evaluate(T.ptx_legacy.ldmatrix(
                                                    False, 4, ".b16", kf.data, 0,
                                                    Ks.access_ptr("r"),
                                                    sbase + (kb * 16 + lane % 8 + lane // 16 * 8) * DP
                                                    + kstep * 16 + lane // 8 % 2 * 8, dtype=dtype))
                                                for mt in T.unroll(MT):
                                                    for half in T.unroll(2):
                                                        T.evaluate(T.ptx_legacy.mma(
                                                            "m16n8k16", "row", "col", AB, AB, "fp32",
                                                            qf.data, (mt * KS + kstep) * 8 * QR + mt * 8 * (1 - QR),
                                                            kf.data, half * 4, sf.data,
                                                            (mt * NB + kb * 2 + half) * 4,
                                                            False, dtype="float32"))
                                        # scale (base 2); mask only tiles that need it
                                        for i in T.unroll(MT * NB * 4):
                                            sf[i] = sf[i] * (sm_scale * T.float32(LOG2E))
                                        if not full_tile(j0i, p0i, mi, kv_hii, causal, window):
                                            for mt in T.unroll(MT):
                                                for nb in T.unroll(NB):
                                                    for e in T.unroll(4):
                                                        if not visible(
                                                                w * WR + mt * 16 + lane // 4 + e // 2 * 8,
                                                                j0i + nb * 8 + lane % 4 * 2 + e % 2,
                                                                mi, p0i, kv_hii, causal, window):
                                                            sf[(mt * NB + nb) * 4 + e] = T.float32(MASKED)
                                        # running max over the 4 threads sharing a row
                                        for hh in T.unroll(2 * MT):
                                            mx[hh] = mr[hh]
                                        for i in T.unroll(MT * NB * 4):
                                            mx[i // (NB * 4) * 2 + i % 4 // 2] = T.max(
                                                mx[i // (NB * 4) * 2 + i % 4 // 2], sf[i])
                                        for hh in T.unroll(2 * MT):
                                            mx[hh] = T.max(mx[hh], T.tvm_warp_shuffle_xor(
                                                T.uint32(0xFFFFFFFF), mx[hh], 1, 32, 32))
                                            mx[hh] = T.max(mx[hh], T.tvm_warp_shuffle_xor(
                                                T.uint32(0xFFFFFFFF), mx[hh], 2, 32, 32))
                                        # rescale the running state by exp2(m_old - m_new)
                                        for hh in T.unroll(2 * MT):
                                            mr[hh] = T.exp2(mr[hh] - mx[hh])
                                            lr[hh] = lr[hh] * mr[hh]
                                        for i in T.unroll(MT * DB * 4):
                                            of[i] = of[i] * mr[i // (DB * 4) * 2 + i % 4 // 2]
                                        for hh in T.unroll(2 * MT):
                                            mr[hh] = mx[hh]
                                        # P = exp2(S - m) (masked scores give exactly 0)
                                        for mt in T.unroll(MT):
                                            for nb in T.unroll(NB):
                                                for e in T.unroll(4):
                                                    sf[(mt * NB + nb) * 4 + e] = T.exp2(
                                                        sf[(mt * NB + nb) * 4 + e] - mx[mt * 2 + e // 2])
                                                    lr[mt * 2 + e // 2] = lr[mt * 2 + e // 2] \
                                                        + sf[(mt * NB + nb) * 4 + e]
                                                    # S fragment (n-blocks 2j, 2j+1) = A fragment j
                                                    pf[mt * NB * 4 + nb // 2 * 8 + nb % 2 * 4 + e] = \
                                                        T.Cast(dtype, sf[(mt * NB + nb) * 4 + e])
                                        # O += P V
                                        for kk in T.unroll(NB // 2):
                                            for db in T.unroll(DB // 2):
                                                T.evaluate(T.ptx_legacy.ldmatrix(
                                                    True, 4, ".b16", vf.data, 0,
                                                    Vs.access_ptr("r"),
                                                    sbase + (kk * 16 + lane % 8 + lane // 8 % 2 * 8) * DP
                                                    + db * 16 + lane // 16 * 8, dtype=dtype))
                                                for mt in T.unroll(MT):
                                                    for half in T.unroll(2):
                                                        T.evaluate(T.ptx_legacy.mma(
                                                            "m16n8k16", "row", "col", AB, AB, "fp32",
                                                            pf.data, mt * NB * 4 + kk * 8, vf.data,
                                                            half * 4, of.data,
                                                            (mt * DB + db * 2 + half) * 4,
                                                            False, dtype="float32"))
                                        if not ONE_BARRIER:  # the next copy reuses this stage
                                            T.tvm_storage_sync("shared")
                                    T.evaluate(T.ptx.cp.async_.wait_group(0))
                                    if ONE_BARRIER:  # the next segment's copies reuse Q and K/V
                                        T.tvm_storage_sync("shared")
                                    # ---- epilogue: O / l, lse ----
                                    for hh in T.unroll(2 * MT):
                                        lr[hh] = lr[hh] + T.tvm_warp_shuffle_xor(
                                            T.uint32(0xFFFFFFFF), lr[hh], 1, 32, 32)
                                        lr[hh] = lr[hh] + T.tvm_warp_shuffle_xor(
                                            T.uint32(0xFFFFFFFF), lr[hh], 2, 32, 32)
                                    for mt in T.unroll(MT):
                                        for hh in T.unroll(2):
                                            if (w * WR + mt * 16 + lane // 4 + hh * 8 < R and T.Cast(
                                                    "int64", (w * WR + mt * 16 + lane // 4 + hh * 8) // G) < m):
                                                for db in T.unroll(DB):
                                                    for e in T.unroll(2):
                                                        out[r0 + (w * WR + mt * 16 + lane // 4 + hh * 8) // G,
                                                            h * G + (w * WR + mt * 16 + lane // 4 + hh * 8) % G,
                                                            db * 8 + lane % 4 * 2 + e] = T.Cast(
                                                            dtype, of[(mt * DB + db) * 4 + hh * 2 + e]
                                                            / lr[mt * 2 + hh])
                                                if lane % 4 == 0:
                                                    lse[r0 + (w * WR + mt * 16 + lane // 4 + hh * 8) // G,
                                                        h * G + (w * WR + mt * 16 + lane // 4 + hh * 8) % G] = \
                                                        (mr[mt * 2 + hh] + T.log2(lr[mt * 2 + hh])) * T.float32(LN2)
                                ir[0] = T.max(r1, r0)
                                ib[0] = ib[0] + 1
    # fmt: on
    return prefill
