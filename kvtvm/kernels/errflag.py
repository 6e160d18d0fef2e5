"""The error flag every kernel writes when it skips an out-of-range index.

Stdlib only (the ops import it on machines with the TVM runtime alone). Every kernel takes, as
its last argument, an int32 ``[ERR_SLOTS]`` tensor; an entry it cannot honour without touching
memory outside its tensors is skipped and ``err[slot] = 1`` is stored for its kind (a plain
store of one value, so concurrent writers need no atomics). Kernels never clear the flag: the
op that owns it (:mod:`kvtvm.ops.errflag`) reads it after the launch (CPU) or at the next
check (CUDA), raises a typed error naming the argument, and zeroes it.

Skip semantics (the same in the definitions, the hand-written schedules and the numpy
references):

- ``ERR_PAGE``: a page (or copy row) index outside ``[0, num_pages)``: that row is not
  written (append, copy) or that KV position is left out of the softmax (attention).
- ``ERR_POSITION``: a sequence whose ``cache_lengths`` is negative or whose final length passes
  its lookup-table row's capacity (``max_pages * page_size``): the sequence is skipped (its
  rows are not appended; its attention rows are left unspecified).
- ``ERR_INDPTR``: a row outside ``[qo_indptr[b], qo_indptr[b + 1])`` of the sequence the
  binary search assigns it (``qo_indptr`` not starting at 0, decreasing, or not ending at the
  row count): that row is skipped.
"""

from __future__ import annotations

ERR_PAGE = 0
ERR_POSITION = 1
ERR_INDPTR = 2
#: int32 entries of the flag (one spare).
ERR_SLOTS = 4

#: slot -> (argument, what was out of range), for the typed error.
ERR_MEANING = {
    ERR_PAGE: ("lookup_table (a copy: src / dst)", "a page index outside [0, num_pages) (or "
               "a copy index outside the rows of the tensor)"),
    ERR_POSITION: ("cache_lengths", "a negative length or a sequence longer than its "
                   "lookup_table row's capacity (max_pages * page_size)"),
    ERR_INDPTR: ("qo_indptr", "row offsets not running from 0 to num_tokens without "
                 "decreasing"),
}
