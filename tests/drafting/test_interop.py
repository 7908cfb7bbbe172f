"""The ecosystem's drafter layouts: Eyas's reference-layout drafters compute what the references
compute on the same weights, export then import is bit-exact, and what a format cannot hold is refused.

The references are real packages (test extras): vLLM's ``speculators`` (EAGLE-3), SGLang's trainer
``specforge`` (EAGLE-3, the layout SGLang serves) and SafeAILab's ``eagle-llm`` (EAGLE-1). Their
training-only imports (datasets, cluster transfer) are stubbed where they would pull those in.
"""

from __future__ import annotations

import json
import sys
import types
from pathlib import Path

import pytest
import torch

from eyas.drafting.interop import InteropError, export_drafter, import_drafter, to_reference_names
from eyas.drafting.manifest import load_drafter, manifest_for, save_drafter
from eyas.drafting.model import EYAS_V1, DrafterConfig, drafter_feature_address
from eyas.target.layers import GrowingKV
from eyas.target.loader import TargetFingerprint
from tests.testing import ours_from_hf, tiny_hf

FP = TargetFingerprint("cfg", "weights", "tok")
VOCAB, HIDDEN, LAYERS, DRAFT_VOCAB, T = 96, 32, 8, 40, 7


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    """A tiny 8-layer Llama target (so the default EAGLE-3 taps 2, 4, 5 are distinct), saved as an
    HF folder: the verifier a speculators config names."""
    hf = tiny_hf("llama", vocab=VOCAB, hidden=HIDDEN, layers=LAYERS, seed=5)
    folder = tmp_path_factory.mktemp("verifier")
    hf.save_pretrained(folder)
    return ours_from_hf(hf), folder


def random_drafter(target_model, method: str, layout: str = "reference", seed: int = 0, fc_norm: bool = False):
    """A reference-layout drafter with every weight random (norms too), so no term hides."""
    from eyas.drafting.model import Drafter

    cfg = DrafterConfig.for_target(
        method, target_model.cfg, DRAFT_VOCAB if method == "eagle3" else None, layout=layout, fc_norm=fc_norm
    )
    drafter = Drafter(cfg)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in drafter.named_parameters():
            p.copy_(
                torch.rand(p.shape, generator=gen) + 0.5
                if "norm" in name
                else torch.randn(p.shape, generator=gen) * 0.15
            )
    if method == "eagle3":
        drafter.set_draft_vocab(torch.randperm(VOCAB, generator=gen)[:DRAFT_VOCAB].sort().values)
    return drafter.eval()


def saved(drafter, target_model, folder):
    taps = drafter_feature_address(drafter.cfg, target_model.cfg)
    save_drafter(folder, drafter, manifest_for(drafter.cfg.method, drafter, FP, taps), dtype=torch.float32)
    return folder


def inputs(seed: int = 1, width: int = 3):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(1, T, width * HIDDEN, generator=gen) * 2, torch.randint(0, VOCAB, (1, T), generator=gen)


def eyas_outputs(drafter, target_model, features, ids):
    """Eyas's draft state and logits for one pass over T rows, causal."""
    state = drafter.target_state(features)
    mask = torch.ones(T, T, dtype=torch.bool).tril()[None]
    with torch.no_grad():
        h = drafter(state, target_model.embed(ids), torch.arange(T)[None], GrowingKV(1), 0, mask)
        return h, drafter.logits(h, target_model.lm_head)


def causal_additive(dtype=torch.float32):
    return torch.full((T, T), torch.finfo(dtype).min).triu(1)[None, None]


def import_speculators():
    """speculators' EAGLE-3 model without its training data stack (datasets, openai, hs_connectors)."""
    if "speculators.train" not in sys.modules:
        train = types.ModuleType("speculators.train")
        train.__path__ = []
        data = types.ModuleType("speculators.train.data")
        data.BatchType = dict
        sys.modules.update({"speculators.train": train, "speculators.train.data": data})
    core = pytest.importorskip("speculators.models.eagle3.core")
    return core.Eagle3DraftModel


