"""What ``python -m kvtvm build`` and ``KernelSpec`` refuse before building anything, and what a
runtime-only process says when a kernel is missing (found by a helper fuzzing the AOT path):
a CUDA decode whose GQA group fits no thread layout was built halfway (the other specs built,
then FAILED, exit 1); a head_dim past int32 reached TVMScript; numpy knob values slipped past
the explicit-knob range check and named other files than the equal ints; a missing kernel's
error named the kernel that was there."""

import os

import numpy as np
import pytest
from helpers import run_python

from kvtvm import cli, compiler
from kvtvm.errors import InvalidArgumentError


def _build(tmp_path, capsys, *args):
    out = tmp_path / "kernels"
    rc = cli.main(["build", "--out", str(out), "--no-progress", *args])
    return rc, capsys.readouterr().err, out


@pytest.mark.parametrize("args,option", [
    (["--target", "cuda", "--arch", "sm_90a", "--ops", "decode", "--dtypes", "float16",
      "--head-dims", "80", "--kv-heads", "1", "--group-sizes", "4,9"],
     "--head-dims / --group-sizes: head_dim / group_size"),
    (["--target", "cuda", "--arch", "sm_80", "--ops", "decode", "--dtypes", "float32",
      "--head-dims", "80", "--kv-heads", "1", "--group-sizes", "4,9", "--cache-dtypes",
      "int8"], "head_split=9 for head_dim 80"),
    (["--target", "llvm", "--ops", "copy", "--dtypes", "float32", "--head-dims",
      "99999999999999999999"], "--head-dims: head_dim: expected a positive int below 2**31"),
    (["--target", "llvm", "--ops", "decode", "--dtypes", "float32", "--head-dims", "16",
      "--kv-heads", str(1 << 31)], "--kv-heads: n_kv_heads"),
])
def test_build_refuses_specs_it_cannot_build_before_building_any(tmp_path, capsys, args,
                                                                 option):
    rc, err, out = _build(tmp_path, capsys, *args)
    assert rc == 2 and option in err, err
    assert not out.exists()  # nothing half-written


def test_knob_values_are_plain_ints_bools_or_strs():
    base = dict(op="decode", dtype="float32", head_dim=16, n_kv_heads=2, group_size=2)
    plain = compiler.KernelSpec(**base, knobs={"tile_tokens": 16})
    numpy = compiler.KernelSpec(**base, knobs={"tile_tokens": np.int64(16)})
    assert numpy == plain and numpy.file_name() == plain.file_name()
    assert type(dict(numpy.knobs)["tile_tokens"]) is int
    flag = compiler.KernelSpec(**base, knobs={"parallel": np.bool_(True)})
    assert dict(flag.knobs)["parallel"] is True
    assert flag.file_name() == compiler.KernelSpec(**base, knobs={"parallel": 1}).file_name()
    text = compiler.KernelSpec(**base, knobs={"tile_tokens": "16"})
    assert text != plain and text.file_name() != plain.file_name()
    for bad in (16.0, [16], None):
        with pytest.raises(InvalidArgumentError, match="knobs\\['tile_tokens'\\]"):
            compiler.KernelSpec(**base, knobs={"tile_tokens": bad})
    copy = dict(op="copy", dtype="float32", head_dim=16, n_kv_heads=1)
    # a numpy int is range-checked like the int it is (was: skipped, then a TVM crash)
    for value in (np.int64(-4), np.int32(10 ** 6)):
        with pytest.raises(InvalidArgumentError, match="rows_per_task"):
            compiler.resolve_knobs(compiler.KernelSpec(**copy, knobs={"rows_per_task": value}))
    assert compiler.resolve_knobs(compiler.KernelSpec(**base, knobs={"parallel": False}))[
        "parallel"] is False


MISSING = """
from kvtvm import compiler
from kvtvm.errors import CompilerUnavailableError
spec = compiler.KernelSpec(op="copy", dtype="float32", head_dim=8, n_kv_heads=1,
                           knobs={"vector_bytes": 8})
try:
    compiler.get_kernel(spec)
except CompilerUnavailableError as err:
    print("ERROR:", err)
"""


def test_a_missing_kernel_is_named_by_its_file(tmp_path):
    """Runtime only, the default build of a spec present and another build of it (here: other
    knobs) missing: the error names the missing file, not only the uri both share."""
    out = tmp_path / "kernels"
    compiler.build_spec(compiler.KernelSpec(op="copy", dtype="float32", head_dim=8,
                                            n_kv_heads=1), out)
    env = dict(os.environ, TVM_USE_RUNTIME_LIB="1", KVTVM_KERNEL_PATH=str(out),
               KVTVM_CACHE_DIR=str(tmp_path / "empty-cache"))
    said = run_python(MISSING, env=env, timeout=120)
    want = compiler.KernelSpec(op="copy", dtype="float32", head_dim=8, n_kv_heads=1,
                               knobs={"vector_bytes": 8}).file_name()
    assert "ERROR:" in said and want in said, said
