"""The tensor codec of the wire contract (docs/architecture.md, "The wire contract").

A tensor crosses a process as the msgpack map

    {"dtype": "int64", "shape": [3, 4], "data": <bytes>}

where ``data`` holds the elements in C order, little-endian, ``numel * itemsize`` bytes. The
protobuf messages of ``eyas.proto`` carry it in ``bytes`` fields.

Decoding trusts nothing: every violation raises ``ValueError`` whose message starts with the
field name the caller passes (``name``), so a server maps it to ``INVALID_ARGUMENT`` unchanged.
"""

from __future__ import annotations

import math
import sys

import msgpack
import torch

# Wire names of the dtypes the codec carries; anything else is rejected on both sides.
DTYPES: dict[str, torch.dtype] = {
    "bool": torch.bool,
    "uint8": torch.uint8,
    "int8": torch.int8,
    "int16": torch.int16,
    "int32": torch.int32,
    "int64": torch.int64,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float32": torch.float32,
    "float64": torch.float64,
}
WIRE_NAMES: dict[torch.dtype, str] = {dtype: name for name, dtype in DTYPES.items()}
KEYS = frozenset(("dtype", "shape", "data"))
MAX_NDIM: int = 8
DEFAULT_MAX_NUMEL: int = 1 << 26  # 64 Mi elements; callers that know a budget pass a tighter one
ANY_DIM = None  # a wildcard entry of an expected shape

if sys.byteorder != "little":  # the wire is little-endian and the codec copies raw bytes
    raise ImportError("eyas.protocol.codec: the tensor wire format needs a little-endian host")


def encode_tensor(t: torch.Tensor) -> bytes:
    """msgpack {"dtype", "shape", "data"} of ``t`` (copied to the CPU, C order)."""
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"tensor: expected a torch.Tensor, got {type(t).__name__}")
    if t.dtype not in WIRE_NAMES:
        raise ValueError(f"tensor: dtype {t.dtype} has no wire name (one of {sorted(DTYPES)})")
    flat = t.detach().to("cpu").contiguous().reshape(-1)  # [numel]
    data = flat.view(torch.uint8).numpy().tobytes() if flat.numel() else b""
    return msgpack.packb({"dtype": WIRE_NAMES[t.dtype], "shape": list(t.shape), "data": data}, use_bin_type=True)


def decode_tensor(
    b: bytes,
    *,
    name: str,
    dtype: torch.dtype | None = None,
    shape: tuple[int | None, ...] | None = None,
    max_numel: int = DEFAULT_MAX_NUMEL,
) -> torch.Tensor:
    """Decode ``b`` into a fresh CPU tensor; raise ``ValueError("<name>: ...")`` if it is malformed.

    ``dtype``: the required dtype, or None for any wire dtype. ``shape``: the required shape,
    ``ANY_DIM`` (None) entries matching any size, or None for any shape. ``max_numel``: the most
    elements accepted, checked from the header before any tensor is built.
    """
    if not isinstance(b, (bytes, bytearray, memoryview)):
        raise ValueError(f"{name}: expected encoded tensor bytes, got {type(b).__name__}")
    if not b:
        raise ValueError(f"{name}: missing (empty bytes, not an encoded tensor)")
    try:
        obj = msgpack.unpackb(bytes(b), raw=False, strict_map_key=True, use_list=True)
    except Exception as err:  # noqa: BLE001 - re-raised named: msgpack raises several types (ExtraData, FormatError, ...)
        raise ValueError(f"{name}: not a msgpack-encoded tensor ({type(err).__name__}: {err})") from None
    if not isinstance(obj, dict) or set(obj) != KEYS:
        keys = sorted(map(str, obj)) if isinstance(obj, dict) else type(obj).__name__
        raise ValueError(f"{name}: expected a map with keys {sorted(KEYS)}, got {keys}")

    wire_dtype, wire_shape, data = obj["dtype"], obj["shape"], obj["data"]
    if not isinstance(wire_dtype, str) or wire_dtype not in DTYPES:
        raise ValueError(f"{name}: unknown dtype {wire_dtype!r}; expected one of {sorted(DTYPES)}")
    got_dtype = DTYPES[wire_dtype]
    if (
        not isinstance(wire_shape, list)
        or len(wire_shape) > MAX_NDIM
        or any(type(d) is not int or d < 0 for d in wire_shape)
    ):
        raise ValueError(f"{name}: shape {wire_shape!r} is not a list of at most {MAX_NDIM} sizes >= 0")
    if not isinstance(data, bytes):
        raise ValueError(f"{name}: data is {type(data).__name__}, expected bytes")

    if dtype is not None and got_dtype != dtype:
        raise ValueError(f"{name}: expected dtype {WIRE_NAMES.get(dtype, dtype)}, got {wire_dtype}")
    if shape is not None and (
        len(shape) != len(wire_shape) or any(e is not ANY_DIM and e != d for e, d in zip(shape, wire_shape))
    ):
        want = tuple("*" if e is ANY_DIM else e for e in shape)
        raise ValueError(f"{name}: expected shape {want}, got {tuple(wire_shape)}")
    numel = math.prod(wire_shape)
    if numel > max_numel:
        raise ValueError(f"{name}: {numel} elements exceed the limit of {max_numel}")
    itemsize = torch.empty((), dtype=got_dtype).element_size()
    if len(data) != numel * itemsize:
        raise ValueError(
            f"{name}: {len(data)} data bytes != {numel} elements x {itemsize} bytes "
            f"of {wire_dtype} for shape {tuple(wire_shape)}"
        )
    if numel == 0:
        return torch.empty(wire_shape, dtype=got_dtype)
    raw = torch.frombuffer(bytearray(data), dtype=torch.uint8)  # [numel * itemsize], owns a copy
    if got_dtype == torch.bool and int(raw.max()) > 1:
        raise ValueError(f"{name}: bool data holds a byte other than 0 or 1")
    return raw.view(got_dtype).reshape(wire_shape)
