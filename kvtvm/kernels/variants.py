"""Named runtime variants of every kernel family: knob overrides the ops layer asks for by
name at run time, besides the tuned default.

Stdlib only: the ops import it on machines with the TVM runtime alone. Each family module
(:mod:`kvtvm.kernels.append`, ...) re-exports its own entry as ``VARIANTS``; an ahead-of-time
build (``python -m kvtvm build``) builds every variant of every spec it builds.
"""

from __future__ import annotations

from ..errors import InvalidArgumentError, describe

#: family -> target ("llvm" or "cuda") -> variant name -> knob overrides.
VARIANTS: dict[str, dict[str, dict[str, dict]]] = {
    # a serial kernel for small calls: waking the thread pool costs more than it saves
    "append": {"llvm": {"serial": {"parallel": False}}},
    "copy": {},
    "decode": {"llvm": {"serial": {"parallel": False}}},
    # calls whose sequences add few tokens each (chunked prefill, speculative verification,
    # mixed steps): a CTA of the default's 256 rows would mostly hold rows of other
    # sequences. The mma.sync kernel with 64-row CTAs on every arch (a 64-row wgmma CTA
    # leaves an SM one warp group: 126 TFLOP/s at 1x8K against 319 for four).
    "prefill": {"cuda": {"short_query": {"warps": 4, "m_tiles": 1, "tile_kv": 32,
                                         "wgmma": 0}}},
}


def variant_names(op: str, target: str) -> tuple[str, ...]:
    """Names of the variants of family ``op`` on ``target`` (``"llvm"`` or ``"cuda"``)."""
    return tuple(VARIANTS.get(op, {}).get(target, {}))


def variant_knobs(op: str, target: str, variant: str) -> dict:
    """Knob overrides of ``variant`` of family ``op`` on ``target`` ({} for ``""``).

    Raises
    ------
    InvalidArgumentError
        ``variant`` is not a variant of ``op`` on ``target``.
    """
    if not variant:
        return {}
    declared = VARIANTS.get(op, {}).get(target, {})
    if variant not in declared:
        raise InvalidArgumentError(describe(
            "variant", f"one of {sorted(declared)} for {op} on {target}", repr(variant)))
    return dict(declared[variant])
