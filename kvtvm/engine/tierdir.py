"""Whose pages a prefix cache's disk tier directory holds.

The disk tier (:class:`kvtvm.manager.tiers.DiskTier`) keys a page by its tokens and its storage
format: it knows nothing of the model that computed the K/V. Two models with the same cache
geometry (layers, KV heads, head size, dtype) given the same directory would read each other's
pages -- silently wrong tokens. The engine therefore marks the directory with a fingerprint of
its model (:func:`model_fingerprint`) in ``.kvtvm-model-<dtype>`` (the disk tier reads only
``*.kvp`` files) and refuses a directory marked by another model (:func:`claim_tier_dir`).
The same model in another dtype writes its own mark (its pages differ in format, so they miss).
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import torch

from ..compiler.trust import read_json
from ..errors import InvalidArgumentError, describe

__all__ = ["model_fingerprint", "claim_tier_dir"]

#: config fields besides the weights that change a model's K/V
_KV_CONFIG = ("model_type", "hidden_act", "rms_norm_eps", "rope_theta", "rope_parameters",
              "rope_scaling", "sliding_window", "use_sliding_window", "layer_types",
              "no_rope_layers", "head_dim", "attention_bias")


def model_fingerprint(model) -> str:
    """A 128-bit hex fingerprint of ``model`` (a transformers model): the K/V-relevant config
    fields, every weight's name, shape and dtype, and 1024 evenly strided values of each
    (exact bytes; milliseconds even for SmolLM2)."""
    h = hashlib.blake2b(digest_size=16)
    cfg = {k: getattr(model.config, k, None) for k in _KV_CONFIG}
    h.update(json.dumps(cfg, sort_keys=True, default=str).encode())
    for name, w in sorted(model.state_dict().items()):
        flat = w.detach().reshape(-1)
        step = max(1, flat.numel() // 1024)
        sample = flat[::step][:1024].contiguous().cpu()
        h.update(f"{name}:{tuple(w.shape)}:{w.dtype}".encode())
        h.update(sample.view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def claim_tier_dir(directory, model, dtype: str, *, check_only: bool = False) -> None:
    """Refuse (:class:`~kvtvm.errors.InvalidArgumentError` naming ``disk_tier_dir``) a
    directory marked by another model for ``dtype``, a mark without a fingerprint, or pages
    (``*.kvp``) with no model's mark at all (a deleted mark: their model is unknown); unless
    ``check_only``, mark an unmarked one as ``model``'s (written to a temporary file, then
    renamed)."""
    mark = Path(directory) / f".kvtvm-model-{dtype}"
    want = model_fingerprint(model)
    try:
        have = read_json(mark).get("fingerprint")
        if not isinstance(have, str):
            have = f"no fingerprint ({have!r})"
    except (FileNotFoundError, NotADirectoryError):  # no mark yet, or no directory:
        have = None                                   # attach_tiers judges the directory
    except (OSError, ValueError, AttributeError):  # a FIFO, a directory, /dev/zero, too
        have = "unreadable"                         # big, not JSON: never read, or refused
    if have is not None and have != want:
        raise InvalidArgumentError(describe(
            "disk_tier_dir", "a directory of this model's pages (or a new one)",
            f"{directory}, which holds the K/V pages of another model ({mark.name}: "
            f"{have}); give each model its own directory"))
    if have is None and _unmarked_pages(Path(directory)):
        raise InvalidArgumentError(describe(
            "disk_tier_dir", "a directory of this model's pages (or a new one)",
            f"{directory}, which holds K/V pages (*.kvp) but no model's mark "
            f"(.kvtvm-model-*): whose they are is unknown; give this model its own "
            "directory (or empty that one)"))
    if have is None and not check_only:
        name = getattr(model.config, "_name_or_path", "") or type(model).__name__
        tmp = mark.with_name(f".tmp-mark-{os.getpid()}")   # private, as the tier's files
        with os.fdopen(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), "w") as f:
            f.write(json.dumps({"fingerprint": want, "model": name}))
        os.replace(tmp, mark)


def _unmarked_pages(directory: Path) -> bool:
    """Whether ``directory`` holds disk-tier pages but no model's mark in any dtype."""
    try:
        names = [p.name for p in directory.iterdir()]
    except OSError:
        return False
    return any(n.endswith(".kvp") for n in names) \
        and not any(n.startswith(".kvtvm-model-") for n in names)
