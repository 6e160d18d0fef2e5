"""kvtvm's small reference serving engine (what ``make demo`` and ``python -m kvtvm generate``
use): how to drive kvtvm's managers, step plans and kernels from a model.

* :class:`Engine` (``core.py``): request queue, admission by free slots / pages, chunked prefill
  mixed with decode, stop tokens, greedy or temperature/top-p sampling, release on finish or
  :meth:`Engine.abort`.
* :class:`ModelRunner` (``runner.py``): a transformers Llama-family forward pass whose attention
  is kvtvm's (``run_step(fetched_inputs, new_tokens) -> logits``): reuse it in your own loop.
* ``caches.py``: the adapter of each manager (paged, continuous, linear).
* ``threads.py``: the one place torch's and kvtvm's thread counts are set.
* ``models.py``: the embedded SmolLM2, a local model directory, or the random toy Llama.
* ``check.py``: token-for-token comparison with transformers' ``generate``.

    from kvtvm.engine import Engine, Request, load_model
    model, tok = load_model("smollm2")
    engine = Engine(model, "paged", max_batch_size=4, max_seq_len=512)
    (req,) = engine.serve([Request(0, tok.encode("Hi"), max_new_tokens=32)])
"""

from .caches import CACHE_CHOICES
from .check import check_against_reference, quantized_reference, reference_tokens
from .core import Engine, Request, ServeStats, sample
from .models import DTYPES, build_toy_model, load_model, smollm2_dir
from .runner import ModelRunner, UnsupportedModelError, check_supported, rotate_half
from .threads import configure_threads

__all__ = ["CACHE_CHOICES", "DTYPES", "Engine", "ModelRunner", "Request", "ServeStats",
           "UnsupportedModelError", "build_toy_model", "check_against_reference",
           "check_supported", "configure_threads", "load_model", "quantized_reference",
           "reference_tokens", "rotate_half", "sample", "smollm2_dir"]
