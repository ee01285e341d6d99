"""TokenDataModule and ResumableDistributedSampler: sources, the data-parallel split, and exact resume.

The split is checked with simulated ranks (one sampler per rank, no process group): what matters is which
indices each rank draws. Exact resume is checked end to end through Lightning in one process: a run resumed
from a mid-epoch checkpoint must see exactly the batches the uninterrupted run saw after that step, and end
with the same weights.
"""

from __future__ import annotations

import json

import pytest
import torch
from lightning.pytorch import Callback, Trainer
from lightning.pytorch.callbacks import ModelCheckpoint

from megascale.core import GPTConfig
from megascale.lightning import GPTModule, TokenDataModule
from megascale.lightning.data import ResumableDistributedSampler, TokenWindows, load_tokens


class _Sized(torch.utils.data.Dataset):
    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> int:
        return i


def _micro_batches(sampler: ResumableDistributedSampler) -> list[list[int]]:
    indices = list(sampler)
    b = sampler.batch_size
    return [indices[i : i + b] for i in range(0, len(indices), b)]


# -- the data-parallel split ----------------------------------------------------------------------------------


@pytest.mark.parametrize("dp", [2, 4])
@pytest.mark.parametrize("shuffle", [True, False])
def test_ranks_split_each_global_batch_into_disjoint_strided_parts(dp, shuffle):
    n, b = 103, 3
    g = b * dp
    for epoch in (0, 1):
        samplers = [
            ResumableDistributedSampler(_Sized(n), dp, r, batch_size=b, shuffle=shuffle, seed=7)
            for r in range(dp)
        ]
        for s in samplers:
            s.set_epoch(epoch)
        order = samplers[0].global_order().tolist()
        per_rank = [_micro_batches(s) for s in samplers]
        assert all(len(batches) == n // g for batches in per_rank)  # every rank the same number of batches
        for j in range(n // g):
            global_batch = order[j * g : (j + 1) * g]  # consecutive positions of the global order
            parts = [per_rank[r][j] for r in range(dp)]
            for r, part in enumerate(parts):
                assert part == global_batch[r::dp]  # rank r takes positions r, r+dp, ...
            union = [i for part in parts for i in part]
            assert sorted(union) == sorted(global_batch) and len(set(union)) == g  # disjoint, complete
        # a rank's peers in other parallel dimensions (same dp rank) draw the same indices
        twin = ResumableDistributedSampler(_Sized(n), dp, 1, batch_size=b, shuffle=shuffle, seed=7)
        twin.set_epoch(epoch)
        assert list(twin) == list(samplers[1])
    if shuffle:
        first, second = ResumableDistributedSampler(_Sized(n), dp, 0, batch_size=b, seed=7), None
        second = ResumableDistributedSampler(_Sized(n), dp, 0, batch_size=b, seed=7)
        second.set_epoch(1)
        assert list(first) != list(second)  # a new permutation per epoch


def test_length_is_the_full_epoch_and_the_dataloader_agrees():
    n, b, dp = 103, 3, 2
    s = ResumableDistributedSampler(_Sized(n), dp, 0, batch_size=b)
    assert len(s) == (n // (b * dp)) * b == len(list(s))
    loader = torch.utils.data.DataLoader(_Sized(n), batch_size=b, sampler=s, drop_last=True)
    assert len(loader) == n // (b * dp)
    # resumed mid-epoch at the same layout: Lightning still counts the full epoch (it resumes its batch
    # counter at k), the iterator yields only the rest
    k = 5
    resumed = ResumableDistributedSampler(_Sized(n), dp, 0, batch_size=b, consumed_samples=k * b * dp)
    assert len(resumed) == len(s)
    assert _micro_batches(resumed) == _micro_batches(s)[k:]


def test_resume_continues_the_global_order_across_epochs():
    n, b, dp = 50, 2, 2
    g, per_epoch = b * dp, (50 // 4) * 4
    full = ResumableDistributedSampler(_Sized(n), dp, 1, batch_size=b)
    stream = []
    for epoch in range(3):
        full.set_epoch(epoch)
        stream.append(_micro_batches(full))
    for consumed in (0, 3 * g, per_epoch, per_epoch + 5 * g):
        resumed = ResumableDistributedSampler(_Sized(n), dp, 1, batch_size=b, consumed_samples=consumed)
        epoch, done = divmod(consumed, per_epoch)
        assert resumed.epoch == epoch  # starts in the epoch its consumed samples fall in
        assert _micro_batches(resumed) == stream[epoch][done // g :]
        resumed.set_epoch(epoch + 1)
        assert _micro_batches(resumed) == stream[epoch + 1]  # later epochs are whole


@pytest.mark.parametrize(("dp_before", "dp_after"), [(2, 4), (4, 2), (2, 3)])
def test_resume_at_another_dp_size_continues_at_the_same_global_position(dp_before, dp_after):
    n, b, k = 200, 3, 7
    g0, g1 = b * dp_before, b * dp_after
    consumed = k * g0  # k global batches done at the old layout
    order = ResumableDistributedSampler(_Sized(n), dp_before, 0, batch_size=b).global_order().tolist()
    resumed = [
        ResumableDistributedSampler(
            _Sized(n), dp_after, r, batch_size=b, consumed_samples=consumed, consumed_global_batch_size=g0
        )
        for r in range(dp_after)
    ]
    per_rank = [_micro_batches(s) for s in resumed]
    remaining = (n - consumed) // g1
    assert all(len(batches) == remaining for batches in per_rank)
    for j in range(remaining):
        union = [i for r in range(dp_after) for i in per_rank[r][j]]
        assert sorted(union) == sorted(order[consumed + j * g1 : consumed + (j + 1) * g1])
    # Lightning resumes its batch counter at k (batches of the old size): the epoch must be long enough
    # for k + the remaining batches, so no data of this epoch is dropped
    assert len(resumed[0]) // b >= k + remaining


# -- sources ------------------------------------------------------------------------------------------------


def test_stdlib_source_is_python_source_bytes():
    dm = TokenDataModule(source="stdlib", seq_len=64, batch_size=2, max_bytes=50_000)
    dm.setup("fit")
    assert dm.vocab_size == 256
    tokens, vocab = load_tokens("stdlib", 50_000)
    assert vocab == 256 and len(tokens) == 50_000 and tokens.dtype == torch.uint8
    assert b"def " in bytes(tokens.tolist()) and b"import " in bytes(tokens.tolist())
    inputs, targets = dm.train_dataset[0]
    assert inputs.dtype == torch.long and inputs.shape == (64,) and torch.equal(inputs[1:], targets[:-1])
    assert len(dm.train_dataset) + len(dm.val_dataset) in (len(tokens) // 64 - 1, len(tokens) // 64)


def test_path_source_reads_a_file_or_a_directory(tmp_path):
    (tmp_path / "b.txt").write_bytes(b"world " * 10)
    (tmp_path / "a.txt").write_bytes(b"hello " * 10)
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "c.txt").write_bytes(b"!")
    (tmp_path / ".hidden").write_bytes(b"SECRET")
    tokens, vocab = load_tokens(str(tmp_path / "a.txt"), 1000)
    assert vocab == 256 and bytes(tokens.tolist()) == b"hello " * 10
    tokens, _ = load_tokens(str(tmp_path), 1000)
    assert bytes(tokens.tolist()) == b"hello " * 10 + b"world " * 10 + b"!"  # sorted, recursive, no hidden
    tokens, _ = load_tokens(str(tmp_path), 15)
    assert bytes(tokens.tolist()) == b"hello hello hel"  # cut at max_bytes
    with pytest.raises(FileNotFoundError, match="neither"):
        load_tokens(str(tmp_path / "missing"), 10)
    dm = TokenDataModule(source=str(tmp_path), seq_len=8, batch_size=2, val_fraction=0.2)
    dm.setup("fit")
    # 121 bytes: the last int(121 * 0.2) = 24 held out
    assert len(dm.train_dataset) == (97 - 1) // 8 and len(dm.val_dataset) == (24 - 1) // 8


def test_random_source_is_deterministic_and_learnable():
    a, vocab = load_tokens("random:100", 5000, seed=3)
    b, _ = load_tokens("random:100", 5000, seed=3)
    assert vocab == 100 and torch.equal(a, b) and int(a.max()) < 100
    assert not torch.equal(a, load_tokens("random:100", 5000, seed=4)[0])
    steps = torch.unique((a[1:].long() - a[:-1].long()) % 100)
    assert len(steps) <= 4  # each token has at most 4 successors: a bigram model can learn it
    assert len(torch.unique(a)) > 90  # while the stream covers the vocabulary
    with pytest.raises(ValueError, match="random:<vocab size>"):
        load_tokens("random:x", 10)


def test_windows_overlap_by_one_token():
    ds = TokenWindows(torch.arange(20), seq_len=4)
    assert len(ds) == 4
    x, y = ds[1]
    assert x.tolist() == [4, 5, 6, 7] and y.tolist() == [5, 6, 7, 8]


def test_val_dataloader_is_in_order_and_split_over_ranks():
    dm = TokenDataModule(source="random:50", seq_len=4, batch_size=3, max_bytes=1000, val_fraction=0.1)
    dm.setup("fit")
    n_val = len(dm.val_dataset)
    samplers = [
        ResumableDistributedSampler(dm.val_dataset, 2, r, batch_size=1, shuffle=False) for r in range(2)
    ]
    assert [list(s) for s in samplers] == [
        list(range(0, n_val - 1, 2)),
        list(range(1, n_val, 2))[: n_val // 2],
    ]
    loader = dm.val_dataloader()  # no trainer: one rank
    assert list(loader.sampler) == list(range(n_val))
    assert not loader.sampler.shuffle


def test_state_dict_is_json_and_round_trips():
    dm = TokenDataModule(source="random:50", seq_len=4, batch_size=3, max_bytes=1000)
    assert json.loads(json.dumps(dm.state_dict())) == {"consumed_samples": 0, "global_batch_size": 3}
    dm.load_state_dict({"consumed_samples": 12, "global_batch_size": 3})
    assert dm.consumed_samples() == 12
    dm.setup("fit")
    sampler = dm.train_dataloader().sampler
    assert sampler.consumed_samples == 12 and sampler.consumed_global_batch_size == 3


# -- exact resume through Lightning ---------------------------------------------------------------------------

_SEQ, _BATCH, _STEPS = 8, 4, 25


class _RecordBatches(Callback):
    def __init__(self) -> None:
        self.seen: list[tuple[int, int, int, list[list[int]]]] = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.seen.append((trainer.global_step, trainer.current_epoch, batch_idx, batch[0].tolist()))


def _fit(tmp_path, ckpt_path=None, checkpoint_every=None, batch_size=_BATCH, max_steps=_STEPS):
    torch.manual_seed(0)
    config = GPTConfig(
        vocab_size=50, d_model=16, n_layers=1, n_heads=2, max_seq_len=_SEQ, pad_vocab_to_multiple_of=8
    )
    model = GPTModule(config, lr=3e-3, warmup_steps=3, init_seed=0)
    # 43 training windows of 8 tokens: 10 batches of 4 per epoch (3 windows dropped), 25 steps = 2.5 epochs
    data = TokenDataModule(
        source="random:50", seq_len=_SEQ, batch_size=batch_size, max_bytes=43 * _SEQ + 1, val_fraction=0.0
    )
    record = _RecordBatches()
    callbacks: list[Callback] = [record]
    if checkpoint_every:
        callbacks.append(
            ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=checkpoint_every, save_top_k=-1)
        )
    trainer = Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=max_steps,
        limit_val_batches=0,
        num_sanity_val_steps=0,
        logger=False,
        enable_checkpointing=bool(checkpoint_every),
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=callbacks,
        default_root_dir=tmp_path,
    )
    trainer.fit(model, data, ckpt_path=ckpt_path)
    return record.seen, model, data, trainer


# Lightning warns on every mid-epoch resume unless the DataLoader itself has state_dict/load_state_dict; here
# the resume state lives in TokenDataModule.state_dict, which is what this test proves right.
@pytest.mark.filterwarnings("ignore:You're resuming from a checkpoint that ended before the epoch ended")
@pytest.mark.filterwarnings("ignore:Be aware that when using `ckpt_path`")
def test_resumed_run_sees_exactly_the_batches_of_the_uninterrupted_run(tmp_path):
    seen, model, data, trainer = _fit(tmp_path, checkpoint_every=1)
    assert trainer.num_training_batches == 10
    assert data.state_dict() == {"consumed_samples": _STEPS * _BATCH, "global_batch_size": _BATCH}
    epochs = [epoch for _, epoch, _, _ in seen]
    assert (
        epochs.count(0) == 10 and epochs.count(1) == 10
    )  # the epoch length Lightning and the sampler agree on
    # mid-epoch, the last batch of an epoch, and mid-way through the next epoch
    for k in (4, 10, 13):
        ckpt = tmp_path / f"epoch={(k - 1) // 10}-step={k}.ckpt"
        state = torch.load(ckpt, weights_only=True)
        assert state["TokenDataModule"] == {"consumed_samples": k * _BATCH, "global_batch_size": _BATCH}
        resumed_seen, resumed_model, _, _ = _fit(tmp_path / f"resume{k}", ckpt_path=ckpt)
        expected = [s for s in seen if s[0] >= k]  # (global_step, epoch, batch_idx, inputs) from step k on
        assert resumed_seen == expected
        for (name, p), (_, q) in zip(model.named_parameters(), resumed_model.named_parameters()):
            torch.testing.assert_close(p, q, msg=name)


@pytest.mark.filterwarnings("ignore:You're resuming from a checkpoint that ended before the epoch ended")
@pytest.mark.filterwarnings("ignore:Be aware that when using `ckpt_path`")
@pytest.mark.parametrize("new_batch", [2, 8])
def test_resume_at_another_global_batch_size_continues_the_global_order(tmp_path, new_batch):
    # dp stays 1 here, but the micro-batch size changes the global batch G = batch_size × dp exactly as a dp
    # change does: the resumed run must continue at the same position of the same global order
    k = 6  # 6 × 4 = 24 of the epoch's 43 windows consumed
    _, _, data, _ = _fit(tmp_path, checkpoint_every=k, max_steps=k)
    ckpt = tmp_path / f"epoch=0-step={k}.ckpt"
    remaining = (43 - k * _BATCH) // new_batch  # whole new batches left in epoch 0
    seen, _, _, _ = _fit(
        tmp_path / "resumed", ckpt_path=ckpt, batch_size=new_batch, max_steps=k + remaining + 3
    )
    dataset = data.train_dataset
    order = [ResumableDistributedSampler(dataset, 1, 0).global_order(e).tolist() for e in (0, 1)]
    rows = {e: [row for _, epoch, _, inputs in seen if epoch == e for row in inputs] for e in (0, 1)}
    expected0 = order[0][k * _BATCH : k * _BATCH + remaining * new_batch]
    assert rows[0] == [dataset[i][0].tolist() for i in expected0]  # the rest of epoch 0, nothing dropped
    assert rows[1] == [
        dataset[i][0].tolist() for i in order[1][: 3 * new_batch]
    ]  # then epoch 1 from its start
    batch_idx = [idx for _, epoch, idx, _ in seen if epoch == 0]
    assert batch_idx == list(range(k, k + remaining))  # Lightning's counter continues at k


def test_anchored_sampler_serves_the_rest_of_the_interrupted_epoch():
    # After a checkpoint saved once fit() stopped at max_steps, Lightning resumes under the next epoch
    # number; an uninterrupted run would finish the interrupted epoch first, and so must the data.
    n, b, dp = 50, 2, 2
    g = b * dp
    full = ResumableDistributedSampler(_Sized(n), dp, 0, batch_size=b)
    stream = []
    for epoch in range(2):
        full.set_epoch(epoch)
        stream.append(_micro_batches(full))
    resumed = ResumableDistributedSampler(
        _Sized(n), dp, 0, batch_size=b, consumed_samples=3 * g, anchor_epoch=True
    )
    resumed.set_epoch(1)  # Lightning's number for the resumed epoch
    assert _micro_batches(resumed) == stream[0][3:]
    resumed.set_epoch(2)
    assert _micro_batches(resumed) == stream[1]