@pytest.mark.parametrize("fc_norm", [False, True])
def test_eagle3_matches_speculators(target, tmp_path, fc_norm):
    """vLLM's speculators loads the export with no missing or unexpected key and computes the same
    draft logits on the same aux hidden states and tokens (with and without its per-tap ``fc_norm``)."""
    model_ours, verifier = target
    drafter = random_drafter(model_ours, "eagle3", fc_norm=fc_norm)
    out = export_drafter(
        saved(drafter, model_ours, tmp_path / "eyas"), "speculators", tmp_path / "spec", verifier=str(verifier)
    )
    Eagle3DraftModel = import_speculators()
    ref = Eagle3DraftModel.from_pretrained(str(out), dtype=torch.float32).eval()
    assert ref.config.eagle_aux_hidden_state_layer_ids == [2, 4, 5]
    assert ref.config.norm_before_residual is False and ref.d2t is not None and ref.config.fc_norm is fc_norm
    from safetensors.torch import load_file

    exported = load_file(str(out / "model.safetensors"))
    ignorable = set(Eagle3DraftModel._keys_to_ignore_on_load_missing) | set(Eagle3DraftModel._keys_to_ignore_on_save)
    assert set(exported) == set(ref.state_dict()) - (ignorable - {"d2t", "t2d"})
    assert torch.equal(ref.d2t + torch.arange(DRAFT_VOCAB), drafter.d2t)
    features, ids = inputs()
    ref.layers[0].self_attn.config._attn_implementation = "eager"  # a dense additive mask, not flex's block mask
    with torch.no_grad():
        ref.embed_tokens.weight.copy_(model_ours.embed.weight)  # the target's frozen embedding
        aux = (
            features
            if ref.fc_norm is None
            else torch.cat([norm(x) for norm, x in zip(ref.fc_norm, features.chunk(3, dim=-1))], dim=-1)
        )
        x = torch.cat([ref.embed_tokens(ids), ref.fc(aux)], dim=-1)
        positions = torch.arange(T)[None]
        emb = ref.rotary_emb(x, positions)
        h_ref = ref.layers[0](x, attention_mask=causal_additive(), position_ids=positions, position_embeddings=emb)
        logits_ref = ref.lm_head(ref.norm(h_ref))
    h, logits = eyas_outputs(drafter, model_ours, features, ids)
    assert torch.allclose(h, h_ref, atol=1e-5), float((h - h_ref).abs().max())
    assert torch.allclose(logits, logits_ref, atol=1e-4), float((logits - logits_ref).abs().max())


