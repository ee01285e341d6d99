"""WebLoader under bad input and failures: each gives a clear error (or a counted warning) and leaves nothing
behind in shared memory."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from megascale.data import DataSourceError, ShardNotFoundError, Source, WebDataConfig, WebLoader
from megascale.data.shm import PREFIX, shm_directory
from tests.data._shards import corrupt_shard, truncate_shard, write_text_shards


def _config(url: str, **overrides) -> WebDataConfig:
    base = dict(sources=[Source(url)], seq_len=16, batch_size=2, num_workers=0, prefetch=2, timeout=30)
    return WebDataConfig(**{**base, **overrides})


def _drain(iterator, n: int) -> None:
    for _ in range(n):
        next(iterator)


def _ring_files(run_id: str) -> list[Path]:
    return list(shm_directory().glob(f"{PREFIX}-{run_id}-*"))


@pytest.fixture
def shards(tmp_path):
    return write_text_shards(str(tmp_path), 4, 6, doc_chars=60, seed=4)


@pytest.mark.parametrize("damage", [corrupt_shard, truncate_shard], ids=["corrupt", "truncated"])
def test_a_damaged_shard_is_skipped_counted_and_warned_about(shards, tmp_path, damage):
    url, _ = shards
    damage(str(tmp_path / "part-000001.tar"))
    loader = WebLoader(_config(url, lanes=1), tree=False, max_steps=60)
    with pytest.warns(UserWarning, match="corrupt or truncated"):
        batches = list(loader)
    assert len(batches) == 60 and loader.stats["corrupt_shards"] >= 1


def test_a_damaged_shard_raises_when_asked_to(shards, tmp_path):
    url, _ = shards
    corrupt_shard(str(tmp_path / "part-000002.tar"))
    loader = WebLoader(_config(url, lanes=1, on_corrupt="raise", shuffle=False), run_id=uuid.uuid4().hex[:8])
    with pytest.raises(DataSourceError, match=r"part-000002\.tar"):
        for _ in loader:
            pass
    loader.close()


def test_a_missing_shard_fails_at_start_naming_it(shards, tmp_path):
    url, _ = shards
    (tmp_path / "part-000003.tar").unlink()
    with pytest.raises(ShardNotFoundError, match=r"part-000003\.tar"):
        next(iter(WebLoader(_config(url), run_id=uuid.uuid4().hex[:8])))


def test_an_empty_source_fails_at_start(tmp_path):
    with pytest.raises(DataSourceError, match="no shards"):
        next(iter(WebLoader(_config(str(tmp_path / "*.tar")), tree=False)))


def test_an_unreachable_bucket_fails_at_start_within_seconds(s3_env):
    source = Source("s3://nowhere/part-{0..3}.tar", storage_options={"endpoint_url": "http://127.0.0.1:9"})
    start = time.monotonic()
    with pytest.raises(DataSourceError, match=r"127\.0\.0\.1:9"):
        next(iter(WebLoader(WebDataConfig(sources=[source], seq_len=8, batch_size=1), tree=False)))
    assert time.monotonic() - start < 30


def test_an_s3_outage_during_reading_becomes_an_error_naming_the_shard(s3_outage_server, s3_env):
    fs = s3_outage_server.fs()
    bucket = f"outage-{uuid.uuid4().hex[:6]}"
    fs.call_s3("create_bucket", Bucket=bucket)
    url, _ = write_text_shards(
        f"s3://{bucket}", 8, 4, doc_chars=20, storage_options=s3_outage_server.storage_options
    )  # five windows per shard: a lane opens a new shard every few steps
    config = _config(url, lanes=2, retries=2, backoff=0.1)
    fast_fail = {
        "config_kwargs": {"connect_timeout": 1, "read_timeout": 2, "retries": {"total_max_attempts": 1}}
    }
    config.sources = [Source(url, storage_options={**s3_outage_server.storage_options, **fast_fail})]
    run_id = uuid.uuid4().hex[:8]
    loader = WebLoader(config, run_id=run_id)
    it = iter(loader)
    for _ in range(3):
        next(it)
    s3_outage_server.stop()
    start = time.monotonic()
    with pytest.raises(DataSourceError, match=rf"s3://{bucket}/part-\d+\.tar"):
        _drain(it, 40)
    assert time.monotonic() - start < 60
    loader.close()
    assert not _ring_files(run_id)


def test_a_killed_reader_is_an_error_and_leaves_no_shared_memory(shards):
    url, _ = shards
    run_id = uuid.uuid4().hex[:8]
    loader = WebLoader(_config(url), run_id=run_id)
    it = iter(loader)
    first = [next(it)[0] for _ in range(2)]
    assert not _ring_files(run_id)  # unlinked as soon as every rank mapped it
    os.kill(loader._process.pid, signal.SIGKILL)
    with pytest.raises(DataSourceError, match="died") as died:
        _drain(it, 10)
    assert f"the data reader of node 0 ({socket.gethostname()}) (pid" in str(died.value)  # which machine
    loader.close()
    assert not _ring_files(run_id)
    again = WebLoader(_config(url), run_id=run_id)  # the next run starts cleanly, from the start
    assert all((a == b[0]).all() for a, (b, _) in zip(first, zip(again, range(2)), strict=True))
    again.close()


def test_a_ring_left_by_a_killed_run_is_removed_at_the_next_start(shards):
    url, _ = shards
    run_id = uuid.uuid4().hex[:8]
    # a "node" that created its ring and was SIGKILLed before its ranks attached (the one window in which
    # the ring has a name)
    code = (
        "import os, signal, sys; from pathlib import Path; from megascale.data.shm import ShmRing, ring_path; "
        f"ShmRing.create(ring_path({run_id!r}, 0, os.getpid()), consumers=2, slots=2, slot_bytes=64); "
        "os.kill(os.getpid(), signal.SIGKILL)"
    )
    subprocess.run([sys.executable, "-c", code], check=False)
    assert len(_ring_files(run_id)) == 1
    loader = WebLoader(_config(url), run_id=run_id)
    next(iter(loader))
    assert not _ring_files(run_id)
    loader.close()


def test_a_rank_that_never_attaches_is_a_clear_error(shards):
    url, _ = shards
    run_id = uuid.uuid4().hex[:8]
    loader = WebLoader(_config(url, timeout=3), run_id=run_id, local_rank=0, local_world_size=2)
    with pytest.raises(DataSourceError, match="every local rank to attach"):
        next(iter(loader))
    loader.close()
    assert not _ring_files(run_id)


def test_resuming_with_other_data_is_refused(shards):
    url, _ = shards
    loader = WebLoader(_config(url), tree=False, max_steps=3)
    list(loader)
    state = loader.state_dict()
    other = WebLoader(_config(url, seed=1), tree=False)
    other.load_state_dict(state)
    with pytest.raises(ValueError, match="other data"):
        next(iter(other))


_HOOK_MODULE = '''
from megascale.data.tokenize import ByteTokenizer

class Shout:
    """Upper-case the text, then byte-tokenize it."""

    def __call__(self, sample):
        return ByteTokenizer().encode(sample["txt"].decode().upper())
'''

_SCRIPT = """
import sys
from megascale.data import Source, WebDataConfig, WebLoader
from megascale.data.tokenize import ByteTokenizer
{hook}
def first_batches(tree):
    cfg = WebDataConfig(sources=[Source(sys.argv[1])], seq_len=16, batch_size=2, num_workers=1, prefetch=2,
                        timeout=30, preprocess=hook)
    loader = WebLoader(cfg, tree=tree, run_id="hook" + str(tree), max_steps=3)
    return [x.tolist() for x, _ in loader]

