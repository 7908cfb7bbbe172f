"""The msgpack tensor codec: round trips and strict rejection naming the field (docs/architecture.md, "The wire contract")."""

from __future__ import annotations

import msgpack
import pytest
import torch

from eyas.protocol.codec import ANY_DIM, DTYPES, decode_tensor, encode_tensor


def bits(t: torch.Tensor) -> torch.Tensor:
    """The raw bytes of ``t`` as a [numel * itemsize] uint8 tensor (bit-level equality)."""
    return t.contiguous().reshape(-1).view(torch.uint8)


def pack(**fields) -> bytes:
    return msgpack.packb(fields, use_bin_type=True)


@pytest.mark.parametrize(
    "dtype",
    [
        torch.int64,
        torch.float32,
        torch.bool,
        torch.float16,
        torch.bfloat16,
        torch.int32,
        torch.uint8,
        torch.int8,
        torch.int16,
        torch.float64,
    ],
)
@pytest.mark.parametrize("shape", [(0,), (5,), (3, 4), (2, 0, 3), ()])
def test_round_trip_is_bit_exact(dtype, shape):
    g = torch.Generator().manual_seed(0)
    if dtype == torch.bool:
        t = torch.rand(shape, generator=g) > 0.5
    elif dtype.is_floating_point:
        t = (torch.randn(shape, generator=g) * 100).to(dtype)
    else:
        t = torch.randint(-100 if dtype != torch.uint8 else 0, 100, shape, generator=g).to(dtype)
    back = decode_tensor(encode_tensor(t), name="x", dtype=dtype, shape=shape)
    assert back.dtype == dtype and tuple(back.shape) == shape
    assert torch.equal(bits(back), bits(t))


def test_special_values_and_layouts_survive():
    t = torch.tensor([float("nan"), float("inf"), -0.0, 1e-45], dtype=torch.float32)
    assert torch.equal(decode_tensor(encode_tensor(t), name="x").view(torch.int32), t.view(torch.int32))
    m = torch.arange(12, dtype=torch.int64).reshape(3, 4)
    assert torch.equal(decode_tensor(encode_tensor(m.t()), name="x"), m.t())  # non-contiguous input
    assert torch.equal(decode_tensor(encode_tensor(m[:, 1]), name="x"), m[:, 1])
    assert decode_tensor(encode_tensor(m), name="x", shape=(ANY_DIM, 4)).shape == (3, 4)


def test_decoded_tensor_owns_its_memory():
    b = encode_tensor(torch.arange(4))
    t = decode_tensor(b, name="x")
    t[0] = 99
    assert decode_tensor(b, name="x")[0] == 0


GOOD = dict(dtype="int64", shape=[2], data=bytes(16))


@pytest.mark.parametrize(
    "blob, kwargs, why",
    [
        (b"", {}, "missing"),
        (b"\xc1garbage", {}, "not a msgpack-encoded tensor"),
        (pack(**GOOD) + b"\x00", {}, "not a msgpack-encoded tensor"),
        (msgpack.packb([1, 2]), {}, "expected a map"),
        (pack(dtype="int64", shape=[2]), {}, "expected a map"),
        (pack(**GOOD, extra=1), {}, "expected a map"),
        (pack(dtype="complex64", shape=[2], data=bytes(16)), {}, "unknown dtype"),
        (pack(dtype=7, shape=[2], data=bytes(16)), {}, "unknown dtype"),
        (pack(dtype="int64", shape=[-2], data=bytes(16)), {}, "shape"),
        (pack(dtype="int64", shape=[True], data=bytes(8)), {}, "shape"),
        (pack(dtype="int64", shape=2, data=bytes(16)), {}, "shape"),
        (pack(dtype="int64", shape=[1] * 9, data=bytes(8)), {}, "shape"),
        (pack(dtype="int64", shape=[2], data="text"), {}, "data is str"),
        (pack(dtype="int64", shape=[2], data=bytes(15)), {}, "15 data bytes"),
        (pack(dtype="int64", shape=[3], data=bytes(16)), {}, "16 data bytes"),
        (pack(**GOOD), {"dtype": torch.int32}, "expected dtype int32, got int64"),
        (pack(**GOOD), {"shape": (3,)}, "expected shape (3,), got (2,)"),
        (pack(**GOOD), {"shape": (2, ANY_DIM)}, "expected shape (2, '*')"),
        (pack(**GOOD), {"max_numel": 1}, "2 elements exceed the limit of 1"),
        (pack(dtype="int64", shape=[1 << 40], data=b""), {}, "exceed the limit"),
        (pack(dtype="bool", shape=[2], data=b"\x01\x02"), {}, "bool data"),
    ],
)
def test_malformed_bytes_are_rejected_naming_the_field(blob, kwargs, why):
    with pytest.raises(ValueError) as err:
        decode_tensor(blob, name="flat.tokens", **kwargs)
    assert str(err.value).startswith("flat.tokens: ") and why in str(err.value)


def test_non_bytes_and_unencodable_inputs():
    with pytest.raises(ValueError, match="^parents: expected encoded tensor bytes"):
        decode_tensor("abc", name="parents")
    with pytest.raises(ValueError, match="^tensor: expected a torch.Tensor"):
        encode_tensor([1, 2])
    with pytest.raises(ValueError, match="^tensor: dtype torch.complex64 has no wire name"):
        encode_tensor(torch.zeros(2, dtype=torch.complex64))
    assert set(DTYPES) >= {"int64", "float32", "bool", "float16", "bfloat16"}
