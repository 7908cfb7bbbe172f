"""The ecosystem's drafter layouts: export an Eyas drafter to them, import one of theirs.

Terms:
- *format*: a folder layout another serving or training stack reads (``config.json`` plus weights):
  - ``speculators``: vLLM's ``Eagle3Speculator`` (keys ``layers.0.*``, ``fc``, ``norm``,
    ``lm_head``, ``d2t``, ``t2d``; aux layer ids count the layers *applied*, as Eyas's taps do);
  - ``sglang``: SGLang's ``LlamaForCausalLMEagle3``, which SpecForge trains (keys ``midlayer.*``;
    its ``eagle_aux_hidden_state_layer_ids`` name the layer whose *output* is tapped, one less);
  - ``eagle``: SafeAILab EAGLE-1 (``fc`` with a bias over ``[embedding; feature]``, ``layers.0.*``
    with no input norm, the target's own head; ``embed_tokens`` is saved too, since SafeAILab loads
    its checkpoint strictly). EAGLE-1 and HASS drafters only.
- *d2t*: Eyas keeps the target id of each draft id; the references keep the offset
  ``target_id - draft_id``. The conversion is exact both ways.

A reference EAGLE-3 with ``fc_norm`` (a norm per tap before ``fc``) keeps its norms as
``fc_norm.{i}.weight``, as speculators and SpecForge name them; SGLang's loader has none, so that
export is refused.

Only the ``reference`` layout (``eyas.drafting.model``) can be exported; an ``eyas-v1`` drafter,
or a reference checkpoint using an option Eyas does not implement, is refused with the reason.
Export then import is the identity: tensors are copied, never cast.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch

from eyas.drafting.manifest import MANIFEST_FILE, WEIGHTS_FILE, DrafterManifest, FingerprintSpec, TapSpec, read_manifest
from eyas.drafting.model import EYAS_V1, REFERENCE, SAFEAILAB_ROPE_THETA, DrafterConfig
from eyas.target.config import TargetConfig

FORMATS = ("speculators", "sglang", "eagle")
EAGLE_BIN = "pytorch_model.bin"  # what SafeAILab's EaModel.from_pretrained reads
CONFIG_FILE = "config.json"
# Eyas's name -> the layer's own HF-style name (both references use HF LlamaDecoderLayer names)
_LAYER_KEYS = {
    "layer.attn.wo.weight": "self_attn.o_proj.weight",
    "layer.mlp_norm.weight": "post_attention_layernorm.weight",
    "layer.mlp.w_down.weight": "mlp.down_proj.weight",
}
_EAGLE3_NORMS = {"embed_norm.weight": "input_layernorm.weight", "state_norm.weight": "hidden_norm.weight"}


class InteropError(ValueError):
    """A drafter or checkpoint that a format cannot express, or that does not fit the target."""


@dataclass(frozen=True)
class ImportedDrafter:
    folder: Path
    format: str
    method: str
    taps: tuple[tuple[int, bool], ...]  # (layers_applied, normed) per tap


def _layer_prefix(fmt: str) -> str:
    return {"speculators": "layers.0.", "sglang": "midlayer.", "eagle": "layers.0."}[fmt]


def _read_weights(folder: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    if (folder / WEIGHTS_FILE).exists():
        return load_file(str(folder / WEIGHTS_FILE))
    if (folder / EAGLE_BIN).exists():
        state = torch.load(folder / EAGLE_BIN, map_location="cpu", weights_only=True)
        if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) for v in state.values()):
            raise InteropError(f"checkpoint: {folder / EAGLE_BIN} is not a tensor state dict")
        return state
    raise InteropError(f"from: {folder} has neither {WEIGHTS_FILE} nor {EAGLE_BIN}")


# --- Eyas tensors <-> reference tensors (pure: dicts of tensors in, dicts out) ---------------------
def to_reference(state: dict[str, torch.Tensor], cfg: DrafterConfig, fmt: str) -> dict[str, torch.Tensor]:
    """An Eyas reference-layout state dict in ``fmt``'s names (tensors shared, not copied or cast)."""
    p = _layer_prefix(fmt)
    q_rows, kv_rows = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    q, k, v = state["layer.attn.wqkv.weight"].split([q_rows, kv_rows, kv_rows], dim=0)
    gate, up = state["layer.mlp.w_gate_up.weight"].split(cfg.intermediate_size, dim=0)
    out = {
        p + "self_attn.q_proj.weight": q,
        p + "self_attn.k_proj.weight": k,
        p + "self_attn.v_proj.weight": v,
        p + "mlp.gate_proj.weight": gate,
        p + "mlp.up_proj.weight": up,
    }
    out.update({p + ref: state[ours] for ours, ref in _LAYER_KEYS.items()})
    if cfg.method == "eagle3":
        out.update({p + ref: state[ours] for ours, ref in _EAGLE3_NORMS.items()})
        out["fc.weight"] = state["reduce.weight"]
        out.update({f"fc_norm.{i}.weight": state[f"tap_norms.{i}.weight"] for i in range(cfg.num_taps) if cfg.fc_norm})
        out["norm.weight"] = state["norm.weight"]
        out["lm_head.weight"] = state["head.weight"]
        d2t = state["d2t"]
        out["d2t"] = d2t - torch.arange(d2t.numel(), dtype=d2t.dtype)  # offsets: target_id - draft_id
        out["t2d"] = state["t2d"]
    else:
        out["fc.weight"], out["fc.bias"] = state["fuse.weight"], state["fuse.bias"]
    return {k: t.contiguous() for k, t in out.items()}


