"""Named runtime variants of every kernel family: knob overrides the ops layer asks for by
name at run time, besides the tuned default.

Stdlib only: the ops import it on machines with the TVM runtime alone. Each family module
(:mod:`kvtvm.kernels.append`, ...) re-exports its own entry as ``VARIANTS``; an ahead-of-time
build (``python -m kvtvm build``) builds every variant of every spec it builds.
"""

from __future__ import annotations

from ..errors import InvalidArgumentError, describe

#: Knob key of a variant built from the schedule's defaults, not from the tuning log (a log
#: is tuned at one workload; this variant serves calls unlike it). Not passed to a schedule.
UNTUNED = "untuned"

#: family -> target ("llvm" or "cuda") -> variant name -> knob overrides.
VARIANTS: dict[str, dict[str, dict[str, dict]]] = {
    # a serial kernel for small calls: waking the thread pool costs more than it saves
    "append": {"llvm": {"serial": {"parallel": False}}},
    "copy": {},
    # CUDA, an 8-bit side: calls whose KV splits are short (one short sequence: 1 x 4K makes
    # 128-position splits). The tuned 8-bit logs (64 threads, 3 stages of 32-64 rows, tuned at
    # 16 x 4K) lost a quarter there on an H200 while the defaults matched float16 (1.00x);
    # see docs/PERF.md, 2026-11-27. The ops pick it below CUDA_SHORT_SPLIT_TOKENS.
    # The tensor-core 8-bit kernel (mma) takes 4 warps of 64-row tiles there (``mma_short``):
    # 10% faster at 1 x 4K than its 2-warp default, 28% slower at 16 x 4K (H100, 2026-11-27).
    "decode": {"llvm": {"serial": {"parallel": False}},
               "cuda": {"short_splits": {UNTUNED: True, "mma_short": 1}}},
    # calls whose sequences add few tokens each (chunked prefill, speculative verification,
    # mixed steps): a CTA of the default's 256 rows would mostly hold rows of other
    # sequences. The mma.sync kernel with 64-row CTAs on every arch (a 64-row wgmma CTA
    # leaves an SM one warp group: 126 TFLOP/s at 1x8K against 319 for four).
    "prefill": {"cuda": {"short_query": {"warps": 4, "m_tiles": 1, "tile_kv": 32,
                                         "wgmma": 0}}},
}


#: (family, target, variant) that exist only for specs with an 8-bit K or V side.
QUANTIZED_ONLY = frozenset({("decode", "cuda", "short_splits")})


def _declared(op: str, target: str, quantized: bool) -> dict:
    return {name: knobs for name, knobs in VARIANTS.get(op, {}).get(target, {}).items()
            if quantized or (op, target, name) not in QUANTIZED_ONLY}


def variant_names(op: str, target: str, quantized: bool = False) -> tuple[str, ...]:
    """Names of the variants of family ``op`` on ``target`` (``"llvm"`` or ``"cuda"``) for a
    spec with (``quantized``) or without an 8-bit K or V side."""
    return tuple(_declared(op, target, quantized))


def variant_knobs(op: str, target: str, variant: str, quantized: bool = False) -> dict:
    """Knob overrides of ``variant`` of family ``op`` on ``target`` ({} for ``""``), for a
    spec with (``quantized``) or without an 8-bit side. ``{UNTUNED: True}`` among them: build
    from the schedule's defaults, not the tuning log.

    Raises
    ------
    InvalidArgumentError
        ``variant`` is not a variant of ``op`` on ``target`` for such a spec.
    """
    if not variant:
        return {}
    declared = _declared(op, target, quantized)
    if variant not in declared:
        what = "an 8-bit cache" if quantized else "full-precision caches"
        raise InvalidArgumentError(describe(
            "variant", f"one of {sorted(declared)} for {op} on {target} over {what}",
            repr(variant)))
    return dict(declared[variant])
