"""CUDA tensor-core prefill kernel (float16 / bfloat16; sm_90a and sm_80) -- a HAND-WRITTEN
TIR kernel, used by :mod:`.cuda` (the knobs there choose ``mma.sync`` or ``wgmma``).

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
- ``wgmma`` (sm_90a, head_dim <= 128; the default there): each warp group (4 warps) owns 64
  rows, and both products are Hopper's asynchronous ``wgmma.mma_async``: S = Q K^T
  (m64 n``tile_kv`` k16) reads Q and K from shared memory through matrix descriptors, O += P V
  (m64 n``head_dim`` k16) takes P from registers (the S accumulator, rounded in pairs by
  ``cvt.rn.f16x2.f32``) and V through a transposed descriptor. Tiles are stored unpadded in
  8-row x 16-byte core matrices (the 16-byte chunk L of a copy lands at L x 16 bytes), made
  visible to the async proxy by ``fence.proxy.async`` before the barrier. S is issued before
  the next tile's copy, so the copy's page lookups overlap the tensor cores. ``m_tiles`` and
  ``q_in_regs`` do not apply; ``one_barrier`` is required. Never written in place while a
  wgmma is in flight: an accumulator register written by another instruction makes ptxas
  serialize every wgmma of the kernel (warning C7515).
- 8-bit K and/or V (``spec.k_storage`` / ``v_storage``): their rows are staged raw and
  converted into the same tiles, the scales applied to S and P (:mod:`.cuda_quant_tiles`).
"""

from __future__ import annotations

from kvtvm.kernels._tvm import ATTR_NOALIAS, T, alloc_buffer, block, prim_func, tir
from kvtvm.kernels.accessor import cache_index, find_sequence
from kvtvm.kernels.errflag import ERR_INDPTR, ERR_PAGE, ERR_POSITION
from kvtvm.kernels.decode import NAN
from kvtvm.kernels.prefill import LOG2E, NEG_INF, match_params, sequence_ok

from ..common import pages_bad_macro
from .cuda_quant_tiles import quant_tiles, raw_row_words, v_prescale

#: a masked score: exp2(MASKED - running max) is exactly 0 (running max >= NEG_INF)
MASKED = -3.0e38