def from_reference(tensors: dict[str, torch.Tensor], cfg: DrafterConfig, fmt: str) -> dict[str, torch.Tensor]:
    """The inverse of :func:`to_reference`: ``fmt``'s tensors in Eyas's names. A missing or
    unexpected tensor is an :class:`InteropError` naming it."""
    p = _layer_prefix(fmt)
    expected = set(to_reference_names(cfg, fmt))
    ignored = {"embed_tokens.weight"}  # the target's own embedding, which Eyas never owns
    missing = sorted(expected - set(tensors))
    if missing:
        raise InteropError(f"checkpoint.{missing[0]}: missing (a {fmt} {cfg.method} drafter has it)")
    extra = sorted(set(tensors) - expected - ignored)
    if extra:
        raise InteropError(f"checkpoint.{extra[0]}: not part of a {fmt} {cfg.method} drafter that Eyas can load")
    out = {
        "layer.attn.wqkv.weight": torch.cat([tensors[p + f"self_attn.{n}_proj.weight"] for n in "qkv"]),
        "layer.mlp.w_gate_up.weight": torch.cat(
            [tensors[p + "mlp.gate_proj.weight"], tensors[p + "mlp.up_proj.weight"]]
        ),
    }
    out.update({ours: tensors[p + ref] for ours, ref in _LAYER_KEYS.items()})
    if cfg.method == "eagle3":
        out.update({ours: tensors[p + ref] for ours, ref in _EAGLE3_NORMS.items()})
        out["reduce.weight"] = tensors["fc.weight"]
        out.update(
            {f"tap_norms.{i}.weight": tensors[f"fc_norm.{i}.weight"] for i in range(cfg.num_taps) if cfg.fc_norm}
        )
        out["norm.weight"] = tensors["norm.weight"]
        out["head.weight"] = tensors["lm_head.weight"]
        offsets = tensors["d2t"].to(torch.int64)
        out["d2t"] = offsets + torch.arange(offsets.numel(), dtype=torch.int64)
        out["t2d"] = tensors["t2d"].to(torch.bool)
    else:
        out["fuse.weight"], out["fuse.bias"] = tensors["fc.weight"], tensors["fc.bias"]
    return out


