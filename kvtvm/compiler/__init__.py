"""KernelSpec -> IRModule -> schedule -> build -> exported ``.so``; finding and loading built
kernels (runtime only, or building a missing one once into the cache).

- :mod:`.spec`: :class:`KernelSpec` (the compile key, the file name of the built module, the
  key into ``tuning_logs/``), the target of a device;
- :mod:`.knobs`: schedule defaults < tuning log < variant < ``spec.knobs``;
- :mod:`.build`: lowering, compiling, exporting (needs TVM's compiler);
- :mod:`.nvcc`, :mod:`.fatbin`: CUDA device code compiled ahead of time and embedded;
- :mod:`.manifest`: what each module was built from; :mod:`.cache`: find, check, load.

Imports run one way: compiler -> kernels + schedules; nothing here imports the ops.
"""

from __future__ import annotations

from .build import (_cuda_modules, build_spec, build_specs, check_layout, export_built,
                    export_module, lower, with_runtime_variants)
from .cache import add_kernel_dir, cache_dir, find_built, get_kernel, kernel_dirs, search_key
from .fatbin import (FATBIN_ARCHS, embedded_fatbin, fatbin_architectures, fatbin_archs,
                     replace_cuda_source_with_fatbin)
from .knobs import (default_knobs, knob_space, resolve_knobs, schedule_module,
                    schedule_module_name, schedules_dir, tuned_knobs, tuning_log_path,
                    tuning_logs_dir)
from .manifest import is_fresh, manifest_path, read_manifest, source_digest
from .nvcc import nvcc_fatbin, spill_report
from .spec import (CUDA_ARCHS, KERNEL_FAMILIES, LAYOUTS, KernelSpec, Target, _cpu_key,
                   llvm_mcpu, target_for_device, target_key, tvm_version)

#: Old private names some callers use.
_tvm_version = tvm_version
_schedule_module = schedule_module

__all__ = [
    "CUDA_ARCHS", "FATBIN_ARCHS", "KERNEL_FAMILIES", "LAYOUTS", "KernelSpec", "Target",
    "add_kernel_dir", "build_spec", "build_specs", "cache_dir", "check_layout", "default_knobs",
    "embedded_fatbin", "export_built", "export_module", "fatbin_architectures", "fatbin_archs",
    "find_built", "get_kernel", "is_fresh", "kernel_dirs", "knob_space", "llvm_mcpu", "lower",
    "manifest_path", "nvcc_fatbin", "read_manifest", "replace_cuda_source_with_fatbin",
    "resolve_knobs", "schedule_module", "schedule_module_name", "schedules_dir", "search_key",
    "source_digest", "spill_report", "target_for_device", "target_key", "tuned_knobs",
    "tuning_log_path", "tuning_logs_dir", "tvm_version", "with_runtime_variants",
]
