"""GPTModule: it learns, its schedule and param groups are as documented, its checkpoints load with
weights_only, its FLOPs feed ThroughputMonitor, it works with a meta-device GPT, and it trains under DDP.

Single-process fits run in this process (accelerator cpu, devices 1). The DDP fit runs as a subprocess
with a clean environment: a multi-device Trainer.fit inside pytest would re-launch pytest itself.
"""

from __future__ import annotations

import itertools
import json
import math
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from lightning.pytorch import Callback, Trainer
from lightning.pytorch.callbacks import ThroughputMonitor
from lightning.pytorch.loggers import Logger

from megascale.core import GPT, GPTConfig, flops_per_token
from megascale.core.optim import LAMB
from megascale.lightning import GPTModule, TokenDataModule
from megascale.lightning.module import batch_size_fn, length_fn, split_batch, warmup_cosine

ROOT = Path(__file__).resolve().parents[2]


def _config(**overrides) -> GPTConfig:
    base = {
        "vocab_size": 50,
        "d_model": 32,
        "n_layers": 2,
        "n_heads": 2,
        "max_seq_len": 16,
        "pad_vocab_to_multiple_of": 8,
    }
    return GPTConfig(**{**base, **overrides})


def _data(**overrides) -> TokenDataModule:
    kwargs = {
        "source": "random:50",
        "seq_len": 16,
        "batch_size": 8,
        "max_bytes": 20_000,
        "val_fraction": 0.05,
    }
    return TokenDataModule(**{**kwargs, **overrides})


def _trainer(tmp_path, max_steps, **kwargs) -> Trainer:
    defaults = {
        "accelerator": "cpu",
        "devices": 1,
        "max_steps": max_steps,
        "logger": False,
        "enable_checkpointing": False,
        "enable_progress_bar": False,
        "enable_model_summary": False,
        "num_sanity_val_steps": 0,
        "limit_val_batches": 0,
        "default_root_dir": tmp_path,
    }
    return Trainer(**{**defaults, **kwargs})


class _Losses(Callback):
    def __init__(self) -> None:
        self.losses: list[float] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.losses.append(float(outputs["loss"]))


class _MemoryLogger(Logger):
    def __init__(self) -> None:
        super().__init__()
        self.metrics: list[dict[str, float]] = []

    @property
    def name(self) -> str:
        return "memory"

    @property
    def version(self) -> int:
        return 0

    def log_hyperparams(self, params, *args, **kwargs) -> None:
        pass

    def log_metrics(self, metrics, step=None) -> None:
        self.metrics.append(dict(metrics))


@pytest.mark.parametrize("optimizer", ["adamw", "lamb"])
def test_fit_learns_the_synthetic_source(tmp_path, optimizer):
    torch.manual_seed(0)
    lr = 1e-2 if optimizer == "adamw" else 5e-2
    module = GPTModule(_config(), optimizer=optimizer, lr=lr, warmup_steps=5, weight_decay=0.01)
    losses = _Losses()
    trainer = _trainer(tmp_path, 80, callbacks=[losses])
    trainer.fit(module, _data())
    assert isinstance(trainer.optimizers[0], LAMB if optimizer == "lamb" else torch.optim.AdamW)
    first, last = sum(losses.losses[:5]) / 5, sum(losses.losses[-5:]) / 5
    # uniform guessing costs ln 50 = 3.9 nats; each token has 4 possible successors: floor ln 4 = 1.39
    assert first > 3.5 and last < 2.5, (first, last)
    for key in ("train/loss", "train/lr", "train/tokens", "train/grad_norm"):
        assert key in trainer.callback_metrics
    assert trainer.callback_metrics["train/tokens"].item() == 80 * 8 * 16
    # decay_steps=None: the cosine ends at max_steps with min_lr_ratio × lr
    assert trainer.optimizers[0].param_groups[0]["lr"] == pytest.approx(0.1 * lr)