def to_reference_names(cfg: DrafterConfig, fmt: str) -> list[str]:
    """The tensor names a ``fmt`` checkpoint of this drafter holds (``embed_tokens`` aside)."""
    p = _layer_prefix(fmt)
    names = [p + f"self_attn.{n}_proj.weight" for n in "qkvo"]
    names += [p + f"mlp.{n}_proj.weight" for n in ("gate", "up", "down")] + [p + "post_attention_layernorm.weight"]
    if cfg.method == "eagle3":
        norms = [f"fc_norm.{i}.weight" for i in range(cfg.num_taps)] if cfg.fc_norm else []
        return (
            names
            + [p + n for n in _EAGLE3_NORMS.values()]
            + norms
            + ["fc.weight", "norm.weight", "lm_head.weight", "d2t", "t2d"]
        )
    return names + ["fc.weight", "fc.bias"]


# --- configs -----------------------------------------------------------------------------------------
def _llama_fields(cfg: DrafterConfig) -> dict:
    return {
        "model_type": "llama",
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size,
        "num_attention_heads": cfg.num_heads,
        "num_key_value_heads": cfg.num_kv_heads,
        "head_dim": cfg.head_dim,
        "num_hidden_layers": 1,
        "hidden_act": "silu",
        "rms_norm_eps": cfg.rms_norm_eps,
        "rope_theta": cfg.rope_theta,
        "rope_scaling": None,
        "max_position_embeddings": cfg.max_position_embeddings,
        "vocab_size": cfg.target_vocab_size,
        "attention_bias": False,
        "mlp_bias": False,
        "tie_word_embeddings": False,
    }


def _check_exportable(cfg: DrafterConfig, taps: list[TapSpec], fmt: str) -> None:
    if fmt not in FORMATS:
        raise InteropError(f"format: {fmt!r} is not one of {FORMATS}")
    if cfg.layout == EYAS_V1:
        raise InteropError(
            "drafter_config.layout: eyas-v1 (a fuse projection over normed inputs, EAGLE-3 taps "
            f"through the final norm) has no counterpart in {fmt}; retrain in the reference layout"
        )
    if cfg.method == "eagle3" and fmt == "eagle":
        raise InteropError(
            "format: eagle is SafeAILab's EAGLE-1 layout; export an eagle3 drafter as speculators or sglang"
        )
    if cfg.method == "eagle1" and fmt != "eagle":
        raise InteropError(f"format: {fmt} holds EAGLE-3 drafters here; export an EAGLE-1/HASS drafter as eagle")
    if cfg.fc_norm and fmt == "sglang":
        raise InteropError(
            "drafter_config.fc_norm: SGLang's LlamaForCausalLMEagle3 has no per-tap norms before fc "
            "(SpecForge and speculators do); export it as speculators"
        )
    if any(t.normed for t in taps) and cfg.method == "eagle3":
        raise InteropError("feature_address: the references tap un-normed residual streams")
    if cfg.method == "eagle1":
        if cfg.rope_theta != SAFEAILAB_ROPE_THETA:
            raise InteropError(
                f"drafter_config.rope_theta: {cfg.rope_theta}; SafeAILab's EAGLE-1 fixes the "
                f"rotary base at {SAFEAILAB_ROPE_THETA:g}"
            )
        if cfg.head_dim * cfg.num_heads != cfg.hidden_size:
            raise InteropError("drafter_config.head_dim: SafeAILab's EAGLE-1 derives head_dim = hidden / heads")


