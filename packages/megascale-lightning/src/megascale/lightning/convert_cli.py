"""``megascale convert``: a checkpoint → one plain file; Hugging Face in (``--from-hf``) and out (``--to-hf``).

What a newcomer would otherwise trip over, handled here:
- SOURCE may be a directory of checkpoints (``checkpoints/run/``) or ``DIR/last``: the NEWEST complete
  checkpoint in it (a second run writes ``last-v1.ckpt`` next to the first run's ``last.ckpt``). Naming
  ``last.ckpt`` itself converts that one, with a note when a newer ``last-vN.ckpt`` lies beside it.
- The Hugging Face family and token ids travel with the model: ``--from-hf`` stores the source's
  ``model_type``, bos/eos/pad ids and generation_config.json in its file (key ``"hf"``); a checkpoint trained
  from ``model.pretrained: DIR`` finds them in DIR. ``--to-hf`` uses them (``--model-type`` and
  ``--eos-token-id`` ... override), infers the family from the architecture when nothing is stored, and says
  so when it knows no eos id (written as null rather than transformers' class default).
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path
from typing import Any

import torch

from megascale.core import GPTConfig
from megascale.core.cli_errors import UserError
from megascale.core.hf import MODEL_TYPES
from megascale.lightning.checkpoint_io import (
    META_FILE,
    ONE_FILE_FORMAT,
    _read_checkpoint,  # the model's tensors of a checkpoint, optimizer states unread
    _read_one_file,
    is_checkpoint,
)

__all__ = ["main", "newest_checkpoint"]

DESCRIPTION = (
    "Turn a MegaScaleStrategy checkpoint into one plain file for inference: {'config': GPTConfig dict, "
    "'state_dict': weights}, loadable with torch.load(weights_only=True) and "
    "megascale.lightning.checkpoint_io.load_gpt. --from-hf writes that file from a Hugging Face model "
    "directory; --to-hf writes a Hugging Face model directory (config.json, generation_config.json, "
    "safetensors) from that file or a checkpoint (both need pip install 'megascale-core[hf]')."
)


def _parser(examples: str) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="megascale convert",
        description=DESCRIPTION,
        epilog="examples:\n" + examples + "\n",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    direction = parser.add_mutually_exclusive_group()
    direction.add_argument("--from-hf", action="store_true", help="SOURCE is a Hugging Face model directory")
    direction.add_argument(
        "--to-hf", action="store_true", help="OUTPUT is a Hugging Face model directory to write"
    )
    parser.add_argument(
        "source",
        help="a checkpoint (checkpoints/run/last.ckpt), a directory of them or DIR/last (the newest), "
        "a file of --from-hf, or with --from-hf a Hugging Face directory",
    )
    parser.add_argument("output", help="file to write, e.g. model.pt; with --to-hf a directory")
    parser.add_argument(
        "--model-type",
        choices=MODEL_TYPES,
        default=None,
        help="with --to-hf: the family (default: the one stored by --from-hf or model.pretrained, else the "
        "one the architecture implies)",
    )
    parser.add_argument(
        "--max-shard-size",
        default=None,
        help="with --to-hf: bytes per safetensors file, e.g. 2GB (default 5GB)",
    )
    for name in ("bos", "eos", "pad"):
        parser.add_argument(
            f"--{name}-token-id", type=int, default=None, help=f"with --to-hf: the tokenizer's {name} id"
        )
    parser.add_argument("--traceback", action="store_true", help="show the full trace of an error")
    return parser


def _mtime(checkpoint: Path) -> float:
    return (checkpoint / META_FILE).stat().st_mtime  # meta.pt is written last


def newest_checkpoint(path: str | Path) -> Path:
    """The checkpoint ``path`` names: itself (a file, or a complete checkpoint directory), or for a
    directory of checkpoints or ``DIR/last`` the newest complete one in it (``DIR/last``: among
    ``last*.ckpt``)."""
    path = Path(path)
    if path.is_file() or is_checkpoint(path):
        return path
    if path.is_dir():
        found = [p for p in path.iterdir() if is_checkpoint(p)]
        where = f"{path} holds no complete checkpoint (a directory with .metadata and {META_FILE})"
    elif path.name == "last" and path.parent.is_dir():
        found = [p for p in path.parent.glob("last*.ckpt") if is_checkpoint(p)]
        where = f"{path.parent} holds no complete last*.ckpt checkpoint"
    else:
        raise FileNotFoundError(f"{path}: no such file or checkpoint directory")
    if not found:
        raise FileNotFoundError(where)
    return max(found, key=_mtime)


def _note_newer(checkpoint: Path) -> None:
    """A note when a later run's ``NAME-vN.ckpt`` is newer than the ``NAME.ckpt`` named."""
    if not checkpoint.is_dir():
        return
    pattern = re.compile(rf"{re.escape(checkpoint.stem)}-v\d+{re.escape(checkpoint.suffix)}")
    newer = [
        p
        for p in checkpoint.parent.iterdir()
        if pattern.fullmatch(p.name) and is_checkpoint(p) and _mtime(p) > _mtime(checkpoint)
    ]
    if newer:
        latest = max(newer, key=_mtime)
        print(f"note: converting {checkpoint} as named; {latest.name} beside it is newer (a later run): give "
              f"{checkpoint.parent}/ to convert the newest", file=sys.stderr)  # fmt: skip