def test_warmup_then_cosine_to_the_minimum():
    module = GPTModule(_config(), lr=1.0, min_lr_ratio=0.1, warmup_steps=4, decay_steps=14)
    module.configure_model()
    config = module.configure_optimizers()
    optimizer, scheduler = config["optimizer"], config["lr_scheduler"]["scheduler"]
    assert config["lr_scheduler"]["interval"] == "step"
    lrs = []
    for _ in range(20):
        lrs.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        scheduler.step()
    assert lrs[:4] == pytest.approx([0.25, 0.5, 0.75, 1.0])  # linear warmup from ~0
    assert lrs[4] == pytest.approx(1.0)  # the peak, then cosine
    assert lrs[9] == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 5 / 10)))  # = 0.55, mid-way
    assert all(a > b for a, b in itertools.pairwise(lrs[4:15]))
    assert lrs[14:] == pytest.approx([0.1] * 6)  # min_lr_ratio × lr from decay_steps on
    assert warmup_cosine(0, warmup_steps=0, decay_steps=10, min_lr_ratio=0.0) == 1.0  # no warmup
    assert all(g["lr"] == pytest.approx(0.1) for g in optimizer.param_groups)


def test_weight_decay_only_on_matrices():
    module = GPTModule(_config(bias=True), weight_decay=0.3, decay_steps=10)
    module.configure_model()
    optimizer = module.configure_optimizers()["optimizer"]
    decay, no_decay = optimizer.param_groups
    assert decay["weight_decay"] == 0.3 and no_decay["weight_decay"] == 0.0
    assert decay["params"] and all(p.ndim >= 2 for p in decay["params"])
    assert no_decay["params"] and all(p.ndim < 2 for p in no_decay["params"])
    grouped = {id(p) for g in optimizer.param_groups for p in g["params"]}
    assert grouped == {id(p) for p in module.parameters()}
    assert any(
        name.endswith("bias") for name, p in module.named_parameters() if id(p) in map(id, no_decay["params"])
    )


def test_lamb_gets_the_module_hyperparameters():
    module = GPTModule(_config(), optimizer="lamb", lr=0.02, betas=(0.8, 0.9), eps=1e-7, decay_steps=10)
    module.configure_model()
    optimizer = module.configure_optimizers()["optimizer"]
    assert isinstance(optimizer, LAMB)
    assert optimizer.defaults["betas"] == (0.8, 0.9) and optimizer.defaults["eps"] == 1e-7
    with pytest.raises(ValueError, match="optimizer='sgd'"):
        GPTModule(_config(), optimizer="sgd")  # type: ignore[arg-type]


def test_checkpoint_loads_with_weights_only_and_rebuilds_the_config(tmp_path):
    torch.manual_seed(0)
    config = _config(sliding_window=8, kernels={"attention": "sdpa"})
    module = GPTModule(config, optimizer="lamb", betas=(0.8, 0.99), decay_steps=50, init_seed=3)
    trainer = _trainer(tmp_path, 2)
    trainer.fit(module, _data())
    path = tmp_path / "model.ckpt"
    trainer.save_checkpoint(path)
    checkpoint = torch.load(path, weights_only=True)  # plain Python types only
    hparams = checkpoint["hyper_parameters"]
    assert hparams["config"] == config.to_dict() and hparams["optimizer"] == "lamb"
    assert hparams["betas"] == (0.8, 0.99) and hparams["init_seed"] == 3
    loaded = GPTModule.load_from_checkpoint(path, weights_only=True)
    assert loaded.config == config and loaded.optimizer_name == "lamb" and loaded.decay_steps == 50
    for (name, p), (_, q) in zip(module.state_dict().items(), loaded.state_dict().items()):
        torch.testing.assert_close(p, q, msg=name)


def test_configure_model_is_idempotent_and_init_seed_decides_the_weights():
    module = GPTModule(_config(), init_seed=5)
    module.configure_model()
    model = module.model
    module.configure_model()
    assert module.model is model
    twin = GPTModule(_config(), init_seed=5)
    twin.configure_model()
    torch.testing.assert_close(module.state_dict(), twin.state_dict())
    with pytest.raises(RuntimeError, match="configure_model"):
        GPTModule(_config()).forward(torch.zeros(1, 4, dtype=torch.long))


