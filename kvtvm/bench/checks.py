"""What the benchmarks check before they time kvtvm: each kvtvm column (full precision or a
stored type) against attention computed in float32 over the very values its cache holds (8-bit
rows decoded by kvtvm's numpy reference, :func:`kvtvm.quant.dequantize_rows`), on the first
:data:`CHECK_SEQUENCES` sequences of the case, whatever peers ``--skip`` leaves out. A kernel
that returns garbage stops the run (``SystemExit`` naming the case and the column) instead of
getting a speed; so does a kvtvm column that cannot run at all."""

from __future__ import annotations

__all__ = ["CHECK_SEQUENCES", "stored_values", "check_decode", "check_prefill", "kvtvm_failed"]

#: Sequences of a case each kvtvm column is checked on (they hold every code path: pages in
#: any order, the partial last page).
CHECK_SEQUENCES = 2
#: Query rows of a prefill sequence checked (its last ones).
CHECK_ROWS = 128
#: Largest error allowed, as a fraction of the reference's largest magnitude, by the dtype of
#: the queries and output (float32 accumulation in both; the output's rounding in half types).
REL_TOL = {"float32": 1e-4, "float16": 1e-2, "bfloat16": 3e-2}


def kvtvm_failed(case: str, impl: str, err: BaseException) -> SystemExit:
    """The error ending a run whose kvtvm column could not run (a peer's failure is only a
    note; kvtvm's own is the benchmark failing)."""
    return SystemExit(f"{case}: {impl} failed: {type(err).__name__}: {str(err)[:300]}")


def stored_values(cache, storage: str, head_dim: int):
    """float32 CPU values ``[..., head_dim]`` of a cache side (or some of its pages) stored as
    ``storage`` (an 8-bit type, as :func:`kvtvm.bench.quant_cases.cache_as` makes it, or
    ``""`` / a float type)."""
    import torch

    from ..quant import QUANT_DTYPES, dequantize_rows

    if storage in QUANT_DTYPES:
        rows = cache.view(torch.int8).cpu().numpy()
        return torch.from_numpy(dequantize_rows(rows, head_dim, storage))
    return cache.float().cpu()


def _sequence_kv(cache, storage, table_row, length, head_dim):
    """``[H, length, D]`` float32 of one sequence's first ``length`` positions (nhd pages)."""
    pages = stored_values(cache[table_row.long().to(cache.device)], storage, head_dim)
    return pages.reshape(-1, pages.shape[-2], head_dim)[:length].transpose(0, 1)


def _compare(case: str, impl: str, got, want, dtype: str) -> None:
    err = (got.float().cpu() - want).abs().max().item()
    bound = REL_TOL[dtype] * want.abs().max().item() + 1e-6
    if not err <= bound:  # (NaN fails too)
        raise SystemExit(f"{case}: {impl} disagrees with float32 attention over the values "
                         f"its cache holds (max error {err:.3g}, allowed {bound:.3g})")


def check_decode(case: str, impl: str, q, k_cache, v_cache, storages, lengths, table, out,
                 scale: float) -> None:
    """Check a decode call's ``out [batch, Hq, D]``: sequence ``b`` attends to its first
    ``lengths[b] + 1`` positions (the current token's row included)."""
    import torch.nn.functional as F

    D = q.shape[-1]
    for b in range(min(CHECK_SEQUENCES, q.shape[0])):
        n = int(lengths[b]) + 1
        k = _sequence_kv(k_cache, storages[0], table[b].cpu(), n, D)
        v = _sequence_kv(v_cache, storages[1], table[b].cpu(), n, D)
        want = F.scaled_dot_product_attention(q[b].float().cpu()[:, None], k, v, scale=scale,
                                              enable_gqa=True)[:, 0]
        _compare(case, impl, out[b], want, str(q.dtype).removeprefix("torch."))


def check_prefill(case: str, impl: str, q, k_cache, v_cache, storages, indptr, lengths,
                  table, out, scale: float) -> None:
    """Check a causal prefill's ``out [rows, Hq, D]``: row ``i`` of sequence ``b`` attends to
    the positions up to ``lengths[b] + i`` (its cached prefix and the new rows before it);
    the last :data:`CHECK_ROWS` rows of a sequence (they see the most keys)."""
    import torch
    import torch.nn.functional as F

    D = q.shape[-1]
    starts = indptr.cpu().tolist()
    for b in range(min(CHECK_SEQUENCES, len(starts) - 1)):
        lo, hi = starts[b], starts[b + 1]
        cached, n = int(lengths[b]), hi - lo
        k = _sequence_kv(k_cache, storages[0], table[b].cpu(), cached + n, D)
        v = _sequence_kv(v_cache, storages[1], table[b].cpu(), cached + n, D)
        first = max(0, n - CHECK_ROWS)
        rows = torch.arange(first, n)
        mask = torch.arange(cached + n)[None, :] <= (cached + rows)[:, None]
        want = F.scaled_dot_product_attention(q[lo + first:hi].float().cpu().transpose(0, 1),
                                              k, v, attn_mask=mask, scale=scale,
                                              enable_gqa=True)
        _compare(case, impl, out[lo + first:hi], want.transpose(0, 1),
                 str(q.dtype).removeprefix("torch."))
