"""Targets as users have them on disk: every served kind written by transformers' ``save_pretrained``
(per-expert tensors for the MoE kinds, Mixtral's ``block_sparse_moe``, sharded safetensors with an
index), loaded by ``load_target`` and compared with HF: logits, greedy continuations, the expert-union
accounting; the streamed load's dtype, fingerprint and refusals."""

from __future__ import annotations

import json

import pytest
import torch

from eyas.generate import generate
from eyas.target.engine import TargetEngine
from eyas.target.loader import load_target, load_tokenizer
from tests.testing import hf_greedy, ours_from_hf, tiny_hf

KINDS = {
    "llama": lambda: tiny_hf("llama"),
    "mistral": lambda: tiny_hf("mistral", sliding_window=64),  # within its window
    "qwen2": lambda: tiny_hf("qwen2"),
    "qwen3": lambda: tiny_hf("qwen3"),
    "mixtral": lambda: tiny_hf("mixtral"),
    "olmoe": lambda: tiny_hf("olmoe"),
    "qwen2_moe": lambda: tiny_hf("qwen2_moe"),
    "qwen3_moe": lambda: tiny_hf("qwen3_moe"),
}
MOE = ("mixtral", "olmoe", "qwen2_moe", "qwen3_moe")
TOL = 1e-4


def saved(hf, folder, **kwargs):
    hf.save_pretrained(folder, **kwargs)
    load_tokenizer().save_pretrained(folder)
    return folder


