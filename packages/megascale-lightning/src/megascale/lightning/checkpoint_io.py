"""Distributed checkpoints: one ``torch.distributed.checkpoint`` (DCP) directory per checkpoint.

Layout of ``path/`` (Lightning names it ``epoch=…-step=….ckpt``, a directory):
    .metadata, __*_*.distcp   DCP: ``state_dict`` (model) and ``optimizer_<i>`` (optimizer states), each
                              rank writing its own shards; keys are parameter names (FQNs), the same in
                              every layout, so a checkpoint saved under tp2×dp2/zero2 loads under dp4,
                              single process, or any other layout (DCP reshards).
    meta.pt                   everything else Lightning keeps (loops, callbacks, LR schedulers, data-module
                              state, hyper-parameters), written by rank 0, read with ``weights_only=True``;
                              with MegaScaleStrategy also the layout that saved it (``LAYOUT_KEY``).

ZeRO-1 (zero1_sharding="elements") holds 1/dp of every parameter's state between steps; a checkpoint gets it
whole, gathered over dp just before the state dict is taken (``ShardedOptimizerStep.gather_state``; also after
fit, for ``trainer.save_checkpoint`` once Lightning tore the strategy down), and cut into pieces again at the
next step. With zero1_sharding="parameters" the state stays on each parameter's
owner: each rank saves the states it owns, and on load asks only for those it owns in the new layout (see
``OptimizerStateSharding.init_owned_state``).

Before anything is read, ``load`` compares every tensor it will load with the checkpoint's metadata: a missing
key or another shape (another model or optimizer, or optimizer state saved in ZeRO-1 pieces by megascale
before states were gathered after fit) is refused on every rank by one message naming the saved layout, this
one and what to change, instead of DCP's error from inside its planner, which names neither layout.

``convert_to_torch`` turns a checkpoint into one plain file for inference (config + model weights) without
loading optimizer states; ``load_gpt`` rebuilds the GPT from it. ``convert_from_hf`` writes that file from a
Hugging Face model directory, ``convert_to_hf`` writes a Hugging Face directory from it or from a checkpoint
(``megascale.core.hf``; needs ``pip install 'megascale-core[hf]'``).
"""

from __future__ import annotations

import io
import shutil
import warnings
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.optim import Optimizer

from megascale.core import GPT, GPTConfig
from megascale.core.parallel.zero.optimizer_state import optimizer_params
from megascale.lightning import one_file_checkpoint
from megascale.lightning.optimizer_state_dict import Keep, keep_states, names_by_param, optimizer_state_dict

__all__ = [
    "LAYOUT_KEY",
    "META_FILE",
    "apply_states",
    "checkpoint_file",
    "convert_from_hf",
    "convert_to_hf",
    "convert_to_torch",
    "is_checkpoint",
    "layout_name",
    "lightning_checkpoint",
    "load",
    "load_gpt",
    "load_one_file",
    "save",
    "save_one_file",
    "states",
]

META_FILE = "meta.pt"
LAYOUT_KEY = "megascale_layout"  # in meta.pt: the layout that saved the checkpoint (``layout_name``)
MODEL_KEY = "state_dict"
# in meta.pt of checkpoints written before saves kept only the states held (2026-12-07): the optimizers that
# had not stepped, whose written (made-up) states are dropped again at load
UNSTEPPED_KEY = "megascale_unstepped_optimizers"
ONE_FILE_FORMAT = "megascale-gpt-v1"


def is_checkpoint(path: str | Path) -> bool:
    """True for a complete megascale checkpoint directory (DCP metadata and Lightning state present)."""
    path = Path(path)
    return (path / ".metadata").is_file() and (path / META_FILE).is_file()