def test_eagle3_matches_specforge(target, tmp_path):
    """SGLang's layout, read by SpecForge's LlamaForCausalLMEagle3: the same keys (the target's
    embedding aside) and the same draft logits."""
    pytest.importorskip("specforge")
    from specforge.modeling.draft.llama3_eagle import LlamaForCausalLMEagle3
    from transformers import LlamaConfig

    model_ours, _ = target
    drafter = random_drafter(model_ours, "eagle3", seed=3)
    out = export_drafter(saved(drafter, model_ours, tmp_path / "eyas"), "sglang", tmp_path / "sgl")
    config = json.loads((out / "config.json").read_text())
    assert config["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [1, 3, 4]  # layer outputs
    ref = LlamaForCausalLMEagle3(LlamaConfig(**config)).eval()
    from safetensors.torch import load_file

    missing, unexpected = ref.load_state_dict(load_file(str(out / "model.safetensors")), strict=False)
    assert missing == ["embed_tokens.weight"] and unexpected == []
    features, ids = inputs(seed=2)
    with torch.no_grad():
        ref.embed_tokens.weight.copy_(model_ours.embed.weight)
        normed = ref(hidden_states=features, inputs_embeds=ref.embed_tokens(ids))  # norm(midlayer(...))
        logits_ref = ref.lm_head(normed)
    _, logits = eyas_outputs(drafter, model_ours, features, ids)
    assert torch.allclose(logits, logits_ref, atol=1e-4), float((logits - logits_ref).abs().max())


def test_eagle1_matches_eagle_llm(target, tmp_path):
    """SafeAILab's EAGLE-1 ``cnets.Model`` loads the export strictly and predicts the same feature
    (and so, through the target's head, the same logits)."""
    cnets = pytest.importorskip("eagle.model.cnets")
    from eagle.model.configs import EConfig

    model_ours, _ = target
    drafter = random_drafter(model_ours, "eagle1", seed=4)
    out = export_drafter(
        saved(drafter, model_ours, tmp_path / "eyas"), "eagle", tmp_path / "eagle", embed=model_ours.embed.weight
    )
    config = json.loads((out / "config.json").read_text())
    econfig = EConfig.from_pretrained(str(out))
    # eagle-llm predates transformers 5, which reads every config's rope as a dict; its cnets takes
    # any dict for rope *scaling*. SafeAILab's base is fixed (10,000) and unscaled: say so.
    econfig.rope_scaling = None
    ref = cnets.Model(econfig, bias=config["bias"]).eval()
    ref.load_state_dict(torch.load(out / "pytorch_model.bin", weights_only=True), strict=True)
    features, ids = inputs(seed=3, width=1)
    with torch.no_grad():
        h_ref = ref(features, ids)
    h, logits = eyas_outputs(drafter, model_ours, features, ids)
    assert torch.allclose(h, h_ref, atol=1e-5), float((h - h_ref).abs().max())
    assert torch.allclose(logits, model_ours.lm_head(h_ref).float(), atol=1e-4)


@pytest.mark.parametrize(
    "method,fmt,fc_norm",
    [
        ("eagle3", "speculators", False),
        ("eagle3", "speculators", True),
        ("eagle3", "sglang", False),
        ("eagle1", "eagle", False),
    ],
)
def test_export_then_import_is_the_identity(target, tmp_path, method, fmt, fc_norm):
    """Every tensor comes back bit for bit (fp16 as Eyas ships them), with the same taps and config."""
    from safetensors.torch import load_file

    model_ours, verifier = target
    drafter = random_drafter(model_ours, method, seed=6, fc_norm=fc_norm)
    src = tmp_path / "eyas"
    save_drafter(src, drafter, manifest_for(method, drafter, FP, drafter_feature_address(drafter.cfg, model_ours.cfg)))
    out = export_drafter(src, fmt, tmp_path / fmt, verifier=str(verifier), embed=model_ours.embed.weight)
    back = import_drafter(out, model_ours.cfg, FP.to_dict(), tmp_path / "back", fmt=fmt)
    original, returned = load_file(str(src / "model.safetensors")), load_file(str(back.folder / "model.safetensors"))
    assert set(original) == set(returned)
    for name, tensor in original.items():
        assert returned[name].dtype == tensor.dtype and torch.equal(returned[name], tensor), name
    loaded, manifest = load_drafter(back.folder, FP, drafter_feature_address(drafter.cfg, model_ours.cfg))
    assert loaded.cfg == drafter.cfg and manifest.recipe["imported_from"] == fmt


def test_export_refuses_what_a_format_cannot_hold(target, tmp_path):
    model_ours, _ = target
    v1 = saved(random_drafter(model_ours, "eagle3", layout=EYAS_V1), model_ours, tmp_path / "v1")
    with pytest.raises(InteropError, match="drafter_config.layout: eyas-v1"):
        export_drafter(v1, "sglang", tmp_path / "x")
    e3 = saved(random_drafter(model_ours, "eagle3"), model_ours, tmp_path / "e3")
    with pytest.raises(InteropError, match="format: eagle is SafeAILab's EAGLE-1"):
        export_drafter(e3, "eagle", tmp_path / "x")
    normed = saved(random_drafter(model_ours, "eagle3", fc_norm=True), model_ours, tmp_path / "fcn")
    with pytest.raises(InteropError, match="drafter_config.fc_norm: SGLang"):
        export_drafter(normed, "sglang", tmp_path / "x")
    with pytest.raises(InteropError, match="format: 'onnx'"):
        export_drafter(e3, "onnx", tmp_path / "x")
    e1 = saved(random_drafter(model_ours, "eagle1"), model_ours, tmp_path / "e1")
    with pytest.raises(InteropError, match="format: speculators holds EAGLE-3"):
        export_drafter(e1, "speculators", tmp_path / "x")
    with pytest.raises(InteropError, match="target: the eagle format holds the target's embedding"):
        export_drafter(e1, "eagle", tmp_path / "x")
    assert not (tmp_path / "x").exists()


@pytest.fixture
def exported_sglang(target, tmp_path):
    model_ours, _ = target
    src = saved(random_drafter(model_ours, "eagle3"), model_ours, tmp_path / "eyas")
    return export_drafter(src, "sglang", tmp_path / "sgl")


@pytest.mark.parametrize(
    "edit,field",
    [
        (lambda c: c.update(hidden_size=64), "config.hidden_size"),
        (lambda c: c.update(vocab_size=97), "config.vocab_size"),
        (
            lambda c: c["eagle_config"].update(eagle_aux_hidden_state_layer_ids=[1, 3, 8]),
            "config.eagle_config.eagle_aux_hidden_state_layer_ids",
        ),
        (lambda c: c.update(num_hidden_layers=2), "config.num_hidden_layers"),
        (lambda c: c.update(architectures=["GPT2LMHeadModel"], bias=None) or c.pop("bias"), "config.architectures"),
    ],
)
def test_import_binds_to_the_target(target, tmp_path, exported_sglang, edit, field):
    """A checkpoint that does not fit the target (hidden size, vocabulary, tapped layers) or that
    Eyas cannot run is refused naming the field, and nothing is written."""
    model_ours, _ = target
    config = json.loads((exported_sglang / "config.json").read_text())
    edit(config)
    (exported_sglang / "config.json").write_text(json.dumps(config))
    with pytest.raises(InteropError, match=field.replace(".", r"\.")):
        import_drafter(exported_sglang, model_ours.cfg, FP.to_dict(), tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_import_refuses_a_bad_tensor_and_an_unsupported_option(target, tmp_path, exported_sglang):
    from safetensors.torch import load_file, save_file

    model_ours, verifier = target
    state = load_file(str(exported_sglang / "model.safetensors"))
    state["d2t"] = torch.zeros_like(state["d2t"])  # every draft id on target id i: offsets collide? no: +i
    state["d2t"][1] = -1  # draft id 1 -> target 0, as draft id 0
    save_file(state, str(exported_sglang / "model.safetensors"))
    with pytest.raises(InteropError, match="checkpoint.d2t"):
        import_drafter(exported_sglang, model_ours.cfg, FP.to_dict(), tmp_path / "out")
    del state["lm_head.weight"]
    save_file(state, str(exported_sglang / "model.safetensors"))
    with pytest.raises(InteropError, match="checkpoint.lm_head.weight: missing"):
        import_drafter(exported_sglang, model_ours.cfg, FP.to_dict(), tmp_path / "out")
    src = saved(random_drafter(model_ours, "eagle3"), model_ours, tmp_path / "eyas2")
    spec = export_drafter(src, "speculators", tmp_path / "spec", verifier=str(verifier))
    config = json.loads((spec / "config.json").read_text())
    del config["norm_before_residual"]  # vLLM reads an absent flag as true
    (spec / "config.json").write_text(json.dumps(config))
    with pytest.raises(InteropError, match="config.norm_before_residual: True is not supported yet"):
        import_drafter(spec, model_ours.cfg, FP.to_dict(), tmp_path / "out")
    assert to_reference_names(DrafterConfig.for_target("eagle1", model_ours.cfg), "eagle")[-2:] == [
        "fc.weight",
        "fc.bias",
    ]


def test_cli_export_names_why_an_eyas_v1_drafter_cannot_go(target, tmp_path, capsys):
    """``eyas export`` exits 2 with one line naming the field; nothing is written."""
    from eyas.cli import main

    model_ours, _ = target
    v1 = saved(random_drafter(model_ours, "eagle3", layout=EYAS_V1), model_ours, tmp_path / "v1")
    assert main(["export", "--drafter", str(v1), "--format", "sglang", "--out", str(tmp_path / "x")]) == 2
    assert capsys.readouterr().err.startswith("error: drafter_config.layout: eyas-v1")
    assert not (tmp_path / "x").exists()


SHIPPED = Path(__file__).resolve().parents[2] / "drafters"
# every shipped drafter and each format that holds its method: EAGLE-3 goes to vLLM speculators and
# SGLang (SpecForge), EAGLE-1 and HASS to SafeAILab's EAGLE (which SGLang also serves)
SHIPPED_EXPORTS = [
    ("smollm2-135m-eagle3", "sglang"),
    ("smollm2-135m-eagle3", "speculators"),
    ("smollm2-135m-eagle1", "eagle"),
    ("smollm2-135m-hass", "eagle"),
]


@pytest.mark.real_model
@pytest.mark.parametrize("name,fmt", SHIPPED_EXPORTS)
def test_every_shipped_drafter_exports_and_comes_back_bit_exact(tmp_path, name, fmt):
    """Each shipped drafter (all in the reference layout) goes out through ``eyas export`` in each
    format of its method and, imported against the real target with ``eyas import``, comes back
    tensor for tensor with the same taps."""
    from safetensors.torch import load_file

    from eyas.cli import main
    from eyas.drafting.manifest import read_manifest

    shipped = SHIPPED / name
    assert read_manifest(shipped).drafter_config["layout"] == "reference"
    assert main(["export", "--drafter", str(shipped), "--format", fmt, "--out", str(tmp_path / fmt)]) == 0
    assert main(["import", "--from", str(tmp_path / fmt), "--format", fmt, "--out", str(tmp_path / "back")]) == 0
    original, returned = (
        load_file(str(shipped / "model.safetensors")),
        load_file(str(tmp_path / "back" / "model.safetensors")),
    )
    assert set(original) == set(returned) and all(torch.equal(original[k], returned[k]) for k in original)


@pytest.mark.real_model
def test_the_default_eagle3_drafter_through_sglang_and_back_drafts_token_for_token_and_tau_for_tau(tmp_path, real_eyas):
    """The done-when of interop: the shipped EAGLE-3 drafter exported to the SGLang format and
    imported back proposes the same trees, so the answers, every round's accepted length and tau
    are the original's (greedy, so the answers are also target-only's)."""
    from eyas.cli import main
    from eyas.protocol.schema import parse_request

    assert (
        main(
            [
                "export",
                "--drafter",
                str(SHIPPED / "smollm2-135m-eagle3"),
                "--format",
                "sglang",
                "--out",
                str(tmp_path / "sgl"),
            ]
        )
        == 0
    )
    assert main(["import", "--from", str(tmp_path / "sgl"), "--out", str(tmp_path / "back")]) == 0
    for prompt in ("Name three planets of the solar system.", "Write a haiku about autumn."):
        fields = dict(prompt=prompt, method="eagle3", max_new_tokens=32)
        original = real_eyas.generate(parse_request(**fields))[1]
        returned = real_eyas.generate(parse_request(**fields, drafter=str(tmp_path / "back")))[1]
        assert returned["token_ids"] == original["token_ids"]
        assert [r["accept_length"] for r in returned["rounds"]] == [r["accept_length"] for r in original["rounds"]]
        assert returned["accept_length_mean"] == original["accept_length_mean"]