def _hf_of_checkpoint(checkpoint: Path) -> dict[str, Any] | None:
    """The Hugging Face metadata of the directory a checkpoint was trained from (model.pretrained), if any."""
    from megascale.core.hf import hf_metadata

    meta = torch.load(checkpoint / META_FILE, weights_only=True, map_location="cpu")
    pretrained = meta.get("hyper_parameters", {}).get("pretrained")
    if not pretrained:
        return None
    if not (Path(pretrained) / "config.json").is_file():
        print(f"note: {checkpoint} was trained from {pretrained}, which is not here: its model_type and "
              "token ids are unknown (give --model-type, --eos-token-id)", file=sys.stderr)  # fmt: skip
        return None
    return hf_metadata(pretrained)


def _read(source: Path) -> tuple[dict[str, Any], dict[str, torch.Tensor], dict[str, Any] | None]:
    """(GPTConfig dict, weights, Hugging Face metadata or None) of a one-file model or a checkpoint."""
    if source.is_dir():
        _note_newer(source)
        config, weights = _read_checkpoint(source, "model")
        return config, weights, _hf_of_checkpoint(source)
    saved = _read_one_file(source)
    return saved["config"], saved["state_dict"], saved.get("hf")


def _write_one_file(output: Path, config: dict[str, Any], weights: Any, hf: dict[str, Any] | None) -> None:
    """The format of checkpoint_io.convert_to_torch, plus the Hugging Face metadata when known."""
    output.parent.mkdir(parents=True, exist_ok=True)
    saved = {"config": config, "state_dict": weights, "format": ONE_FILE_FORMAT}
    if hf is not None:
        saved["hf"] = hf
    tmp = output.with_name(output.name + ".tmp")
    torch.save(saved, tmp)
    tmp.replace(output)
    print(f"wrote {output} ({output.stat().st_size / 2**20:.1f} MiB)")


def _to_hf(ns: argparse.Namespace, source: Path) -> None:
    from megascale.core.hf import TOKEN_FIELDS, infer_model_type, save_hf

    config_dict, weights, hf = _read(source)
    hf = hf or {}
    config = GPTConfig(**config_dict)
    if ns.model_type:
        model_type, how = ns.model_type, "as given"
    elif hf.get("model_type"):
        model_type, how = hf["model_type"], "as converted in"
    else:
        model_type, how = infer_model_type(config), "from the architecture"
    token_ids = dict(hf.get("token_ids") or {})
    generation = dict(hf["generation_config"]) if hf.get("generation_config") else None
    for key in TOKEN_FIELDS:
        given = getattr(ns, key)
        if given is not None:
            token_ids[key] = given
            if generation is not None:
                generation[key] = given
    files = save_hf(weights, config, ns.output, model_type, max_shard_size=ns.max_shard_size or "5GB",
                    token_ids=token_ids, generation=generation)  # fmt: skip
    size = sum(f.stat().st_size for f in files)
    ids = ", ".join(f"{k.removesuffix('_token_id')} {token_ids.get(k)}" for k in TOKEN_FIELDS)
    print(
        f"wrote {ns.output}: {model_type} ({how}), {len(files)} files ({size / 2**20:.1f} MiB); token ids: {ids}"
    )
    if token_ids.get("eos_token_id") is None:
        print("note: no eos token id is known, so generate() will not stop at an end of document: give "
              "--eos-token-id (your tokenizer's end-of-text id)", file=sys.stderr)  # fmt: skip


def main(argv: list[str], examples: str = "") -> None:
    """Run ``megascale convert`` on ``argv``."""
    ns = _parser(examples).parse_args(argv)
    to_hf_only = [ns.model_type, ns.max_shard_size, ns.bos_token_id, ns.eos_token_id, ns.pad_token_id]
    if not ns.to_hf and any(v is not None for v in to_hf_only):
        raise UserError("--model-type, --max-shard-size and --*-token-id go with --to-hf")
    if ns.from_hf:
        from megascale.core.hf import HFCheckpoint, gpt_config_from_hf, hf_metadata, load_hf_state_dict

        with HFCheckpoint(ns.source) as checkpoint:
            hf_config = gpt_config_from_hf(checkpoint.config)
        weights = load_hf_state_dict(ns.source, hf_config)
        _write_one_file(Path(ns.output), hf_config.to_dict(), weights, hf_metadata(ns.source))
        return
    source = newest_checkpoint(ns.source)
    if source != Path(ns.source):
        print(f"converting {source} (the newest checkpoint in {ns.source})", file=sys.stderr)
    if ns.to_hf:
        _to_hf(ns, source)
        return
    config, weights, hf = _read(source)
    _write_one_file(Path(ns.output), config, weights, hf)