def test_meta_device_model_materialises_to_the_direct_build(tmp_path):
    direct = GPTModule(_config(), init_seed=11)
    direct.configure_model()
    module = GPTModule(_config(), init_seed=11)
    with torch.device("meta"):
        module.configure_model()
    assert all(p.is_meta for p in module.parameters())  # nothing allocated
    module.model.to_empty(device="cpu")  # what a strategy does
    module.model.init_weights()  # no seed given: the module's init_seed
    torch.testing.assert_close(module.state_dict(), direct.state_dict())
    trainer = _trainer(tmp_path, 3)
    trainer.fit(module, _data())  # and it trains
    assert torch.isfinite(trainer.callback_metrics["train/loss"])


def test_flops_per_batch_feeds_throughput_monitor(tmp_path):
    torch.manual_seed(0)
    module = GPTModule(_config(), decay_steps=10)
    logger = _MemoryLogger()
    monitor = ThroughputMonitor(batch_size_fn=batch_size_fn, length_fn=length_fn, window_size=3)
    trainer = _trainer(tmp_path, 6, logger=logger, callbacks=[monitor], log_every_n_steps=1)
    trainer.fit(module, _data())
    # per-device FLOPs of one micro-batch (8 × 16 tokens); single device: dp / world = 1
    assert module.flops_per_batch == int(flops_per_token(module.config, 16) * 8 * 16)
    logged = {key: value for metrics in logger.metrics for key, value in metrics.items()}
    assert logged["train/device/flops_per_sec"] > 0
    assert logged["train/device/items_per_sec"] == pytest.approx(16 * logged["train/device/samples_per_sec"])
    assert logged["train/samples"] == 6 * 8 and logged["train/lengths"] == 6 * 8 * 16
    assert "train/device/mfu" not in logged  # no peak FLOPs known for a CPU
    # validation batches count forward FLOPs only
    val = _trainer(tmp_path, 1, limit_val_batches=2)
    val.validate(module, _data())
    assert module.flops_per_batch == int(flops_per_token(module.config, 16) * 8 * 16 / 3)


def test_batches_may_be_dicts_and_generate_extends_a_prompt():
    module = GPTModule(_config(), init_seed=0)
    module.configure_model()
    tokens = torch.randint(0, 50, (2, 9))
    inputs, targets = split_batch({"input_ids": tokens[:, :-1], "labels": tokens[:, 1:]})
    assert batch_size_fn((inputs, targets)) == 2 and length_fn([inputs, targets]) == 16
    torch.testing.assert_close(module(inputs, targets), module.model(tokens[:, :-1], tokens[:, 1:]))
    assert module(inputs).shape == (2, 8, module.config.padded_vocab_size)
    out = module.generate(tokens[:1, :3], 5, temperature=0, top_k=None)
    assert out.shape == (1, 8) and torch.equal(out[:, :3], tokens[:1, :3]) and int(out.max()) < 50
    assert module.model.training  # restored after sampling
    with pytest.raises(TypeError, match="expected a batch"):
        split_batch(tokens)


def test_grad_norm_is_logged(monkeypatch):
    module = GPTModule(_config(), init_seed=0)
    module.configure_model()
    tokens = torch.randint(0, 50, (2, 9))
    module(tokens[:, :-1], tokens[:, 1:]).backward()
    logged = {}
    monkeypatch.setattr(module, "log", lambda name, value, **kw: logged.__setitem__(name, value))
    module.on_before_optimizer_step(torch.optim.SGD(module.parameters(), lr=0.1))
    expected = torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in module.parameters()]))
    torch.testing.assert_close(logged["train/grad_norm"], expected)


def test_meta_gpt_allocates_nothing():
    with torch.device("meta"):
        gpt = GPT(_config(d_model=4096, n_heads=32, n_layers=8, vocab_size=50_000))
    assert all(p.is_meta for p in gpt.parameters())


