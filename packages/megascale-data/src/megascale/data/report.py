"""What a source holds, before training on it: format, files and units, documents, text bytes and a token
estimate (the ``megascale-data inspect`` command).

Parquet row counts come from the footers (nothing else is read); tar and JSONL files are read whole unless
``sample_units`` limits the reading to the first units, whose documents per byte of file then estimate the
rest. Tokens are counted on the first ``sample_docs`` documents with the chosen tokenizer and scaled by text
bytes: an estimate, stated as one.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from megascale.data.formats.base import format_of, split_unit
from megascale.data.sources import Source, _fs, iter_texts, list_shards
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
    documents = text_bytes = sampled_tokens = sampled_bytes = 0
    for unit in read_units:
        for raw in iter_texts(source, unit):
            documents += 1
            text_bytes += len(raw)
            if documents <= sample_docs:
                sampled_tokens += len(tokenizer.encode(raw.decode("utf-8", errors="replace")))
                sampled_bytes += len(raw)
    exact = len(read_units) == len(units)
    if not exact:
        read_files = {split_unit(u)[0] for u in read_units}
        share = sum(_file_size(f, source) for f in read_files) / max(
            sum(_file_size(f, source) for f in files), 1
        )
        documents, text_bytes = round(documents / share), round(text_bytes / share)
    per_byte = sampled_tokens / sampled_bytes if sampled_bytes else 0.0
    return SourceReport(kind, len(files), len(units), documents, text_bytes, round(per_byte * text_bytes),
                        round(per_byte, 4), exact)  # fmt: skip
