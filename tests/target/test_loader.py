"""load_target's argument checks: a bad precision or device is refused, naming the field, before any load."""

from __future__ import annotations

import pytest

from eyas.cache import cache_root
from eyas.target.loader import PRECISIONS, load_target


def test_precisions_are_the_served_ones():
    assert PRECISIONS == ("fp32", "fp16w", "int8", "gguf")


@pytest.mark.parametrize(
    "precision, device, message",
    [
        ("fp16", "cpu", r"^precision: 'fp16' is not one of \('fp32', 'fp16w', 'int8', 'gguf'\)"),
        ("gguf", "cuda", r"^precision: gguf \(Eyas's CPU kernels\) runs on the CPU only, not 'cuda'"),
        ("fp16w", "cuda", r"^precision: fp16w \(fbgemm kernels\) runs on the CPU only, not 'cuda'"),
        ("int8", "cuda:0", r"^precision: int8 \(fbgemm kernels\) runs on the CPU only, not 'cuda:0'"),
    ],
)
def test_a_bad_precision_or_device_is_refused_before_loading(tmp_path, precision, device, message):
    # tmp_path holds no checkpoint: reaching the loader would fail differently
    with pytest.raises(ValueError, match=message):
        load_target(tmp_path, precision, device)


def _tiny_checkpoint(folder, tie: bool):
    """A tiny random Llama saved as an HF folder (safetensors), with the real tokenizer beside it."""
    from eyas.target.loader import load_tokenizer
    from tests.testing import tiny_hf

    tiny_hf("llama", tie=tie, seed=3).save_pretrained(folder)
    load_tokenizer().save_pretrained(folder)
    return folder


@pytest.mark.parametrize("tie", [False, True])
def test_the_target_head_is_the_whole_targets_embedding_and_head(tmp_path, tie):
    """A drafter replica loads only the embedding and LM head (load_target_head); they equal the
    whole target's, as does the fingerprint. The first call finds no cached fingerprint and loads
    the target whole once to make it; the second reads it from the cache file."""
    import torch

    from eyas.target.loader import load_target_head

    folder = _tiny_checkpoint(tmp_path / "ckpt", tie)
    head = load_target_head(folder)
    assert (folder / "eyas_fingerprint.json").exists()
    full = load_target(folder)
    assert head.fingerprint == full.fingerprint == load_target_head(folder).fingerprint
    assert head.cfg == full.model.cfg and head.precision == "fp32"
    assert torch.equal(head.embed.weight, full.model.embed.weight)
    assert torch.equal(head.lm_head.weight, full.model.lm_head.weight)
    assert (head.lm_head.weight.data_ptr() == head.embed.weight.data_ptr()) == tie
    assert not any(p.requires_grad for p in (head.embed.weight, head.lm_head.weight))


def test_the_fp16w_target_head_scores_exactly_as_the_fp16w_target(tmp_path):
    import torch

    from eyas.target.loader import load_target_head

    folder = _tiny_checkpoint(tmp_path / "ckpt", tie=True)
    head, full = load_target_head(folder, "fp16w"), load_target(folder, "fp16w")
    assert not isinstance(head.lm_head, torch.nn.Linear)
    x = torch.randn(5, head.cfg.hidden_size)  # [rows, d]
    assert torch.equal(head.lm_head(x), full.model.lm_head(x))
    assert torch.equal(head.embed.weight, full.model.embed.weight)


def test_the_gguf_target_head_scores_exactly_as_the_gguf_target(tmp_path):
    """An HF checkpoint at gguf: its head quantized to Q8_0 at load, the same blocks both ways."""
    import torch

    from eyas.target.loader import load_target_head
    from eyas.target.quantized import QLinear

    folder = _tiny_checkpoint(tmp_path / "ckpt", tie=True)
    head, full = load_target_head(folder, "gguf"), load_target(folder, "gguf")
    assert isinstance(head.lm_head, QLinear) and isinstance(full.model.lm_head, QLinear)
    x = torch.randn(5, head.cfg.hidden_size)  # [rows, d]
    assert torch.equal(head.lm_head(x), full.model.lm_head(x))
    assert torch.equal(head.embed.weight, full.model.embed.weight)


def test_a_target_head_refuses_int8(tmp_path):
    from eyas.target.loader import load_target_head

    with pytest.raises(ValueError, match=r"^precision: 'int8' is not one of \('fp32', 'fp16w', 'gguf'\)"):
        load_target_head(tmp_path, "int8")


def test_a_drafter_worker_loads_no_decoder_layer(tmp_path, monkeypatch):
    """The drafter deployment's worker reads the target's head only: once the fingerprint is cached
    it never builds the whole target. A drafter trained for another target (the shipped SmolLM2 one)
    is refused for this one; with none shipped, an untrained one drafts through the head."""
    import eyas.runtime
    import eyas.target.loader
    from eyas.actors.drafter_worker import DrafterWorker

    folder = _tiny_checkpoint(tmp_path / "ckpt", tie=False)
    with pytest.raises(ValueError, match=r"^manifest\.target_fingerprint\.config_digest: "):
        DrafterWorker.load(str(folder), ("eagle1",))

    def whole_target(*args, **kwargs):
        raise AssertionError("the drafter worker built the whole target")

    # every whole-target load (load_target, through any module's name for it) builds a TargetModel
    monkeypatch.setattr(eyas.target.loader, "TargetModel", whole_target)
    monkeypatch.setattr(eyas.runtime, "REPO_DRAFTERS", tmp_path / "none-shipped")
    with pytest.warns(UserWarning, match="untrained"):
        worker = DrafterWorker.load(str(folder), ("eagle1", "eagle3"))
    assert worker.vocab_size == 64 and set(worker.engines) == {"eagle1", "eagle3"}
    points = worker.measure_costs(repeats=1)
    assert all(ms > 0 for m in points for _, _, ms in points[m])


def test_replicas_that_start_together_materialize_the_gguf_once(tmp_path, monkeypatch):
    """Four threads (as a Serve app's replicas) ask for the same GGUF's cache folder at once: the
    file lock lets one write it while the others wait, and every one gets the same folder. A stale
    ``.tmpPID`` folder from a crashed writer is removed."""
    import threading
    import time

    import eyas.target.loader as loader

    monkeypatch.setenv("EYAS_CACHE", str(tmp_path / "cache"))
    gguf = tmp_path / "model.gguf"
    gguf.write_bytes(b"not really a gguf")
    writes = []

    def fake_write(_gguf, folder):
        writes.append(folder)
        time.sleep(0.3)
        folder.mkdir()
        (folder / "eyas_target.json").write_text("{}")

    monkeypatch.setattr(loader, "_write_materialized", fake_write)
    first = cache_root() / f"model-{loader._file_digest(gguf)}"
    stale = first.with_name(first.name + ".tmp999999")
    stale.mkdir(parents=True)
    results = []
    threads = [threading.Thread(target=lambda: results.append(loader._materialize_gguf(gguf))) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert results == [first] * 4 and writes == [first]
    assert not stale.exists()