def tensor_core_prefill(spec, NW: int, BN: int, STAGES: int, Q_REGS: bool, MT: int = 1,
                        ONE_BARRIER: bool = False, WG: bool = False):
    """The fp16/bf16 tensor-core prefill PrimFunc (see the module docstring); each warp owns
    ``MT`` 16-row m-tiles (every K/V fragment loaded from shared memory feeds MT MMAs), or,
    with ``WG`` (sm_90a), each warp group of 4 warps owns 64 rows and issues ``wgmma``."""
    H, G, D, dtype, layout = (spec.n_kv_heads, spec.group_size, spec.head_dim, spec.dtype,
                              spec.layout)
    assert dtype in ("float16", "bfloat16") and D % 16 == 0 and BN % 16 == 0
    if WG:
        if NW % 4 or D > 128 or BN > 256 or not ONE_BARRIER:
            raise ValueError(f"wgmma prefill needs whole warp groups (warps 4, 8, 12 or 16, got "
                             f"{NW}), head_dim <= 128 (got {D}), tile_kv <= 256 (got {BN}) "
                             f"and one_barrier")
        MT, Q_REGS = 1, False  # a warp's 16 rows are its slice of the warp group's 64
    AHEAD = STAGES - 1  # K/V tiles in flight ahead of the one computed
    AB = "fp16" if dtype == "float16" else "bf16"
    BM = 16 * NW * MT     # query rows per CTA
    WR = 16 * MT          # query rows per warp
    TQ = BM // G          # tokens per CTA (each token brings G rows)
    R = TQ * G            # rows actually used (<= BM)
    # shared-memory row stride: padded by 16 bytes (ldmatrix without bank conflicts), or, for
    # wgmma, unpadded rows in 8x8 "core matrices" (8 rows x 16 bytes, 128 contiguous bytes)
    DP = D if WG else D + 8
    NT = 32 * NW
    pages_bad = pages_bad_macro(NT)
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
    # 8-bit K and/or V (spec.k_storage / v_storage): rows staged as stored, converted into the
    # tiles below, scales applied in float32 (.cuda_quant_tiles); nothing changes otherwise
    QK, QV = bool(spec.k_storage), bool(spec.v_storage)
    QUANT = QK or QV
    RAW = STAGES * BN * raw_row_words(D)  # int32 words of a side's raw stages
    VPRE = v_prescale(spec)
    if QUANT:
        copy_raw, convert, qscale = quant_tiles(spec, BN, NT, DP, WG)

    # where 16-byte chunk ``L`` of a tile copy comes from (row, chunk) and goes (element offset);
    # for wgmma the chunks are stored in core-matrix order, so chunk L lands at L * 8
    if WG:
        def ld_row(L):
            return L // 8 // DC * 8 + L % 8

        def ld_chunk(L):
            return L // 8 % DC

        def ld_off(L):
            return L * 8
    else:
        def ld_row(L):
            return L // DC

        def ld_chunk(L):
            return L % DC

        def ld_off(L):
            return L // DC * DP + L % DC * 8

    def visible(row, pos, m, p0, kv_hi, causal, window):
        """Row ``row`` of the tile (token ``row // G`` of the segment) sees KV ``pos`` (int32)."""
        token = row // G
        cond = tir.all(row < R, token < m, pos < kv_hi,
                            tir.any(causal == 0, pos <= p0 + token))
        if SLIDE:
            cond = tir.all(cond, pos > p0 + token - window)
        return cond

    def full_tile(j0, p0, m, kv_hi, causal, window):
        """Every (row, key) pair of the KV tile at ``j0`` is visible (CTA-uniform)."""
        cond = tir.all(m >= TQ, j0 + BN <= kv_hi,
                            tir.any(causal == 0, j0 + BN - 1 <= p0))
        if R < BM:
            cond = tir.const(False)
        if SLIDE:
            cond = tir.all(cond, j0 > p0 + m - 1 - window)
        return cond

    def wgmma(n, acc, a, b_desc, accumulate, trans_b):
        """``acc (64 x n per warp group) (+)= A B``: A is a shared-memory descriptor (one
        element in ``a``) or this thread's 4 b32 fragment registers; B a descriptor."""
        shape = getattr(T.ptx.wgmma.mma_async.sync.aligned, f"m64n{n}k16").f32
        ptx_type = "f16" if dtype == "float16" else "bf16"
        inst = getattr(getattr(shape, ptx_type), ptx_type)
        accs = [acc[i] for i in range(n // 2)]
        if len(a) == 1:
            return inst(*accs, a[0], b_desc, T.ptx.pred(accumulate), 1, 1, 0, trans_b)
        return inst(*accs, *a, b_desc, T.ptx.pred(accumulate), 1, 1, trans_b)

    def wgmma_qk(sf, dsc, stage, kstep):
        """k-step ``kstep`` of S = Q K^T over K/V stage ``stage``: Q's and K's descriptors
        advanced by the k-step's 16 columns (256 bytes); the first k-step overwrites S."""
        return wgmma(BN, sf, [dsc[0] + T.Cast("uint64", kstep * 16)],
                     dsc[1] + T.Cast("uint64", T.Cast("int32", stage) * (BN * DP // 8)
                                     + kstep * 16), kstep > 0, 0)

    def wgmma_pv(of, pw, dsc, sbase, kk):
        """k-step ``kk`` of O += P V: P's registers; V's descriptor (transposed: V is stored
        by rows) at element ``sbase``, advanced by the k-step's 16 rows (2 * DC core matrices)."""
        return wgmma(D, of, [pw[kk * 4 + j] for j in range(4)],
                     dsc[2] + T.Cast("uint64", sbase // 8 + kk * DC * 16), True, 1)

    def cvt_pair(dst, hi, lo):
        """``dst`` (b32) = the pair (lo, hi) rounded to ``dtype``, lo in the low half."""
        if dtype == "float16":
            return T.ptx.cvt.rn.f16x2.f32(dst, hi, lo)
        return T.ptx.cvt.rn.bf16x2.f32(dst, hi, lo)

    @T.macro
    def rescale_tile(S, j0i, tile, state, of, w, lane):
        """Scores ``S`` of the KV tile at ``j0i``: scaled (base 2) and masked; the running max
        (``state`` = mr, lr, mx) raised to cover them, O (``of``) and the running sum rescaled.
        ``tile`` = (p0i, mi, kv_hii, causal, window, sm_scale) of the segment."""
        p0i, mi, kv_hii, causal, window, sm_scale = tile
        mr, lr, mx = state
        # scale (base 2); mask only tiles that need it
        for i in T.unroll(MT * NB * 4):
            S[i] = S[i] * (sm_scale * T.float32(LOG2E))
        if not full_tile(j0i, p0i, mi, kv_hii, causal, window):
            for mt in T.unroll(MT):
                for nb in T.unroll(NB):
                    for e in T.unroll(4):
                        if not visible(
                                w * WR + mt * 16 + lane // 4 + e // 2 * 8,
                                j0i + nb * 8 + lane % 4 * 2 + e % 2,
                                mi, p0i, kv_hii, causal, window):
                            S[(mt * NB + nb) * 4 + e] = T.float32(MASKED)
        # running max over the 4 threads sharing a row
        for hh in T.unroll(2 * MT):
            mx[hh] = mr[hh]
        for i in T.unroll(MT * NB * 4):
            mx[i // (NB * 4) * 2 + i % 4 // 2] = T.max(
                mx[i // (NB * 4) * 2 + i % 4 // 2], S[i])
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

    @T.macro
    def probs_tile(S, state, pf, pw, pt, vq):
        """P = exp2(S - max) into ``pf`` (``pw`` for wgmma), added to the running sum. With
        wgmma, ``pt`` (2 floats) holds a pair on the way and S itself is never written: ptxas
        serializes every wgmma of a kernel that writes an accumulator register outside one."""
        mr, lr, mx = state
        # P = exp2(S - m) (masked scores give exactly 0); the S fragment of n-blocks 2j, 2j+1
        # is the A fragment j
        if WG:
            for nb in T.unroll(NB):
                for e2 in T.unroll(2):  # the pair (row e2, columns 2q, 2q + 1)
                    for e1 in T.unroll(2):
                        pt[e1] = T.exp2(S[nb * 4 + e2 * 2 + e1] - mx[e2])
                    lr[e2] = lr[e2] + pt[0] + pt[1]
                    if QV:  # P' = P * scale_v (V's codes are unscaled)
                        for e1 in T.unroll(2):
                            pt[e1] = pt[e1] * (qscale(vq[0], vq[1], nb * 8 + vq[2] % 4 * 2
                                                      + e1) * T.float32(VPRE))
                    T.evaluate(cvt_pair(pw[nb // 2 * 4 + nb % 2 * 2 + e2], pt[1], pt[0]))
        else:
            for mt in T.unroll(MT):
                for nb in T.unroll(NB):
                    for e in T.unroll(4):
                        S[(mt * NB + nb) * 4 + e] = T.exp2(
                            S[(mt * NB + nb) * 4 + e] - mx[mt * 2 + e // 2])
                        lr[mt * 2 + e // 2] = lr[mt * 2 + e // 2] \
                            + S[(mt * NB + nb) * 4 + e]
                        if QV:  # P' = P * scale_v (V's codes are unscaled)
                            pf[mt * NB * 4 + nb // 2 * 8 + nb % 2 * 4 + e] = T.Cast(
                                dtype, S[(mt * NB + nb) * 4 + e] * (qscale(
                                    vq[0], vq[1], nb * 8 + vq[2] % 4 * 2 + e % 2)
                                    * T.float32(VPRE)))
                        else:
                            pf[mt * NB * 4 + nb // 2 * 8 + nb % 2 * 4 + e] = \
                                T.Cast(dtype, S[(mt * NB + nb) * 4 + e])

    @T.macro
    def kv_load(Ks, Vs, k_cache, v_cache, lookup, b, h, page_size, stage, j0, kv_hi, L):
        # 16-byte chunk ``L`` of the K and V tiles starting at position j0; zero past kv_hi
        # (the segment's pages were checked by its pre-pass)
        pos = j0 + ld_row(L)
        pc = T.min(pos, kv_hi - 1)
        page = T.Cast("int64", lookup[b, T.truncdiv(pc, page_size)])
        slot = T.truncmod(pc, page_size)
        T.evaluate(T.ptx["cp.async.cg.shared.global"](
            Ks.ptr_to([stage * (BN * DP) + ld_off(L)]),
            k_cache.ptr_to(list(cache_index(layout, page, slot, h, ld_chunk(L) * 8))), 16,
            T.Cast("uint32", T.if_then_else(pos < kv_hi, 16, 0))))
        T.evaluate(T.ptx["cp.async.cg.shared.global"](
            Vs.ptr_to([stage * (BN * DP) + ld_off(L)]),
            v_cache.ptr_to(list(cache_index(layout, page, slot, h, ld_chunk(L) * 8))), 16,
            T.Cast("uint32", T.if_then_else(pos < kv_hi, 16, 0))))

    @T.macro
    def tile_load(S, cache, lookup, b, h, page_size, stage, j0, kv_hi, tid):
        # one full-precision side of kv_load, for a spec whose other side is 8-bit
        for it in T.unroll(KV_ITERS):
            if it * NT + tid < BN * DC:
                T.evaluate(T.ptx["cp.async.cg.shared.global"](
                    S.ptr_to([stage * (BN * DP) + ld_off(it * NT + tid)]),
                    cache.ptr_to(list(cache_index(
                        layout, T.Cast("int64", lookup[b, T.truncdiv(T.min(
                            j0 + ld_row(it * NT + tid), kv_hi - 1), page_size)]),
                        T.truncmod(T.min(j0 + ld_row(it * NT + tid), kv_hi - 1), page_size),
                        h, ld_chunk(it * NT + tid) * 8))), 16,
                    T.Cast("uint32", T.if_then_else(j0 + ld_row(it * NT + tid) < kv_hi,
                                                    16, 0))))

    @T.macro
    def kv_stage(tiles, caches, lookup, b, h, page_size, stage, j0, kv_hi, tid):
        # the K/V tiles at j0 of a spec with an 8-bit side: 8-bit rows into their raw stage,
        # full-precision rows straight into their tile; tiles = (Ks, Vs, Kraw, Vraw)
        if QK:
            copy_raw(tiles[2], caches[0], lookup, b, h, page_size, stage, j0, kv_hi, tid)
        else:
            tile_load(tiles[0], caches[0], lookup, b, h, page_size, stage, j0, kv_hi, tid)
        if QV:
            copy_raw(tiles[3], caches[1], lookup, b, h, page_size, stage, j0, kv_hi, tid)
        else:
            tile_load(tiles[1], caches[1], lookup, b, h, page_size, stage, j0, kv_hi, tid)

    @T.macro
    def convert_tiles(tiles, stage, tid):
        # the landed raw stage(s) -> the float16 / bfloat16 tiles of that stage (unscaled),
        # visible to every warp (and to wgmma's async proxy) after this
        convert(tiles, stage, tid)
        if WG:
            T.evaluate(T.ptx.fence.proxy.async_.shared__cta())
        T.tvm_storage_sync("shared")

    @T.macro
    def encode_descriptors(dsc, Qs, Ks, Vs, w):
        # wgmma's shared-memory matrix descriptors (offsets in 16-byte units): Q (this warp
        # group's 64 rows) and K are K-major -- core matrices 128 bytes apart along k, 8-row
        # groups DC * 128 apart; V (the B of P V, stored by rows) is read transposed -- along
        # k (its rows) 8-row groups DC * 128 apart, along n (head_dim) 128. access_ptr names
        # the whole tiles, which only wgmma reads.
        T.cuda.wgmma.encode_matrix_descriptor(
            T.address_of(dsc[0]), Qs.access_ptr("r", offset=w // 4 * 64 * D), 8, DC * 8, 0)
        T.cuda.wgmma.encode_matrix_descriptor(
            T.address_of(dsc[1]), Ks.access_ptr("r"), 8, DC * 8, 0)
        T.cuda.wgmma.encode_matrix_descriptor(
            T.address_of(dsc[2]), Vs.access_ptr("r"), DC * 8, 8, 0)

    @T.macro
    def tiles_landed(pending):
        # this thread's copies but the last ``pending`` groups are in shared memory; wgmma
        # reads it through the async proxy, which must see the (generic-proxy) writes
        T.evaluate(T.ptx.cp.async_.wait_group(pending))
        if WG:
            T.evaluate(T.ptx.fence.proxy.async_.shared__cta())
        T.tvm_storage_sync("shared")

    def raw_stages(on, fallback):
        # an 8-bit side's raw stages (int32 words), or (full-precision side) its tile itself
        return alloc_buffer((RAW,), "int32", scope="shared.dyn") if on else fallback

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
        for lbx in T.thread_binding((ntok + TQ - 1) // TQ, thread="blockIdx.x"):
            for lby in T.thread_binding(H, thread="blockIdx.y"):
                for lty in T.thread_binding(NW, thread="threadIdx.y"):
                    for ltx in T.thread_binding(32, thread="threadIdx.x"):
                        with block("attn"):
                            bx, h, w, lane = T.axis.remap("SSSS", [lbx, lby, lty, ltx])
                            T.reads()
                            T.writes()
                            Qs = alloc_buffer((BM * DP,), dtype, scope="shared.dyn")
                            Ks = alloc_buffer((STAGES * BN * DP,), dtype,
                                                       scope="shared.dyn")
                            Vs = alloc_buffer((STAGES * BN * DP,), dtype,
                                                       scope="shared.dyn")
                            qf = alloc_buffer((QF,), dtype, scope="local")
                            kf = alloc_buffer((8,), dtype, scope="local")
                            vf = alloc_buffer((8,), dtype, scope="local")
                            sf = alloc_buffer((MT * NB * 4,), "float32", scope="local")
                            pf = alloc_buffer((MT * NB * 4,), dtype, scope="local")
                            of = alloc_buffer((MT * DB * 4,), "float32", scope="local")
                            mr = alloc_buffer((2 * MT,), "float32", scope="local")
                            lr = alloc_buffer((2 * MT,), "float32", scope="local")
                            mx = alloc_buffer((2 * MT,), "float32", scope="local")
                            ib = alloc_buffer((2,), "int32", scope="local")
                            ir = alloc_buffer((1,), "int64", scope="local")
                            bad = alloc_buffer((1,), "int32", scope="local")
                            # wgmma: shared-memory descriptors of Q (this warp group's rows),
                            # K and V (stage 0); P packed in pairs (4 b32 A registers a k-step)
                            dsc = alloc_buffer((3,), "uint64", scope="local")
                            pw = alloc_buffer((MT * NB * 2,), "uint32", scope="local")
                            pt = alloc_buffer((2,), "float32", scope="local")
                            Kraw = raw_stages(QK, Ks)
                            Vraw = raw_stages(QV, Vs)
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
                                # a segment outside its sequence's rows or capacity: skipped
                                seg_ok: T.bool = tir.all(
                                    T.Cast("int64", qo_indptr[b]) <= r0,
                                    sequence_ok(qo_indptr, cache_lengths, b,
                                                max_pages * page_size))
                                if tid == 0 and r1 > r0 and not seg_ok:
                                    err[T.if_then_else(T.Cast("int64", qo_indptr[b]) <= r0,
                                                       ERR_POSITION, ERR_INDPTR)] = 1
                                if T.tvm_thread_invariant(r1 > r0 and seg_ok):
                                    m: T.int64 = r1 - r0
                                    p0: T.int64 = T.Cast("int64", cache_lengths[b]) + r0 \
                                        - T.Cast("int64", qo_indptr[b])
                                    kv_hi: T.int64 = T.if_then_else(
                                        causal != 0, p0 + m,
                                        T.Cast("int64", cache_lengths[b])
                                        + T.Cast("int64", qo_indptr[b + 1])
                                        - T.Cast("int64", qo_indptr[b]))
                                    kv_lo: T.int64 = T.max(p0 - T.Cast("int64", window) + 1,
                                                           T.int64(0)) * SLIDE
                                    # every page of the segment is checked before any is
                                    # staged: one outside the pool empties the segment
                                    pages_bad(bad, lookup, b,
                                              T.truncdiv(T.Cast("int32", kv_lo),
                                                         T.Cast("int32", page_size)),
                                              T.if_then_else(
                                                  kv_hi > kv_lo,
                                                  T.truncdiv(T.Cast("int32", kv_hi - 1),
                                                             T.Cast("int32", page_size)), -1),
                                              num_pages, tid)
                                    if tid == 0 and bad[0] != 0:
                                        err[ERR_PAGE] = 1
                                    n_kv: T.int64 = T.if_then_else(
                                        bad[0] != 0, T.int64(0), (kv_hi - kv_lo + BN - 1) // BN)
                                    # positions fit int32 (the ops layer caps lengths at 2**31)
                                    mi: T.int32 = T.Cast("int32", m)
                                    p0i: T.int32 = T.Cast("int32", p0)
                                    kv_hii: T.int32 = T.Cast("int32", kv_hi)
                                    # ---- Q tile -> shared (zero rows past the segment) ----
                                    for it in T.unroll(Q_ITERS):
                                        if it * NT + tid < BM * DC:
                                            T.evaluate(T.ptx["cp.async.cg.shared.global"](
                                                Qs.ptr_to([ld_off(it * NT + tid)]),
                                                q.ptr_to([T.if_then_else(
                                                    ld_row(it * NT + tid) < R
                                                    and T.Cast("int64", ld_row(it * NT + tid) // G) < m,
                                                    r0 + ld_row(it * NT + tid) // G, r0),
                                                    h * G + ld_row(it * NT + tid) % G,
                                                    ld_chunk(it * NT + tid) * 8]),
                                                16,
                                                T.Cast("uint32", T.if_then_else(
                                                    ld_row(it * NT + tid) < R
                                                    and T.Cast("int64", ld_row(it * NT + tid) // G) < m,
                                                    16, 0))))
                                    T.evaluate(T.ptx.cp.async_.commit_group())
                                    # ---- K/V tiles of the first AHEAD iterations ----
                                    for st in T.unroll(AHEAD):
                                        if QUANT:
                                            if T.Cast("int64", st) < n_kv:
                                                kv_stage((Ks, Vs, Kraw, Vraw), (k_cache, v_cache),
                                                         lookup, b, h, page_size, st,
                                                         kv_lo + T.Cast("int64", st * BN), kv_hi,
                                                         tid)
                                        elif T.Cast("int64", st) < n_kv:
                                            for it in T.unroll(KV_ITERS):
                                                if it * NT + tid < BN * DC:
                                                    kv_load(Ks, Vs, k_cache, v_cache, lookup, b,
                                                            h, page_size, st,
                                                            kv_lo + T.Cast("int64", st * BN),
                                                            kv_hi, it * NT + tid)
                                        T.evaluate(T.ptx.cp.async_.commit_group())
                                    # ---- state ----
                                    for i in T.unroll(MT * DB * 4):
                                        of[i] = T.float32(0)
                                    for i in T.unroll(2 * MT):
                                        mr[i] = T.float32(NEG_INF)
                                        lr[i] = T.float32(0)
                                    if Q_REGS:
                                        tiles_landed(AHEAD)
                                        for mt in T.unroll(MT):
                                            for kstep in T.unroll(KS):
                                                T.evaluate(T.ptx_legacy.ldmatrix(
                                                    False, 4, ".b16", qf.data, (mt * KS + kstep) * 8,
                                                    Qs.access_ptr("r"),
                                                    (w * WR + mt * 16 + lane % 16) * DP + kstep * 16
                                                    + lane // 16 * 8, dtype=dtype))
                                    if WG:
                                        encode_descriptors(dsc, Qs, Ks, Vs, w)
                                    # ---- main loop over KV tiles ----
                                    for kt in range(n_kv):
                                        if ONE_BARRIER:
                                            # tile kt landed and every warp is past tile kt - 1,
                                            # whose stage the next copy reuses: one barrier
                                            tiles_landed(AHEAD - 1)
                                            if QUANT:
                                                convert_tiles((Ks, Vs, Kraw, Vraw),
                                                              T.Cast("int32", kt % STAGES), tid)
                                        if WG:  # S = Q K^T first: the copy below overlaps it
                                            T.evaluate(T.ptx.wgmma.fence.sync.aligned())
                                            for kstep in T.unroll(KS):
                                                T.evaluate(wgmma_qk(sf, dsc, kt % STAGES, kstep))
                                            T.evaluate(T.ptx.wgmma.commit_group.sync.aligned())
                                        if QUANT:
                                            if kt + AHEAD < n_kv:
                                                kv_stage((Ks, Vs, Kraw, Vraw), (k_cache, v_cache),
                                                         lookup, b, h, page_size,
                                                         (kt + AHEAD) % STAGES,
                                                         kv_lo + (kt + AHEAD) * BN, kv_hi, tid)
                                        elif kt + AHEAD < n_kv:
                                            for it in T.unroll(KV_ITERS):
                                                if it * NT + tid < BN * DC:
                                                    kv_load(Ks, Vs, k_cache, v_cache, lookup, b, h,
                                                            page_size, (kt + AHEAD) % STAGES,
                                                            kv_lo + (kt + AHEAD) * BN, kv_hi,
                                                            it * NT + tid)
                                        T.evaluate(T.ptx.cp.async_.commit_group())
                                        if not ONE_BARRIER:
                                            tiles_landed(STAGES - 1)
                                            if QUANT:
                                                convert_tiles((Ks, Vs, Kraw, Vraw),
                                                              T.Cast("int32", kt % STAGES), tid)
                                        j0i: T.int32 = T.Cast("int32", kv_lo + kt * BN)
                                        sbase: T.int32 = T.Cast("int32", kt % STAGES) * (BN * DP)
                                        if WG:  # S of tile kt complete
                                            T.evaluate(T.ptx.wgmma.wait_group.sync.aligned(0))
                                        else:
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
                                        if QK:  # S[i, j] *= scale_k[j] (K's codes are unscaled)
                                            for i in T.unroll(MT * NB * 4):
                                                sf[i] = sf[i] * qscale(
                                                    Kraw, T.Cast("int32", kt % STAGES),
                                                    i // 4 % NB * 8 + lane % 4 * 2 + i % 2)
                                        rescale_tile(sf, j0i, (p0i, mi, kv_hii, causal, window,
                                                               sm_scale), (mr, lr, mx), of, w, lane)
                                        probs_tile(sf, (mr, lr, mx), pf, pw, pt,
                                                   (Vraw, T.Cast("int32", kt % STAGES), lane))
                                        # O += P V
                                        if WG:
                                            T.evaluate(T.ptx.wgmma.fence.sync.aligned())
                                            for kk in T.unroll(NB // 2):
                                                T.evaluate(wgmma_pv(of, pw, dsc, sbase, kk))
                                            T.evaluate(T.ptx.wgmma.commit_group.sync.aligned())
                                            T.evaluate(T.ptx.wgmma.wait_group.sync.aligned(0))
                                        else:
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
                                    if VPRE != 1.0:  # P V was accumulated times VPRE
                                        for i in T.unroll(MT * DB * 4):
                                            of[i] = of[i] * T.float32(1.0 / VPRE)
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
                                                if lane % 4 == 0:  # lr 0: every score -inf, lse NaN
                                                    lse[r0 + (w * WR + mt * 16 + lane // 4 + hh * 8) // G,
                                                        h * G + (w * WR + mt * 16 + lane // 4 + hh * 8) % G] = \
                                                        T.Select(lr[mt * 2 + hh] == T.float32(0), T.float32(NAN),
                                                                 (mr[mt * 2 + hh] + T.log2(lr[mt * 2 + hh])) * T.float32(LN2))
                                ir[0] = T.max(r1, r0)
                                ib[0] = ib[0] + 1
                            if tid == 0 and ir[0] < row1:  # rows past qo_indptr[batch]
                                err[ERR_INDPTR] = 1
    # fmt: on
    return prefill