def _states(
    model: nn.Module,
    optimizers: Sequence[Optimizer],
    before_optimizer_state: Callable[[Optimizer], None],
    *,
    template: Callable[[Optimizer], bool] | None = None,
    owned: list[set[str] | None] | None = None,
    owned_only: bool = False,
) -> dict[str, Any]:
    """The model's and optimizers' DCP state dicts: the states held (to save), or with ``template`` one to
    load into, a state for every parameter (made up where there is none); where ``template(optimizer)`` is
    False (a ZeRO-1 rank, holding the states it owns) ``owned`` gets the names of those (else None), and with
    ``owned_only`` the dict holds those alone."""
    state: dict[str, Any] = {MODEL_KEY: get_model_state_dict(model)}
    for i, optimizer in enumerate(optimizers):
        names: set[str] | None = None if template is None or template(optimizer) else set()
        keep: Keep = (
            "held" if template is None else "prepared" if names is not None and owned_only else "every"
        )
        optimizer_state = optimizer_state_dict(
            model, optimizer, _options(True), prepare=before_optimizer_state, keep=keep, prepared_names=names
        )
        if owned is not None:
            owned.append(names)
        state[f"optimizer_{i}"] = optimizer_state
    return state


def _to_load(path: Path, state: dict[str, Any], owned: list[set[str] | None]) -> dict[str, Any]:
    """``state`` less the optimizer states this rank does not load: those of parameters another rank owns
    (``owned``: a ZeRO-1 rank's own, None: all), and those the checkpoint has none of (a parameter that had
    no state in the run that saved it, never stepped, gets none here either, as on one process)."""
    saved = FileSystemReader(path).read_metadata().state_dict_metadata
    out = dict(state)
    for i, names in enumerate(owned):
        key = f"optimizer_{i}"
        out[key] = {
            k: v
            for k, v in state[key].items()
            if not k.startswith("state.")
            or (f"{key}.{k}" in saved and (names is None or _state_name(k) in names))
        }
    return out


def _state_name(key: str) -> str:
    return key.removeprefix("state.").rpartition(".")[0]  # "state.<name>.<key>": <name>


def _forget_unstepped(optimizers: Sequence[Optimizer], meta: dict[str, Any]) -> None:
    for i in meta.pop(UNSTEPPED_KEY, []):
        optimizers[i].state.clear()


def states(
    model: nn.Module,
    optimizers: Sequence[Optimizer],
    before_optimizer_state: Callable[[Optimizer], None] = lambda _: None,
    holds_all_states: Callable[[Optimizer], bool] = lambda _: True,
) -> dict[str, Any]:
    """``{"state_dict": model, "optimizer_<i>": ...}`` as DCP state dicts (parameter-name keys, this rank's
    shards), for a checkpointer that writes them itself; load into them in place, then `apply_states`.
    ``holds_all_states(optimizer)``: False where a rank holds the states of some parameters only (ZeRO-1),
    whose dict then holds those alone."""
    return _states(model, optimizers, before_optimizer_state, template=holds_all_states, owned_only=True)


def apply_states(
    model: nn.Module,
    optimizers: Sequence[Optimizer],
    state: dict[str, Any],
    *,
    strict: bool = True,
    holds_all_states: Callable[[Optimizer], bool] = lambda _: True,
) -> None:
    """Set model and optimizer states from ``state`` (a `states` dict whose tensors were loaded in place). A
    parameter ``state`` has no optimizer state for (none saved: never stepped; a ZeRO-1 rank's others') is
    left without one."""
    set_model_state_dict(model, state[MODEL_KEY], options=_options(strict))
    by_param = names_by_param(model)
    for i, optimizer in enumerate(optimizers):
        given = state[f"optimizer_{i}"]
        options = _options(strict=holds_all_states(optimizer))
        named = {_state_name(k) for k in given if k.startswith("state.")}
        with _without_empty_groups(optimizer):
            if all(
                by_param.get(id(p), set()) & named for p in optimizer_params(optimizer) if p.requires_grad
            ):
                set_optimizer_state_dict(model, optimizer, given, options=options)
                continue
            # torch's set_optimizer_state_dict needs a state for each parameter (it makes them up for an
            # optimizer holding none): those not given are set as made up here, and forgotten right after
            every = optimizer_state_dict(model, optimizer, _options(True), keep="every")
            set_optimizer_state_dict(model, optimizer, {**every, **given}, options=options)
            keep_states(model, optimizer, named)


