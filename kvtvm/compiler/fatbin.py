"""Fatbins: which archs a build holds, embedding one in an exported library in place of the
CUDA source (so loading never calls NVRTC or nvcc), and reading it back."""

from __future__ import annotations

import os
import struct
from pathlib import Path

#: Architectures compiled into the fatbin of a spec built for ``arch``.
FATBIN_ARCHS = {"sm_90a": ("sm_80", "sm_90a"), "sm_90": ("sm_80", "sm_90"),
                "sm_80": ("sm_80",), "sm_86": ("sm_80", "sm_86"), "sm_89": ("sm_80", "sm_89")}


def fatbin_archs(arch: str, source: str) -> tuple[str, ...]:
    """Architectures the fatbin of a build for ``arch`` holds: ``FATBIN_ARCHS[arch]``, less
    the older ones when the kernel uses an instruction only ``arch`` has (``wgmma``)."""
    if "wgmma." in source:
        return (arch,)
    return FATBIN_ARCHS[arch]


# The exported library carries its imported modules as one blob, ``__tvm_ffi__library_bin``:
#   u64 size | import tree (vec<u64> row_ptr, vec<u64> child) | per module: str kind [payload]
# where every module but the host ("_lib") is followed by u64 size + payload, and a CUDA
# payload is: str fmt | function-info map | str data. We rewrite fmt "cuda" (source, compiled
# when loaded) to "fatbin" (loaded as is) and data to the fatbin.


def _read_u64(buf: bytes, pos: int) -> tuple[int, int]:
    return struct.unpack_from("<Q", buf, pos)[0], pos + 8


def _read_str(buf: bytes, pos: int) -> tuple[bytes, int]:
    n, pos = _read_u64(buf, pos)
    return buf[pos:pos + n], pos + n


def _pack_str(data: bytes) -> bytes:
    return struct.pack("<Q", len(data)) + data


def replace_cuda_source_with_fatbin(blob: bytes, source: str, fatbin: bytes) -> bytes:
    """Rewrite a packed import blob so its CUDA module holds ``fatbin`` instead of source."""
    size, pos = _read_u64(blob, 0)
    if size != len(blob) - 8:
        raise ValueError("unexpected import blob header")
    start = pos
    for _ in range(2):  # row_ptr, child indices
        n, pos = _read_u64(blob, pos)
        pos += 8 * n
    out = bytearray(blob[start:pos])
    src = source.encode()
    replaced = 0
    while pos < len(blob):
        kind, pos = _read_str(blob, pos)
        out += _pack_str(kind)
        if kind == b"_lib":
            continue
        payload, pos = _read_str(blob, pos)
        if kind == b"cuda":
            fmt, ppos = _read_str(payload, 0)
            if fmt != b"cuda" or not payload.endswith(src):
                raise ValueError(f"CUDA module holds format {fmt!r}, expected CUDA source")
            fmap = payload[ppos:len(payload) - len(src) - 8]
            payload = _pack_str(b"fatbin") + fmap + _pack_str(fatbin)
            replaced += 1
        out += _pack_str(payload)
    if replaced != 1:
        raise ValueError(f"expected one CUDA module in the import blob, found {replaced}")
    return struct.pack("<Q", len(out)) + bytes(out)


def fatbin_packer(source: str, fatbin: bytes):
    """An ``fpack_imports`` for ``export_library`` that embeds ``fatbin`` in place of the
    CUDA ``source``."""
    def pack(mod, is_system_lib, symbol_prefix, workspace_dir):
        import tvm_ffi

        blob = bytes(tvm_ffi.get_global_func("runtime.ModulePackImportsToTensor")(mod).numpy())
        blob = replace_cuda_source_with_fatbin(blob, source, fatbin)
        symbol = f"{symbol_prefix}__tvm_ffi__library_bin"
        path = os.path.join(workspace_dir, "devc.c")
        with open(path, "w") as f:
            f.write('#ifdef __cplusplus\nextern "C" {\n#endif\n')
            f.write(f"extern const unsigned char {symbol}[];\n")
            f.write(f"const unsigned char {symbol}[{len(blob)}] = {{\n")
            for i in range(0, len(blob), 32):
                f.write(",".join(str(b) for b in blob[i:i + 32]) + ",\n")
            f.write("};\n#ifdef __cplusplus\n}\n#endif\n")
        return path

    return pack


def fatbin_architectures(fatbin: bytes) -> list[str]:
    """SASS architectures (e.g. ``["sm_80", "sm_90a"]``) of the ELF entries in a fatbin;
    ValueError when it is not one, or is truncated or damaged."""
    try:
        magic, _, header, size = struct.unpack_from("<IHHQ", fatbin, 0)
        if magic != 0xBA55ED50:
            raise ValueError("not a fatbin")
        archs, pos = [], header
        while pos < header + size:
            kind, _, entry_header, payload = struct.unpack_from("<HHIQ", fatbin, pos)
            arch = struct.unpack_from("<I", fatbin, pos + 28)[0]
            flags = struct.unpack_from("<Q", fatbin, pos + 40)[0]
            if entry_header + payload == 0:  # would read the same entry forever
                raise ValueError(f"damaged fatbin: an empty entry at byte {pos}")
            if kind == 2:  # ELF (SASS); kind 1 is PTX
                archs.append(f"sm_{arch}" + ("a" if flags & 0x100000 else ""))
            pos += entry_header + payload
    except struct.error as err:
        raise ValueError(f"truncated fatbin ({err})") from None
    return archs


def embedded_fatbin(library: str | os.PathLike) -> bytes:
    """The fatbin embedded in a built CUDA module file (for inspection and tests)."""
    data = Path(library).read_bytes()
    start = data.find(struct.pack("<I", 0xBA55ED50))
    if start < 0:
        raise ValueError(f"{library} holds no fatbin")
    _, _, header, size = struct.unpack_from("<IHHQ", data, start)
    return data[start:start + header + size]
