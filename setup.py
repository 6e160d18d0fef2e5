"""kvtvm: a KV-cache library for LLM inference, with ahead-of-time TVM kernels."""

from setuptools import find_packages, setup

setup(
    name="kvtvm",
    version="0.1.0",
    description="KV-cache managers and ahead-of-time compiled TVM kernels for LLM inference",
    python_requires=">=3.10",
    packages=find_packages(include=["kvtvm", "kvtvm.*"]) + ["kvtvm.schedules",
                                                            "kvtvm.tuning_logs"],
    # schedules/ and tuning_logs/ live at the top of the repository, installed inside kvtvm
    package_dir={"kvtvm.schedules": "schedules", "kvtvm.tuning_logs": "tuning_logs"},
    package_data={"kvtvm.tuning_logs": ["*/*.json"]},
    install_requires=[
        "apache-tvm==0.27.0.post1",
        "numpy",
        "ml_dtypes",
        "torch==2.13.0",
    ],
    extras_require={"test": ["pytest", "hypothesis"], "llama": ["transformers"]},
    entry_points={"console_scripts": ["kvtvm=kvtvm.cli:main"]},
)