@contextmanager
def _without_empty_groups(optimizer: Optimizer) -> Iterator[None]:
    """Param groups without parameters (under pp, a group whose parameters all live on other stages) hidden
    from torch's set_optimizer_state_dict, which reads each group's settings from its first parameter's
    (IndexError on an empty one); they keep their own settings, none being saved for them."""
    groups = optimizer.param_groups
    if all(g["params"] for g in groups):
        yield
        return
    optimizer.param_groups = [g for g in groups if g["params"]]
    try:
        yield
    finally:
        loaded = iter(optimizer.param_groups)  # new dicts: load_state_dict replaced them
        optimizer.param_groups = [next(loaded) if g["params"] else g for g in groups]


def save(
    path: str | Path,
    model: nn.Module,
    optimizers: Sequence[Optimizer],
    lightning_state: dict[str, Any],
    *,
    is_global_zero: bool,
    barrier: Callable[[], None],
    before_optimizer_state: Callable[[Optimizer], None] = lambda _: None,
) -> None:
    """Write ``path/`` collectively (every rank calls this). ``lightning_state``: Lightning's checkpoint dict
    without the model and optimizer states."""
    path = Path(path)
    if is_global_zero:
        if path.is_file():
            path.unlink()
        elif path.is_dir() and not is_checkpoint(path) and any(path.iterdir()):
            raise FileExistsError(f"{path} exists and is not a megascale checkpoint: not overwriting it")
        path.mkdir(parents=True, exist_ok=True)
    barrier()
    # (the states held only: an optimizer that has not stepped writes none, as DCP would make them up)
    dcp.save(_states(model, optimizers, before_optimizer_state), checkpoint_id=path)
    if is_global_zero:
        # written last: a directory without meta.pt is an incomplete checkpoint (is_checkpoint is False)
        tmp = path / (META_FILE + ".tmp")
        torch.save(lightning_state, tmp)
        tmp.replace(path / META_FILE)
    barrier()