def reference_config(
    manifest: DrafterManifest, cfg: DrafterConfig, fmt: str, verifier: str, dtype: str, num_speculative_tokens: int
) -> dict:
    """``config.json`` of a ``fmt`` export, every field the reader looks at written explicitly."""
    layers = [t.layers_applied for t in manifest.feature_address]
    base = _llama_fields(cfg)
    if fmt == "speculators":
        return {
            "architectures": ["Eagle3Speculator"],
            "speculators_model_type": "eagle3",
            "speculators_config": {
                "algorithm": "eagle3",
                "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": num_speculative_tokens}],
                "default_proposal_method": "greedy",
                "verifier": {"name_or_path": verifier, "architectures": ["LlamaForCausalLM"]},
            },
            "transformer_layer_config": {**base, "architectures": ["LlamaForCausalLM"], "torch_dtype": dtype},
            "draft_vocab_size": cfg.out_vocab,
            "norm_before_residual": False,
            "norm_before_fc": False,
            "fc_norm": cfg.fc_norm,
            "norm_output": False,
            "target_hidden_size": cfg.hidden_size,
            "eagle_aux_hidden_state_layer_ids": layers,
            "torch_dtype": dtype,
        }
    if fmt == "sglang":
        return {
            **base,
            "architectures": ["LlamaForCausalLMEagle3"],
            "draft_vocab_size": cfg.out_vocab,
            "target_hidden_size": cfg.hidden_size,
            "torch_dtype": dtype,
            # SGLang counts the layer whose output is tapped: layers_applied - 1
            "eagle_config": {"eagle_aux_hidden_state_layer_ids": [k - 1 for k in layers], "use_aux_hidden_state": True},
            "eyas_verifier": verifier,
        }
    # SafeAILab's EConfig reads no rotary fields (its base is fixed); under transformers 5 a rope_theta
    # field would come back as a rope_scaling dict, which its cnets takes for scaling
    base = {k: v for k, v in base.items() if k not in ("rope_theta", "rope_scaling")}
    return {
        **base,
        "architectures": ["LlamaForCausalLM"],
        "bias": True,
        "torch_dtype": dtype,
        "eyas_verifier": verifier,
    }


# --- export and import --------------------------------------------------------------------------------
def export_drafter(
    folder: str | Path, fmt: str, out: str | Path, verifier: str = "smollm2-135m", embed: torch.Tensor | None = None
) -> Path:  # embed: [V, d], the target's (eagle only)
    """Write the Eyas drafter at ``folder`` in ``fmt`` to ``out``; return ``out``."""
    from safetensors.torch import load_file, save_file

    folder, out = Path(folder), Path(out)
    manifest = read_manifest(folder)
    cfg = DrafterConfig(**{"layout": EYAS_V1, **manifest.drafter_config})
    _check_exportable(cfg, manifest.feature_address, fmt)
    state = load_file(str(folder / WEIGHTS_FILE))
    tensors = to_reference(state, cfg, fmt)
    float_dtypes = {t.dtype for t in tensors.values() if t.is_floating_point()}
    dtype = str(next(iter(float_dtypes))).removeprefix("torch.") if len(float_dtypes) == 1 else "float32"
    if fmt == "eagle":
        if embed is None:
            raise InteropError(
                "target: the eagle format holds the target's embedding (SafeAILab loads it strictly); pass the target"
            )
        if tuple(embed.shape) != (cfg.target_vocab_size, cfg.hidden_size):
            raise InteropError(
                f"target: embedding {tuple(embed.shape)} does not fit the drafter's "
                f"{(cfg.target_vocab_size, cfg.hidden_size)}"
            )
        tensors["embed_tokens.weight"] = embed.detach().to(tensors["fc.weight"].dtype).contiguous()
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / WEIGHTS_FILE))
    if fmt == "eagle":
        torch.save(tensors, out / EAGLE_BIN)
    depth = int(manifest.tree_abi.default_tree.get("max_depth", 5))
    (out / CONFIG_FILE).write_text(
        json.dumps(reference_config(manifest, cfg, fmt, verifier, dtype, depth), indent=2) + "\n"
    )
    return out