tree = first_batches(True)
assert tree == first_batches(False), "tree and inline disagree"
assert all(t < 97 or t > 122 for b in tree for row in b for t in row), "hook not applied"
print("OK")
"""


def _run_script(
    tmp_path: Path, url: str, hook: str, module: str | None = None
) -> subprocess.CompletedProcess:
    app = tmp_path / "app"
    app.mkdir()
    (app / "train.py").write_text(_SCRIPT.format(hook=hook))
    if module is not None:
        (app / "shout_hook.py").write_text(module)
    # run from elsewhere: the hook's module is found only through the script's directory (sys.path[0])
    return subprocess.run(
        [sys.executable, str(app / "train.py"), url],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_a_hook_in_a_module_next_to_the_script_runs_in_the_node_reader(shards, tmp_path):
    url, _ = shards
    result = _run_script(tmp_path, url, "from shout_hook import Shout\nhook = Shout()", _HOOK_MODULE)
    assert result.returncode == 0 and "OK" in result.stdout, result.stderr[-3000:]


def test_a_hook_defined_in_the_training_script_is_refused_before_the_reader_starts(shards, tmp_path):
    url, _ = shards
    hook = "def hook(sample):\n    return ByteTokenizer().encode(sample['txt'].decode().upper())\n"
    result = _run_script(tmp_path, url, hook)
    assert result.returncode != 0
    assert "preprocess hook is defined in the training script (__main__: hook)" in result.stderr, (
        result.stderr[-3000:]
    )
    assert "move it into a module" in result.stderr


def test_an_unpicklable_hook_is_refused_with_what_to_use_instead(shards):
    url, _ = shards
    cfg = _config(url, preprocess=lambda sample: None)
    with pytest.raises(TypeError, match=r"picklable preprocess hook.*not a lambda"):
        next(iter(WebLoader(cfg, run_id=uuid.uuid4().hex[:8])))


def test_two_torchrun_jobs_on_one_machine_do_not_share_a_reader(shards, monkeypatch):
    """torchrun gives every job the run id "none" unless told otherwise: the store port tells jobs apart (by
    the id alone, a second job's ranks could find the first job's ring and read its batches)."""
    url, _ = shards
    ids = []
    for port in ("29501", "29502"):
        monkeypatch.setenv("TORCHELASTIC_RUN_ID", "none")
        monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
        monkeypatch.setenv("MASTER_PORT", port)
        ids.append(WebLoader(_config(url), tree=False).run_id)
    assert ids[0] != ids[1] and all(port in i for i, port in zip(ids, ("29501", "29502"), strict=True))
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "job-7")  # an id given (--rdzv-id) is the job's
    assert WebLoader(_config(url), tree=False).run_id == "job-7"