def load(
    path: str | Path,
    model: nn.Module,
    optimizers: Sequence[Optimizer],
    *,
    strict: bool = True,
    before_optimizer_state: Callable[[Optimizer], None] = lambda _: None,
    holds_all_states: Callable[[Optimizer], bool] = lambda _: True,
    layout: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Load model and optimizer states in place (any layout) and return Lightning's remaining state.

    ``holds_all_states(optimizer)`` is False for a ZeRO-1 optimizer, whose rank loads the states of its own
    parameters only (those must all be in the checkpoint). ``layout``: this run's (as saved under
    ``LAYOUT_KEY``), named with the checkpoint's own when it cannot be loaded.
    """
    path = Path(path)
    if not path.is_dir():
        raise FileNotFoundError(
            f"{path} is not a megascale checkpoint directory (MegaScaleStrategy writes checkpoints as "
            "torch.distributed.checkpoint directories)"
        )
    if not is_checkpoint(path):
        raise ValueError(
            f"{path} is an incomplete checkpoint (no {'.metadata' if not (path / '.metadata').exists() else META_FILE}"
            "): it was probably interrupted while saving; resume from an earlier one"
        )
    meta = torch.load(path / META_FILE, weights_only=True, map_location="cpu")
    owned: list[set[str] | None] = []
    template = _states(model, optimizers, before_optimizer_state, template=holds_all_states, owned=owned)
    if not optimizers:
        template = {MODEL_KEY: template[MODEL_KEY]}
    state = _to_load(path, template, owned)
    _refuse_unloadable(path, state, meta.get(LAYOUT_KEY), layout)
    dcp.load(state, checkpoint_id=path)
    apply_states(model, optimizers, state, strict=strict, holds_all_states=holds_all_states)
    meta.pop(UNSTEPPED_KEY, None)
    return meta


def save_one_file(
    path: str,
    model: nn.Module,
    optimizers: Sequence[Optimizer],
    lightning_state: dict[str, Any],
    *,
    write: Callable[[dict[str, Any], str], None],
    sends_model: bool,
    sends_optimizers: bool,
    is_global_zero: bool,
    barrier: Callable[[], None],
    before_optimizer_state: Callable[[Optimizer], None] = lambda _: None,
) -> None:
    """Write ``path`` as one file in Lightning's form (``one_file_checkpoint``) collectively: gathered onto
    global rank 0, which writes it with ``write(checkpoint, path)`` (a ``CheckpointIO.save_checkpoint``)."""
    whole = one_file_checkpoint.gathered_checkpoint(
        model, optimizers, sends_model=sends_model, sends_optimizers=sends_optimizers,
        before_optimizer_state=before_optimizer_state,
    )  # fmt: skip
    if is_global_zero:
        assert whole is not None
        local = Path(path)
        if "://" not in path and local.is_dir():  # a directory checkpoint of an earlier run under this name
            if not is_checkpoint(local):
                raise IsADirectoryError(
                    f"{path} is a directory and not a megascale checkpoint: not replacing it"
                )
            shutil.rmtree(local)
        write({**lightning_state, **whole}, path)
    barrier()


def load_one_file(
    checkpoint: dict[str, Any],
    model: nn.Module,
    optimizers: Sequence[Optimizer],
    *,
    strict: bool = True,
    before_optimizer_state: Callable[[Optimizer], None] = lambda _: None,
    holds_all_states: Callable[[Optimizer], bool] = lambda _: True,
) -> dict[str, Any]:
    """Load a one-file checkpoint (read on every rank, by ``save_one_file`` or Lightning's ``DDPStrategy``) into
    this layout, and return Lightning's remaining state."""
    one_file_checkpoint.load_into(
        model, optimizers, checkpoint, strict=strict, before_optimizer_state=before_optimizer_state,
        holds_all_states=holds_all_states,
    )  # fmt: skip
    _forget_unstepped(optimizers, checkpoint)
    return checkpoint


def layout_name(layout: dict[str, Any] | None) -> str:
    """``{"dp": 2, "pp": 2, "tp": 1, "zero_stage": 1, "zero1_sharding": "elements", ...}`` as words."""
    if not layout:
        return "an unrecorded layout (saved before megascale recorded layouts, or by another strategy)"
    name = f"dp{layout['dp']} × pp{layout['pp']} × tp{layout['tp']}"
    if layout.get("cp", 1) > 1:  # recorded since context parallelism exists; older checkpoints: cp1
        name = f"dp{layout['dp']} × pp{layout['pp']} × cp{layout['cp']} × tp{layout['tp']}"
    if layout.get("tp", 1) > 1:
        name += " (sequence parallel)" if layout.get("sequence_parallel") else " (no sequence parallelism)"
    if layout["dp"] * layout.get("cp", 1) > 1:  # ZeRO shards over dp × cp: nothing to name at 1
        name += f", ZeRO-{layout['zero_stage']}"
        if layout["zero_stage"] == 1:
            name += f" (zero1_sharding={layout.get('zero1_sharding')!r})"
    return name


def _flat(state: dict[str, Any], prefix: str = "") -> Iterator[tuple[str, Any]]:
    # DCP's keys: nested dict keys joined by "."
    for key, value in state.items():
        if isinstance(value, dict):
            yield from _flat(value, f"{prefix}{key}.")
        else:
            yield f"{prefix}{key}", value


def _problem(path: Path, state: dict[str, Any], saved_layout: dict[str, Any] | None) -> str | None:
    """What in ``state`` (this rank's tensors to load) the checkpoint cannot fill, with what to change."""
    saved = FileSystemReader(path).read_metadata().state_dict_metadata
    for key, value in _flat(state):
        model = key.startswith(MODEL_KEY + ".")
        what = "the model" if model else "the optimizer"
        item = saved.get(key)
        if item is None:
            return (
                f"it has no {key}: {what} differs from the one that saved it; resume with the same "
                f"{'model (configuration)' if model else 'optimizer (class, settings, parameters)'} as that run"
            )
        if not isinstance(value, torch.Tensor):
            continue
        size = getattr(item, "size", None)
        if size is None:
            return f"its {key} is not a tensor: {what} differs from the one that saved it"
        if tuple(size) == tuple(value.shape):
            continue
        found = f"its {key} has shape {tuple(size)}, this run's {tuple(value.shape)}"
        if model:
            return (
                f"{found}: the model differs from the one that saved it (a layout never changes the shapes "
                "saved); build the model of that run"
            )
        zero1_elements = not saved_layout or (
            saved_layout.get("zero_stage") == 1 and saved_layout.get("zero1_sharding") == "elements"
        )
        if zero1_elements and len(size) == 1 and value.dim() > 0:
            return (
                f"{found}: the optimizer states were saved as ZeRO-1 pieces (trainer.save_checkpoint after "
                "fit under zero1_sharding='elements', before megascale gathered them whole there), which no "
                "layout can load; resume from a checkpoint written during fit (ModelCheckpoint), or start a "
                "new fit from its model weights alone"
            )
        return (
            f"{found}: the optimizer keeps state of another shape than the one that saved it; resume with "
            "the same optimizer (class and settings) as that run"
        )
    return None


def _refuse_unloadable(
    path: Path, state: dict[str, Any], saved_layout: dict[str, Any] | None, layout: dict[str, Any] | None
) -> None:
    # Every rank checks its own tensors and all raise together: a rank that went on into dcp.load alone
    # would wait there for the others.
    problem = _problem(path, state, saved_layout)
    if dist.is_available() and dist.is_initialized():
        problems: list[str | None] = [None] * dist.get_world_size()
        dist.all_gather_object(problems, problem)
        problem = next((p for p in problems if p is not None), None)
    if problem is not None:
        this_run = layout_name(layout) if layout else "this run's layout"
        raise ValueError(
            f"cannot resume {path} (saved under {layout_name(saved_layout)}) under {this_run}: {problem}"
        )


def _options(strict: bool) -> Any:
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    # flatten_optimizer_state_dict: param-group settings keyed by parameter name, not one list per rank.
    # Pipeline stages hold different parameters, so their lists differ, and DCP would keep one rank's list
    # for all; per-name keys merge across stages and reshard into any layout, as the states do.
    return StateDictOptions(strict=strict, flatten_optimizer_state_dict=True)


def lightning_checkpoint(path: str | Path) -> dict[str, Any]:
    """A checkpoint directory as Lightning's one-file checkpoint dict, read on this process alone: Lightning's
    entries (hyper-parameters, loops, callbacks) and ``"state_dict"``, every model tensor whole, keyed as the
    LightningModule's ``state_dict()``. Optimizer states are left unread."""
    path = Path(path)
    if not is_checkpoint(path):
        raise FileNotFoundError(f"{path} is not a complete megascale checkpoint directory")
    meta = torch.load(path / META_FILE, weights_only=True, map_location="cpu")
    meta.pop(LAYOUT_KEY, None)
    meta.pop(UNSTEPPED_KEY, None)
    return {**meta, MODEL_KEY: _read_tensors(path, f"{MODEL_KEY}.")}


def _read_tensors(path: Path, prefix: str) -> dict[str, Any]:
    """The whole tensors of checkpoint directory ``path`` whose keys start with ``prefix``, keyed by the rest,
    read on this process alone."""
    reader = FileSystemReader(path)
    state: dict[str, Any] = {
        key: torch.empty(item.size, dtype=item.properties.dtype)
        for key, item in reader.read_metadata().state_dict_metadata.items()
        if key.startswith(prefix) and isinstance(item, TensorStorageMetadata)
    }
    with warnings.catch_warnings():  # one process reading on purpose: DCP says it assumes so
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.load(state, storage_reader=reader, no_dist=True)
    return {key[len(prefix) :]: tensor for key, tensor in state.items()}


def checkpoint_file(path: str | Path) -> io.BytesIO:
    """The checkpoint directory ``path`` as one in-memory checkpoint file, for Lightning's readers:
    ``MyModule.load_from_checkpoint(checkpoint_file(path))`` (``GPTModule`` takes the directory itself)."""
    buffer = io.BytesIO()
    torch.save(lightning_checkpoint(path), buffer)
    buffer.seek(0)
    return buffer


def convert_to_torch(checkpoint: str | Path, output: str | Path, *, module_attribute: str = "model") -> Path:
    """Write ``output``: {"config": GPTConfig as a dict, "state_dict": the GPT's weights as plain tensors}.

    Reads only the model's tensors (not optimizer states), on one process. ``module_attribute`` is the
    attribute of the LightningModule holding the GPT (``GPTModule.model``).
    """
    config, weights = _read_checkpoint(Path(checkpoint), module_attribute)
    return _write_one_file(Path(output), config, weights)


def _read_checkpoint(checkpoint: Path, module_attribute: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """(GPTConfig dict, the GPT's weights) of a checkpoint directory, optimizer states left unread."""
    if not is_checkpoint(checkpoint):
        raise ValueError(f"{checkpoint} is not a complete megascale checkpoint directory")
    prefix = f"{MODEL_KEY}.{module_attribute}."
    weights = _read_tensors(checkpoint, prefix)
    if not weights:
        raise ValueError(f"{checkpoint} holds no tensors under {prefix!r}")
    meta = torch.load(checkpoint / META_FILE, weights_only=True, map_location="cpu")
    config = meta.get("hyper_parameters", {}).get("config")
    if not isinstance(config, dict):
        raise ValueError(f"{checkpoint} has no GPT config in its hyper-parameters (saved by GPTModule?)")
    return config, weights


def _write_one_file(output: Path, config: dict[str, Any], weights: dict[str, Any]) -> Path:
    output.parent.mkdir(parents=True, exist_ok=True)
    tmp = output.with_name(output.name + ".tmp")
    torch.save({"config": config, "state_dict": weights, "format": ONE_FILE_FORMAT}, tmp)
    tmp.replace(output)
    return output


def _read_one_file(path: str | Path, device: torch.device | str = "cpu") -> dict[str, Any]:
    saved = torch.load(path, weights_only=True, map_location=device)
    if not isinstance(saved, dict) or saved.get("format") != ONE_FILE_FORMAT:
        raise ValueError(f"{path} is not a file written by convert_to_torch or convert_from_hf")
    return saved


def load_gpt(path: str | Path, device: torch.device | str = "cpu") -> GPT:
    """The GPT stored by ``convert_to_torch`` or ``convert_from_hf`` (loaded with ``weights_only=True``)."""
    saved = _read_one_file(path, device)
    with torch.device("meta"):
        model = GPT(GPTConfig(**saved["config"]))
    model.load_state_dict(saved["state_dict"], assign=True, strict=True)
    model.rope.to_empty(device=device)
    model.rope.reset_parameters()
    return model


def convert_from_hf(hf_dir: str | Path, output: str | Path) -> Path:
    """Write ``output`` (the format of ``convert_to_torch``, read by ``load_gpt``) from a Hugging Face model
    directory (config.json + safetensors of a llama, qwen2, qwen3 or mistral model)."""
    from megascale.core.hf import HFCheckpoint, gpt_config_from_hf, load_hf_state_dict

    with HFCheckpoint(hf_dir) as checkpoint:
        config = gpt_config_from_hf(checkpoint.config)
    weights = load_hf_state_dict(hf_dir, config)
    return _write_one_file(Path(output), config.to_dict(), weights)


def convert_to_hf(
    source: str | Path,
    hf_dir: str | Path,
    *,
    model_type: str = "llama",
    max_shard_size: int | str = "5GB",
    module_attribute: str = "model",
) -> list[Path]:
    """Write a Hugging Face model directory (config.json + safetensors, loadable by transformers'
    ``AutoModelForCausalLM``) from ``source``: a file of ``convert_to_torch``/``convert_from_hf``, or a
    checkpoint directory (model tensors only are read). Returns the files written."""
    from megascale.core.hf import save_hf

    source = Path(source)
    if source.is_dir():
        config, weights = _read_checkpoint(source, module_attribute)
    else:
        saved = _read_one_file(source)
        config, weights = saved["config"], saved["state_dict"]
    return save_hf(weights, GPTConfig(**config), hf_dir, model_type, max_shard_size=max_shard_size)


def remove(path: str | Path) -> None:
    """Delete a checkpoint: a directory, a file, or a link to either (``ModelCheckpoint(save_last="link")``),
    whose target stays."""
    path = Path(path)
    if path.is_symlink():
        path.unlink()
    elif path.is_dir():
        shutil.rmtree(path)
    elif path.exists():
        path.unlink()