def disk_keys(folder) -> list[str]:
    from safetensors import safe_open

    keys = []
    for f in sorted(folder.glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as handle:
            keys += list(handle.keys())
    return keys


def causal(n: int) -> torch.Tensor:
    return torch.ones(n, n, dtype=torch.bool).tril().unsqueeze(0)


def logits(model, ids: torch.Tensor) -> torch.Tensor:  # ids [1, T] -> [1, T, V]
    T = ids.shape[1]
    return model(ids, torch.arange(T)[None], model.allocate_cache(1, T), 0, causal(T), ()).logits


@pytest.fixture(
    scope="module",
    params=[(k, shard) for k in KINDS for shard in (False, True)],
    ids=lambda p: f"{p[0]}{'-sharded' if p[1] else ''}",
)
def loaded(request, tmp_path_factory):
    kind, shard = request.param
    hf = KINDS[kind]()
    folder = saved(hf, tmp_path_factory.mktemp(kind), **({"max_shard_size": "20KB"} if shard else {}))
    return kind, shard, hf, folder, load_target(folder)


def test_the_disk_layout_is_what_users_get(loaded):
    """The MoE kinds are written one tensor per expert (Mixtral under block_sparse_moe), the sharded
    ones with an index: the layouts Eyas's loader refused before."""
    kind, shard, _, folder, _ = loaded
    keys = disk_keys(folder)
    if kind == "mixtral":
        assert "model.layers.0.block_sparse_moe.experts.0.w1.weight" in keys
    elif kind in MOE:
        assert "model.layers.0.mlp.experts.0.gate_proj.weight" in keys
    assert not any(k.endswith("gate_up_proj") for k in keys)
    assert (folder / "model.safetensors.index.json").exists() == shard
    if shard:
        assert len(list(folder.glob("*.safetensors"))) > 1


def test_a_saved_checkpoint_scores_and_decodes_as_hf(loaded):
    _, _, hf, _, target = loaded
    ids = torch.randint(0, hf.config.vocab_size, (1, 40), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = hf(ids).logits
    assert (logits(target.model, ids) - ref).abs().max().item() < TOL
    prompt = [3, 17, 5, 42, 8, 1]
    want = hf_greedy(hf, prompt, 16)
    assert generate(TargetEngine(target.model, ()), prompt, max_new_tokens=16).token_ids == want


def test_loaded_weights_equal_the_in_memory_ones_and_so_does_the_fingerprint(loaded):
    """Every parameter equals the one built from HF's in-memory state dict (experts fused in HF's
    order), so the weight digest a drafter binds to does not depend on the layout on disk."""
    _, _, hf, _, target = loaded
    ours = ours_from_hf(hf)
    theirs = dict(target.model.state_dict())
    assert set(theirs) == set(ours.state_dict())
    assert all(torch.equal(theirs[k], v) for k, v in ours.state_dict().items())
    assert target.fingerprint.weight_digest == ours.weight_digest()


def test_the_expert_union_is_counted_on_a_loaded_moe_checkpoint(loaded):
    """The routing a loaded MoE target records (the expert-union accounting's input) is HF's router's:
    each row's top-k experts."""
    kind, _, hf, _, target = loaded
    if kind not in MOE:
        pytest.skip("a dense target routes nothing")
    ids = torch.randint(0, hf.config.vocab_size, (1, 12), generator=torch.Generator().manual_seed(2))
    logits(target.model, ids)
    routing = target.model.expert_routing()
    assert routing and all(r.shape == (12, hf.config.num_experts_per_tok) for r in routing)
    with torch.no_grad():
        out = hf(ids, output_router_logits=True)
    k = hf.config.num_experts_per_tok
    for mine, router in zip(routing, [r for r in out.router_logits if r is not None]):
        want = router.reshape(12, -1).float().softmax(-1).topk(k, -1).indices
        assert torch.equal(mine.sort(-1).values, want.sort(-1).values)


@pytest.mark.parametrize("kind", ["llama", "qwen3_moe"])
def test_a_bfloat16_load_converts_each_tensor_as_it_is_read(tmp_path, kind):
    """At bfloat16 every parameter is bfloat16 (the float32 load's values, rounded), the tied head is
    the embedding, and the fingerprint is the float32 load's."""
    folder = saved(KINDS[kind](), tmp_path / kind)
    full = load_target(folder)
    half = load_target(folder, dtype="bfloat16")
    assert all(p.dtype == torch.bfloat16 for p in half.model.parameters())
    for (name, a), (_, b) in zip(full.model.state_dict().items(), half.model.state_dict().items()):
        assert torch.equal(a.to(torch.bfloat16), b), name
    assert half.fingerprint == full.fingerprint


def test_a_checkpoint_in_the_memory_layout_still_loads(tmp_path):
    """A folder written from HF's in-memory state dict (fused experts) reads as it is."""
    from safetensors.torch import save_file

    hf = tiny_hf("qwen3_moe")
    folder = saved(hf, tmp_path / "disk")
    fused = tmp_path / "fused"
    fused.mkdir()
    for f in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        if (folder / f).exists():
            (fused / f).write_bytes((folder / f).read_bytes())
    save_file({k: v.contiguous() for k, v in hf.state_dict().items()}, str(fused / "model.safetensors"))
    assert "model.layers.0.mlp.experts.gate_up_proj" in disk_keys(fused)
    assert load_target(fused).fingerprint.weight_digest == load_target(folder).fingerprint.weight_digest


def test_a_target_that_does_not_fit_is_refused_before_the_load_naming_both_sizes(tmp_path, monkeypatch):
    import eyas.target.loader as loader

    folder = saved(tiny_hf("llama"), tmp_path / "ckpt")
    monkeypatch.setattr(loader, "available_memory", lambda device: 1000)
    with pytest.raises(
        ValueError,
        match=r"^checkpoint: the target needs 0\.\d+ GB at float32 on cpu, and 0\.00 GB "
        r"is free there",
    ):
        load_target(folder)


def test_a_missing_shard_is_named(tmp_path):
    folder = saved(tiny_hf("qwen2_moe"), tmp_path / "ckpt", max_shard_size="20KB")
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    gone = sorted(set(index["weight_map"].values()))[-1]
    (folder / gone).unlink()
    with pytest.raises(
        ValueError, match=f"checkpoint: shard '{gone}' named in model.safetensors.index.json is missing"
    ):
        load_target(folder)
