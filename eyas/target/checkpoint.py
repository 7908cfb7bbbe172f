"""A checkpoint folder's tensors under the names transformers gives them in memory, read one at a time.

Terms:

- *disk layout*: the names and shapes ``save_pretrained`` writes and published checkpoints hold. For
  the MoE kinds that is one tensor per expert (``mlp.experts.N.gate_proj.weight``; Mixtral's
  ``block_sparse_moe.experts.N.w1.weight``), possibly split over shards listed in
  ``model.safetensors.index.json``.
- *memory layout*: what a transformers model holds after loading: the experts of a layer fused
  (``mlp.experts.gate_up_proj`` [E, 2f, d], ``mlp.experts.down_proj`` [E, d, f]), Mixtral's
  ``block_sparse_moe`` renamed ``mlp``. :meth:`TargetModel.hf_parameter_sources` reads this layout.

transformers declares the way from one to the other per model kind (its checkpoint conversion
mapping: ``WeightRenaming``s, then at most one ``WeightConverter`` whose operations merge and
concatenate the experts); :class:`CheckpointTensors` applies that mapping, key by key, with
transformers' own ``rename_source_key``, key order (``dot_natural_key``) and operations, so a kind
transformers learns to convert is converted here the same way. A checkpoint already in the memory
layout (written from a state dict) matches no converter and reads as it is.

Nothing is read until a tensor is asked for, and then only the tensors it is made of: a loader holds
one layer's experts at a time, never the whole state dict.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Mapping
from pathlib import Path

import torch

INDEX_FILE = "model.safetensors.index.json"


def _conversions(model_type: str) -> tuple[list, list]:
    """(renamings, converters) transformers declares for ``model_type`` ([], [] when none)."""
    from transformers.conversion_mapping import get_checkpoint_conversion_mapping
    from transformers.core_model_loading import WeightConverter, WeightRenaming

    mapping = get_checkpoint_conversion_mapping(model_type) or []
    return (
        [t for t in mapping if isinstance(t, WeightRenaming)],
        [t for t in mapping if isinstance(t, WeightConverter)],
    )


class CheckpointTensors(Mapping):
    """The tensors of the HF checkpoint in ``folder`` (safetensors, single or sharded; or
    ``pytorch_model*.bin``), keyed by their memory-layout names (module docstring). Reading a key
    loads and converts only its own source tensors."""

    def __init__(self, folder: str | Path, model_type: str):
        from transformers.core_model_loading import dot_natural_key, rename_source_key

        self.folder = Path(folder)
        self._files = self._locate()  # disk name -> file
        self._eager: dict[str, torch.Tensor] | None = None
        renamings, converters = _conversions(model_type)
        self._plain: dict[str, str] = {}  # memory name -> disk name
        self._merged: dict[
            str, tuple[object, dict[str, list[str]]]
        ] = {}  # memory name -> (converter, pattern -> disk names)
        for disk in sorted(self._files, key=dot_natural_key):
            name, pattern = rename_source_key(disk, renamings, converters)
            if pattern is None:
                self._plain[name] = disk
                continue
            converter = next(c for c in converters if pattern in c.source_patterns)
            self._merged.setdefault(name, (converter, {}))[1].setdefault(pattern, []).append(disk)

    def _locate(self) -> dict[str, str]:
        index = self.folder / INDEX_FILE
        if index.exists():
            weight_map = json.loads(index.read_text()).get("weight_map")
            if not isinstance(weight_map, dict) or not weight_map:
                raise ValueError(f"checkpoint: {index} has no weight_map")
            missing = sorted({f for f in weight_map.values() if not (self.folder / f).exists()})
            if missing:
                raise ValueError(f"checkpoint: shard {missing[0]!r} named in {INDEX_FILE} is missing")
            return dict(weight_map)
        files = sorted(self.folder.glob("*.safetensors"))
        if files:
            from safetensors import safe_open

            out = {}
            for f in files:
                with safe_open(str(f), framework="pt") as handle:
                    out.update({k: f.name for k in handle.keys()})
            return out
        bins = sorted(self.folder.glob("pytorch_model*.bin"))
        if not bins:
            raise FileNotFoundError(f"checkpoint: no *.safetensors or pytorch_model*.bin in {self.folder}")
        out = {}
        for f in bins:  # a pickle cannot be read by name: memory-mapped, so pages load on use
            for k in torch.load(f, map_location="cpu", weights_only=True, mmap=True):
                out[k] = f.name
        return out

    def _read(self, disk: str) -> torch.Tensor:
        return self._read_many([disk])[disk]

    def _read_many(self, names: list[str]) -> dict[str, torch.Tensor]:
        """The disk tensors ``names``, each file opened once and closed after: a file kept open would
        keep every page read from it mapped (resident memory beside the copies made)."""
        by_file: dict[str, list[str]] = {}
        for n in names:
            by_file.setdefault(self._files[n], []).append(n)
        out = {}
        for file, group in by_file.items():
            if file.endswith(".safetensors"):
                from safetensors import safe_open

                # copied out of the file's mapping: a tensor left on it would keep the whole mapping
                # alive, and with it every page read from the file since (resident twice, as a copy
                # where q/k/v or the experts are fused, and as the file's page)
                with safe_open(str(self.folder / file), framework="pt") as handle:
                    out.update({n: handle.get_tensor(n).clone() for n in group})
            else:
                out.update({n: self._read_bin(n) for n in group})
        return out

    def _read_bin(self, disk: str) -> torch.Tensor:
        if self._eager is None:
            self._eager = {}
            for f in sorted({self._files[k] for k in self._files}):
                self._eager.update(torch.load(self.folder / f, map_location="cpu", weights_only=True, mmap=True))
        return self._eager[disk]

    # --- Mapping -----------------------------------------------------------------------------------
    def __getitem__(self, name: str) -> torch.Tensor:
        if name in self._plain:
            return self._read(self._plain[name])
        if name not in self._merged:
            raise KeyError(name)
        converter, by_pattern = self._merged[name]
        read = self._read_many([k for keys in by_pattern.values() for k in keys])
        tensors: dict[str, list[torch.Tensor]] = {p: [read.pop(k) for k in keys] for p, keys in by_pattern.items()}
        for op in converter.operations:  # e.g. MergeModulelist(dim=0), then Concatenate(dim=1)
            tensors = op.convert(
                tensors,
                source_patterns=converter.source_patterns,
                target_patterns=converter.target_patterns,
                full_layer_name=name,
            )
        if len(tensors) != 1:
            raise ValueError(f"checkpoint: converting {name!r} gave {len(tensors)} tensors, expected one")
        return next(iter(tensors.values()))

    def __iter__(self) -> Iterator[str]:
        yield from self._plain
        yield from self._merged

    def __len__(self) -> int:
        return len(self._plain) + len(self._merged)

    def __contains__(self, name: object) -> bool:
        return name in self._plain or name in self._merged

    def disk_names(self, name: str) -> list[str]:
        """The disk tensors ``name`` is made of."""
        if name in self._plain:
            return [self._plain[name]]
        return [k for keys in self._merged[name][1].values() for k in keys]

    def disk_bytes(self) -> int:
        """The checkpoint's size on disk (its tensor files)."""
        return sum((self.folder / f).stat().st_size for f in set(self._files.values()))