def detect_format(config: dict) -> str:
    arch = list(config.get("architectures") or [])
    if "Eagle3Speculator" in arch or config.get("speculators_model_type") == "eagle3":
        return "speculators"
    if "LlamaForCausalLMEagle3" in arch:
        return "sglang"
    if arch == ["LlamaForCausalLM"] or "bias" in config:
        return "eagle"
    raise InteropError(
        f"config.architectures: {arch} is none of Eagle3Speculator, LlamaForCausalLMEagle3, "
        "or SafeAILab's EAGLE-1 LlamaForCausalLM"
    )


def _num(config: dict, key: str, where: str, default=None):
    value = config.get(key, default)
    if value is None:
        raise InteropError(f"{where}.{key}: missing")
    return value


def _import_config(config: dict, fmt: str, target: TargetConfig) -> tuple[DrafterConfig, list[int]]:
    """The Eyas DrafterConfig and the tapped layers (layers applied) a reference config describes,
    checked against the target."""
    where = "config"
    layer = config
    if fmt == "speculators":
        layer, where = _num(config, "transformer_layer_config", "config"), "config.transformer_layer_config"
        for key, supported in (("norm_before_residual", False), ("norm_before_fc", False), ("norm_output", False)):
            # vLLM reads an absent norm_before_residual as true
            value = config.get(key, True if key == "norm_before_residual" else False)
            if bool(value) != supported:
                raise InteropError(f"config.{key}: {value} is not supported yet (Eyas implements {supported})")
    method = "eagle1" if fmt == "eagle" else "eagle3"
    if int(_num(layer, "num_hidden_layers", where)) != 1:
        raise InteropError(f"{where}.num_hidden_layers: {layer['num_hidden_layers']}; Eyas drafts with one layer")
    if layer.get("rope_scaling"):
        raise InteropError(f"{where}.rope_scaling: a scaled drafter rope is not supported yet")
    if layer.get("attention_bias") or layer.get("mlp_bias"):
        raise InteropError(f"{where}.attention_bias: biased drafter projections are not supported")
    fc_norm = bool(config.get("fc_norm", False))  # speculators' flag, and SpecForge's config attribute
    hidden = int(_num(layer, "hidden_size", where))
    if hidden != target.hidden_size or int(config.get("target_hidden_size") or hidden) != target.hidden_size:
        raise InteropError(f"{where}.hidden_size: {hidden}, the target's is {target.hidden_size}")
    vocab = int(_num(layer, "vocab_size", where))
    if vocab != target.vocab_size:
        raise InteropError(f"{where}.vocab_size: {vocab}, the target's vocabulary is {target.vocab_size}")
    heads = int(_num(layer, "num_attention_heads", where))
    head_dim = int(layer.get("head_dim") or hidden // heads)
    # SafeAILab's EAGLE-1 ignores any rope_theta field: its rotary base is fixed
    rope_theta = SAFEAILAB_ROPE_THETA if fmt == "eagle" else float(layer.get("rope_theta") or 10000.0)
    if fmt == "eagle":
        draft_vocab, layers = 0, [target.num_layers]
    else:
        draft_vocab = int(config.get("draft_vocab_size") or vocab)
        n = target.num_layers
        if fmt == "speculators":
            layers = config.get("eagle_aux_hidden_state_layer_ids") or [2, n // 2, n - 3]
            field = "config.eagle_aux_hidden_state_layer_ids"
        else:
            ids = (config.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
            layers = [k + 1 for k in ids] if ids else [2, n // 2, n - 3]
            field = "config.eagle_config.eagle_aux_hidden_state_layer_ids"
        if len(layers) != 3 or len(set(layers)) != 3 or not all(0 <= int(k) <= n for k in layers):
            raise InteropError(f"{field}: {layers} does not name 3 distinct layers of the target's {n}")
        layers = [int(k) for k in layers]
    try:
        cfg = DrafterConfig(
            method=method,
            hidden_size=hidden,
            num_heads=heads,
            num_kv_heads=int(layer.get("num_key_value_heads") or heads),
            head_dim=head_dim,
            intermediate_size=int(_num(layer, "intermediate_size", where)),
            rms_norm_eps=float(_num(layer, "rms_norm_eps", where, 1e-6)),
            rope_theta=rope_theta,
            max_position_embeddings=int(_num(layer, "max_position_embeddings", where, 2048)),
            target_vocab_size=vocab,
            num_taps=1 if method == "eagle1" else 3,
            draft_vocab_size=0 if draft_vocab == vocab and method == "eagle1" else draft_vocab,
            layout=REFERENCE,
            fc_norm=fc_norm and method == "eagle3",
        )
    except ValueError as err:
        raise InteropError(str(err).replace("drafter_config", where)) from None
    return cfg, layers


def import_drafter(
    src: str | Path,
    target_cfg: TargetConfig,
    fingerprint: dict,
    out: str | Path,
    fmt: str | None = None,
    method_name: str | None = None,
) -> ImportedDrafter:
    """Read a ``fmt`` checkpoint at ``src`` (detected from its config when ``fmt`` is None), bind it
    to the target (``target_cfg``, ``fingerprint``: hidden size, vocabulary and tapped layers are
    checked) and write an Eyas drafter folder at ``out``."""
    from safetensors.torch import save_file

    from eyas.drafting.manifest import TreeABI
    from eyas.drafting.model import Drafter

    src, out = Path(src), Path(out)
    if not (src / CONFIG_FILE).exists():
        raise InteropError(f"from: {src} has no {CONFIG_FILE}")
    try:
        config = json.loads((src / CONFIG_FILE).read_text())
    except json.JSONDecodeError as err:
        raise InteropError(f"config: {src / CONFIG_FILE} is not JSON ({err.msg})") from None
    found = detect_format(config)
    if fmt is not None and fmt != found:
        if fmt not in FORMATS:
            raise InteropError(f"format: {fmt!r} is not one of {FORMATS}")
        raise InteropError(f"format: {src} holds a {found} checkpoint, not {fmt}")
    fmt = found
    cfg, layers = _import_config(config, fmt, target_cfg)
    state = from_reference(_read_weights(src), cfg, fmt)
    expected = Drafter(cfg).state_dict()
    for name, tensor in expected.items():
        if tuple(state[name].shape) != tuple(tensor.shape):
            raise InteropError(
                f"checkpoint.{name}: shape {tuple(state[name].shape)} != {tuple(tensor.shape)} from its config"
            )
    if cfg.method == "eagle3":
        d2t = state["d2t"]
        if int(d2t.min()) < 0 or int(d2t.max()) >= cfg.target_vocab_size or d2t.unique().numel() != d2t.numel():
            raise InteropError("checkpoint.d2t: offsets that do not map draft ids to distinct target ids")
        t2d = torch.zeros(cfg.target_vocab_size, dtype=torch.bool)
        t2d[d2t] = True
        if not torch.equal(t2d, state["t2d"]):
            raise InteropError("checkpoint.t2d: disagrees with d2t")
    normed = fmt == "eagle"  # EAGLE-1 reads the LM-head input; EAGLE-3 the raw residual streams
    taps = [TapSpec(layers_applied=k, normed=normed) for k in layers]
    manifest = DrafterManifest(
        method=cfg.method,
        target_fingerprint=FingerprintSpec(**fingerprint),
        feature_address=taps,
        drafter_config=cfg.to_dict(),
        tree_abi=TreeABI(),
        recipe={"imported_from": fmt, "source": str(src), "as": method_name or cfg.method},
    )
    out.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in state.items()}, str(out / WEIGHTS_FILE))
    (out / MANIFEST_FILE).write_text(manifest.model_dump_json(indent=2))
    return ImportedDrafter(out, fmt, cfg.method, tuple((t.layers_applied, t.normed) for t in taps))
