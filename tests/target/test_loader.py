"""load_target's argument checks: a bad precision or device is refused, naming the field, before any load."""
from __future__ import annotations

import pytest

from eyas.target.loader import PRECISIONS, load_target


def test_precisions_are_the_served_ones():
    assert PRECISIONS == ("fp32", "fp16w", "int8")


@pytest.mark.parametrize("precision, device, message", [
    ("fp16", "cpu", r"^precision: 'fp16' is not one of \('fp32', 'fp16w', 'int8'\)"),
    ("fp16w", "cuda", r"^precision: fp16w \(fbgemm kernels\) runs on the CPU only, not 'cuda'"),
    ("int8", "cuda:0", r"^precision: int8 \(fbgemm kernels\) runs on the CPU only, not 'cuda:0'"),
])
def test_a_bad_precision_or_device_is_refused_before_loading(tmp_path, precision, device, message):
    # tmp_path holds no checkpoint: reaching the loader would fail differently
    with pytest.raises(ValueError, match=message):
        load_target(tmp_path, precision, device)
