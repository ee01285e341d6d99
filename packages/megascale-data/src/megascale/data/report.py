"""What a source holds, before training on it: format, files and units, documents, text bytes and a token
estimate (the ``megascale-data inspect`` command).

Parquet row counts come from the footers (nothing else is read); tar and JSONL files are read whole unless
``sample_units`` limits the reading to the first units, whose documents per byte of file then estimate the
rest. Tokens are counted on the first ``sample_docs`` documents with the chosen tokenizer and scaled by text
bytes: an estimate, stated as one.

``exact`` is true only when every unit was read whole: a corrupt or truncated unit (warned about, its rest
skipped) makes the counts a lower bound, ``corrupt_units`` says how many. Records without the text
(``skipped_records``: a JSONL line without the field, a bad line) are counted; when no record has it the
report is refused with the keys the first record has and how to choose one (``--text-key``).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from typing import Any

from megascale.data.formats.base import format_of, split_unit
from megascale.data.sources import ReadStats, Source, _fs, iter_samples, list_shards
from megascale.data.tokenize import Tokenizer

__all__ = ["SourceReport", "inspect_source"]


@dataclass(frozen=True)
class SourceReport:
    """What ``inspect_source`` found (``exact`` False: documents and bytes extrapolated from a sample)."""

    format: str
    files: int
    units: int
    documents: int
    text_bytes: int
    tokens_estimate: int
    tokens_per_byte: float
    exact: bool
    corrupt_units: int = 0
    skipped_records: int = 0

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def _file_size(url: str, source: Source) -> int:
    fs, path = _fs(url, source.storage_options)
    return int(fs.size(path))


def inspect_source(
    source: Source, tokenizer: Tokenizer, *, sample_docs: int = 1000, sample_units: int | None = None
) -> SourceReport:
    """Count what ``source`` holds (see the module docstring).

    Args:
        source: the dataset.
        tokenizer: what tokens are counted with.
        sample_docs: documents tokenized to measure tokens per text byte.
        sample_units: read only this many units (None: all); the rest is extrapolated by file size.
    """
    units = list_shards(source)
    files = sorted({split_unit(u)[0] for u in units})
    kind = format_of(units[0], source.format)
    read_units = units if sample_units is None else units[:sample_units]
    documents = text_bytes = sampled_tokens = sampled_bytes = skipped = 0
    stats = ReadStats()
    for unit in read_units:
        key = source.text_key_of(unit)
        samples = iter_samples(unit, storage_options=source.storage_options, format=source.format, text_key=key,
                               stats=stats)  # fmt: skip
        for sample in samples:
            raw = sample.get(key)
            if raw is None:
                skipped += 1
                continue
            documents += 1
            text_bytes += len(raw)
            if documents <= sample_docs:
                sampled_tokens += len(tokenizer.encode(raw.decode("utf-8", errors="replace")))
                sampled_bytes += len(raw)
    if documents == 0 and skipped:
        raise ValueError(_no_text(source, units[0], kind, skipped))
    exact = len(read_units) == len(units) and stats.corrupt_shards == 0
    if len(read_units) < len(units):
        read_files = {split_unit(u)[0] for u in read_units}
        share = sum(_file_size(f, source) for f in read_files) / max(
            sum(_file_size(f, source) for f in files), 1
        )
        documents, text_bytes = round(documents / share), round(text_bytes / share)
    per_byte = sampled_tokens / sampled_bytes if sampled_bytes else 0.0
    return SourceReport(kind, len(files), len(units), documents, text_bytes, round(per_byte * text_bytes),
                        round(per_byte, 4), exact, stats.corrupt_shards, skipped + stats.skipped_samples)  # fmt: skip


def _no_text(source: Source, unit: str, kind: str, skipped: int) -> str:
    """Why no record had a text: the field asked for, the keys the first record has, how to choose one."""
    key = source.text_key_of(unit)
    seen = "its records"
    if kind == "jsonl":
        from megascale.data.formats.jsonl import _lines

        path = split_unit(unit)[0]
        fs, local = _fs(path, source.storage_options)
        with fs.open(local, "rb") as raw:
            for line in _lines(raw, local):
                if line.strip():
                    try:
                        record = json.loads(line)
                    except ValueError:
                        seen = "its first line is not JSON"
                    else:
                        seen = f"its first record has the keys {sorted(record) if isinstance(record, dict) else type(record).__name__}"
                    break
    elif kind == "tar":
        first = next(iter_samples(unit, storage_options=source.storage_options, format="tar"), {})
        seen = f"its first sample has the members {sorted(k for k in first if not k.startswith('__'))}"
    return (
        f"none of the {skipped} records read has a text field {key!r} ({seen}): choose the field with "
        "--text-key NAME (Source(text_key=...) in Python)"
    )