_DDP_SCRIPT = """
import json, sys
import torch
from lightning.pytorch import Callback, Trainer
from megascale.core import GPTConfig
from megascale.lightning import GPTModule, TokenDataModule

out = sys.argv[1]

class Record(Callback):
    def __init__(self):
        self.rows = []
    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.rows.append({
            "loss": trainer.callback_metrics["train/loss"].item(),
            "local_loss": float(outputs["loss"]),
            "tokens": trainer.callback_metrics["train/tokens"].item(),
            "first": batch[0][:, 0].tolist(),
            "flops": pl_module.flops_per_batch,
        })
    def on_train_end(self, trainer, pl_module):
        rank = trainer.global_rank
        dp = trainer.strategy.distributed_sampler_kwargs["num_replicas"]
        record = {"rows": self.rows, "dp": dp,
                  "sampler": type(trainer.train_dataloader.sampler).__name__,
                  "consumed": trainer.datamodule.state_dict()["consumed_samples"],
                  "val": trainer.callback_metrics["val/loss"].item(),
                  "weight": pl_module.model.embed.weight.sum().item()}
        with open(f"{out}/rank{rank}.json", "w") as f:
            json.dump(record, f)

torch.manual_seed(0)
config = GPTConfig(vocab_size=50, d_model=32, n_layers=2, n_heads=2, max_seq_len=16, pad_vocab_to_multiple_of=8)
trainer = Trainer(accelerator="cpu", devices=2, strategy="ddp", max_steps=4, logger=False,
                  enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                  num_sanity_val_steps=0, val_check_interval=4, limit_val_batches=2, callbacks=[Record()])
trainer.fit(GPTModule(config, lr=1e-2, warmup_steps=2),
            TokenDataModule(source="random:50", seq_len=16, batch_size=4, max_bytes=20_000))
"""


def clean_env() -> dict[str, str]:
    """The environment for a multi-process run: no leftover rendezvous variables, one thread per rank."""
    env = {
        k: v
        for k, v in os.environ.items()
        if k
        not in {
            "MASTER_ADDR",
            "MASTER_PORT",
            "RANK",
            "LOCAL_RANK",
            "WORLD_SIZE",
            "NODE_RANK",
            "LOCAL_WORLD_SIZE",
        }
        and not k.startswith(("PL_", "TORCHELASTIC_"))
    }
    env["OMP_NUM_THREADS"] = "1"
    return env


def test_ddp_two_processes_train_and_log_the_same_loss(tmp_path):
    script = tmp_path / "ddp_fit.py"
    script.write_text(textwrap.dedent(_DDP_SCRIPT))
    result = subprocess.run(
        [sys.executable, str(script), str(tmp_path)],
        env=clean_env(),
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-5000:]
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    assert [r["dp"] for r in ranks] == [2, 2]
    assert ranks[0]["sampler"] == "ResumableDistributedSampler"  # Lightning kept ours, no wrapper
    assert len(ranks[0]["rows"]) == len(ranks[1]["rows"]) == 4
    for a, b in zip(ranks[0]["rows"], ranks[1]["rows"]):
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-6)  # sync_dist: every rank logs the mean
        assert a["loss"] == pytest.approx((a["local_loss"] + b["local_loss"]) / 2, rel=1e-5)
        assert a["first"] != b["first"]  # different micro-batches on the two ranks
        assert a["tokens"] == b["tokens"]
    assert ranks[0]["rows"][-1]["tokens"] == 4 * 4 * 16 * 2  # steps × micro-batch tokens × dp
    assert ranks[0]["val"] == pytest.approx(ranks[1]["val"], rel=1e-6)
    assert ranks[0]["weight"] == pytest.approx(ranks[1]["weight"], rel=1e-6)  # replicas stay identical
    assert ranks[0]["consumed"] == ranks[1]["consumed"] == 4 * 4 * 2
    # per device: one micro-batch of 4 × 16 tokens (dp / world = 1 under DDP)
    assert ranks[0]["rows"][0]["flops"] == int(flops_per_token(_config(), 16) * 4 * 16)
