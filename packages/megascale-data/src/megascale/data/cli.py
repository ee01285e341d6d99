"""The `megascale-data` command: turn text files into WebDataset tar shards that `Source` reads.

    megascale-data shard corpus/ --output s3://bucket/corpus --max-docs 10000 --split paragraph

Each document becomes one sample ``{"__key__": f"{n:09d}", "txt": <utf-8 bytes>}``; shards are named
``PREFIX-000000.tar``, ``PREFIX-000001.tar``, ... and the command prints the brace pattern naming them all.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import random
import re
import sys
from collections.abc import Iterable, Iterator
from typing import Any

from fsspec.core import url_to_fs
from tqdm import tqdm

from megascale.data.cli_errors import UserError, report_user_errors
from megascale.data.writer import ShardWriter

__all__ = ["main"]

_UNITS = {"": 1, "b": 1, "k": 10**3, "kb": 10**3, "kib": 2**10, "m": 10**6, "mb": 10**6, "mib": 2**20}
_UNITS |= {"g": 10**9, "gb": 10**9, "gib": 2**30}


class UsageError(UserError):
    """A problem with the command line or the inputs (exit code 2, one line; --traceback: the trace)."""


def parse_size(text: str) -> int:
    """Bytes from ``"256MB"``, ``"1GiB"``, ``"4096"``... (kB/MB/GB are powers of 1000, KiB/MiB/GiB of 1024)."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*", text)
    if match is None or match.group(2).lower() not in _UNITS:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (examples: 4096, 64MB, 1GiB)")
    return int(float(match.group(1)) * _UNITS[match.group(2).lower()])


def _storage_option(text: str) -> tuple[str, Any]:
    key, sep, value = text.partition("=")
    if not sep or not key:
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE, got {text!r}")
    try:
        return key, json.loads(value)  # numbers, booleans, nested dicts such as config_kwargs={...}
    except json.JSONDecodeError:
        return key, value


def _is_url(path: str) -> bool:
    return "://" in path and not path.startswith("file://")


def _input_files(inputs: list[str], options: dict[str, Any]) -> list[tuple[Any, str]]:
    """(filesystem, path) of every input file: files as given, directories searched for *.txt, sorted."""
    files: list[tuple[Any, str]] = []
    for item in inputs:
        fs, path = url_to_fs(item, **(options if _is_url(item) else {}))
        if any(c in path for c in "*?["):
            matches = sorted(fs.glob(path))
        elif fs.isdir(path):
            matches = sorted(p for p in fs.find(path) if p.endswith(".txt"))
        elif fs.isfile(path):
            matches = [path]
        else:
            raise UsageError(f"input {item} does not exist")
        if not matches:
            raise UsageError(f"input {item} holds no .txt files")
        files += [(fs, p) for p in matches]
    return files


def _documents(fs: Any, path: str, split: str) -> Iterator[str]:
    """Documents of one text file; blank documents are dropped."""
    try:
        with fs.open(path, "rb") as raw, io.TextIOWrapper(raw, encoding="utf-8") as f:
            if split == "file":
                text = f.read()
                if text.strip():
                    yield text
                return
            paragraph: list[str] = []
            for line in f:
                if split == "line":
                    if line.strip():
                        yield line.rstrip("\r\n")
                elif line.strip():
                    paragraph.append(line)
                elif paragraph:
                    yield "".join(paragraph).strip("\r\n")
                    paragraph = []
            if paragraph:
                yield "".join(paragraph).strip("\r\n")
    except UnicodeDecodeError as e:
        raise UsageError(f"input {path} is not UTF-8 text: {e}") from e


def _clear_output(args: argparse.Namespace, options: dict[str, Any]) -> str:
    """The output URL (local paths made absolute), its PREFIX-*.tar shards removed with --overwrite and
    refused without it."""
    output = args.output if _is_url(args.output) else os.path.abspath(args.output.removeprefix("file://"))
    out_fs, out_path = url_to_fs(output, **(options if _is_url(output) else {}))
    existing = out_fs.glob(f"{out_path.rstrip('/')}/{args.prefix}-*.tar")
    if existing and not args.overwrite:
        raise UsageError(
            f"{output} already holds {len(existing)} shards named {args.prefix}-*.tar: remove them, pass "
            "--overwrite, or choose another --prefix"
        )
    for path in existing:
        out_fs.rm(path)
    return output


def shard(args: argparse.Namespace) -> int:
    """The `shard` subcommand."""
    options = dict(args.storage_option or [])
    files = _input_files(args.inputs, options)
    output = _clear_output(args, options)
    docs: Iterable[str] = (doc for fs, path in files for doc in _documents(fs, path, args.split))
    if args.shuffle:
        docs = list(docs)
        random.Random(args.seed).shuffle(docs)
    writer = ShardWriter(output, args.prefix, args.max_docs, args.max_bytes, options)
    try:
        for doc in tqdm(docs, desc="documents", unit="doc", file=sys.stderr, disable=None):
            writer.write(doc)
    finally:
        writer.close()
    if writer.docs == 0:
        raise UsageError(f"the inputs hold no documents (split={args.split}): nothing written")
    print(
        f"wrote {writer.docs} documents ({writer.bytes} bytes) into {writer.shards} shards: {writer.pattern()}"
    )
    return 0


def build_parser() -> argparse.ArgumentParser:
    """The command-line parser of `megascale-data`."""
    parser = argparse.ArgumentParser(prog="megascale-data", description="megascale data tools.")
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--traceback", action="store_true", help="show the full trace of an error")
    commands = _Subcommands(parser.add_subparsers(dest="command", required=True), common)
    p = commands.add_parser(
        "shard",
        help="write text files as WebDataset tar shards",
        description="Write text documents as WebDataset tar shards (one 'txt' member per document).",
    )
    p.add_argument(
        "inputs",
        nargs="+",
        metavar="INPUT",
        help="text files, directories (*.txt, recursively), globs or fsspec URLs",
    )
    p.add_argument("--output", required=True, help="directory or URL (s3://bucket/dir) for the shards")
    p.add_argument("--prefix", default="part", help="shard name prefix (default: part)")
    p.add_argument("--max-docs", type=int, default=1000, help="documents per shard at most (default: 1000)")
    p.add_argument(
        "--max-bytes",
        type=parse_size,
        default=256 * 2**20,
        help="text bytes per shard at most, e.g. 64MB (default: 256MiB)",
    )
    p.add_argument(
        "--split",
        choices=["file", "line", "paragraph"],
        default="file",
        help="one document per file (default), per non-empty line, or per paragraph (blank-line separated)",
    )
    p.add_argument(
        "--shuffle",
        action="store_true",
        help="shuffle all documents before sharding (holds them all in memory)",
    )
    p.add_argument("--seed", type=int, default=0, help="seed of --shuffle (default: 0)")
    p.add_argument(
        "--storage-option",
        action="append",
        type=_storage_option,
        metavar="KEY=VALUE",
        help="fsspec option for remote inputs and output, repeatable (endpoint_url=http://..., key=..., secret=...)",
    )
    p.add_argument(
        "--overwrite", action="store_true", help="replace existing PREFIX-*.tar shards in the output"
    )
    p.set_defaults(func=shard)
    q = commands.add_parser(
        "stdlib",
        help="write the Python standard library's sources as train/val shards (the embedded dataset)",
        description="Write the stdlib's .py files (one document each) as train-*.tar and val-*.tar shards, "
        "or find them when already built for this Python; prints the two patterns as JSON.",
    )
    q.add_argument(
        "--output", default=".cache/megascale/stdlib", help="local directory (default: %(default)s)"
    )
    q.add_argument("--val-percent", type=float, default=5.0, help="files held out (default: 5)")
    q.add_argument("--max-docs", type=int, default=32, help="files per training shard (default: 32)")
    q.add_argument("--force", action="store_true", help="rebuild even when built already")
    q.set_defaults(func=stdlib)
    t = commands.add_parser(
        "tokenizer",
        help="train a byte-level BPE tokenizer on the embedded corpus (the stdlib's training files)",
        description="Train a byte-level BPE (Hugging Face tokenizers) on the stdlib's training files, validation "
        "files left out, with <|endoftext|> as end of document; writes OUTPUT/tokenizer.json and "
        "tokenizer_config.json, which a data source's `tokenizer: OUTPUT` reads.",
    )
    t.add_argument("--output", default=".cache/megascale/bpe", help="directory (default: %(default)s)")
    t.add_argument("--vocab-size", type=int, default=4096, help="ids, eos included (default: 4096)")
    t.add_argument(
        "--max-bytes", type=parse_size, default=None, help="train on about this much text, e.g. 8MB"
    )
    t.set_defaults(func=tokenizer)
    i = commands.add_parser(
        "inspect",
        help="what a source holds: format, files, units, documents, text bytes, a token estimate",
        description="Count a source's documents and text (Parquet from footers; tar and JSONL by reading, or "
        "by reading --sample-units and extrapolating) and estimate its tokens with --tokenizer.",
    )
    _source_arguments(i)
    i.add_argument("--tokenizer", default="bytes", help="'bytes', a tokenizer.json or an HF directory")
    i.add_argument("--sample-docs", type=int, default=1000, help="documents tokenized (default: 1000)")
    i.add_argument("--sample-units", type=int, default=None, help="read only the first N units")
    i.set_defaults(func=inspect)
    c = commands.add_parser(
        "convert",
        help="write a Parquet or JSONL source as WebDataset tar shards",
        description="Read a source (Parquet, JSONL(.zst), or tar) and write its documents as tar shards, one "
        "'txt' member per document, as `shard` does.",
    )
    _source_arguments(c)
    c.add_argument("--output", required=True, help="directory or URL for the shards")
    c.add_argument("--prefix", default="part", help="shard name prefix (default: part)")
    c.add_argument("--max-docs", type=int, default=1000, help="documents per shard at most (default: 1000)")
    c.add_argument("--max-bytes", type=parse_size, default=256 * 2**20, help="text bytes per shard at most")
    c.add_argument("--overwrite", action="store_true", help="replace existing PREFIX-*.tar shards")
    c.set_defaults(func=convert)
    return parser


class _Subcommands:
    """``add_parser`` with the options every subcommand shares (``--traceback``)."""

    def __init__(self, action: Any, common: argparse.ArgumentParser) -> None:
        self.action, self.common = action, common

    def add_parser(self, name: str, **kwargs: Any) -> argparse.ArgumentParser:
        parser: argparse.ArgumentParser = self.action.add_parser(name, parents=[self.common], **kwargs)
        return parser


def _source_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "urls", nargs="+", metavar="URL", help="files, brace patterns or globs, local or fsspec URLs"
    )
    p.add_argument(
        "--format", choices=["tar", "parquet", "jsonl"], default=None, help="default: by extension"
    )
    p.add_argument("--text-key", default=None, help="member extension, column or field of the text")
    p.add_argument(
        "--storage-option", action="append", type=_storage_option, metavar="KEY=VALUE",
        help="fsspec option for remote URLs, repeatable",
    )  # fmt: skip


def _source(args: argparse.Namespace) -> Any:
    from megascale.data.sources import DataSourceError, Source

    urls = args.urls[0] if len(args.urls) == 1 else list(args.urls)
    try:
        return Source(urls, storage_options=dict(args.storage_option or []) or None, text_key=args.text_key,
                      format=args.format)  # fmt: skip
    except (ValueError, TypeError, DataSourceError) as e:
        raise UsageError(str(e)) from e


def inspect(args: argparse.Namespace) -> int:
    """The `inspect` subcommand: one JSON object."""
    from megascale.data.report import inspect_source
    from megascale.data.sources import DataSourceError
    from megascale.data.tokenize import load_tokenizer

    try:
        report = inspect_source(_source(args), load_tokenizer(args.tokenizer), sample_docs=args.sample_docs,
                                sample_units=args.sample_units)  # fmt: skip
    except (ValueError, ImportError, DataSourceError) as e:
        raise UsageError(str(e)) from e
    print(json.dumps(report.as_dict()))
    return 0


def convert(args: argparse.Namespace) -> int:
    """The `convert` subcommand."""
    from megascale.data.sources import DataSourceError, iter_texts, list_shards

    source = _source(args)
    options = source.storage_options or {}
    output = _clear_output(args, options)
    writer = ShardWriter(output, args.prefix, args.max_docs, args.max_bytes, options)
    try:
        units = list_shards(source)
        for unit in tqdm(units, desc="units", unit="unit", file=sys.stderr, disable=None):
            for raw in iter_texts(source, unit):
                writer.write(raw.decode("utf-8", errors="replace"))
    except (ValueError, ImportError, DataSourceError) as e:
        raise UsageError(str(e)) from e
    finally:
        writer.close()
    if writer.docs == 0:
        raise UsageError("the source holds no documents: nothing written")
    print(
        f"wrote {writer.docs} documents ({writer.bytes} bytes) into {writer.shards} shards: {writer.pattern()}"
    )
    return 0


def tokenizer(args: argparse.Namespace) -> int:
    """The `tokenizer` subcommand."""
    from megascale.data.bpe import train_stdlib_bpe
    from megascale.data.tokenize import load_tokenizer

    try:
        out = train_stdlib_bpe(args.output, vocab_size=args.vocab_size, max_bytes=args.max_bytes)
    except (ValueError, ImportError, FileNotFoundError) as e:
        raise UsageError(str(e)) from e
    trained = load_tokenizer(str(out))
    print(json.dumps({"tokenizer": str(out), "vocab_size": trained.vocab_size, "eos_id": trained.eos_id}))
    return 0


def stdlib(args: argparse.Namespace) -> int:
    """The `stdlib` subcommand."""
    from megascale.data.stdlib import build_stdlib_shards

    try:
        shards = build_stdlib_shards(
            args.output, val_percent=args.val_percent, max_docs=args.max_docs, force=args.force
        )
    except (ValueError, FileNotFoundError) as e:
        raise UsageError(str(e)) from e
    print(json.dumps({"train": shards.train, "val": shards.val, "train_docs": shards.train_docs,
                      "val_docs": shards.val_docs, "bytes": shards.bytes}))  # fmt: skip
    return 0


def main(argv: list[str] | None = None) -> int:
    """Run `megascale-data`; returns the exit code (2 for usage errors and unusable inputs)."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if getattr(args, "max_docs", 1) < 1 or (getattr(args, "max_bytes", 1) or 1) < 1:
        parser.error("--max-docs and --max-bytes must be positive")
    prog = f"{parser.prog} {args.command}"
    return report_user_errors(prog, lambda: args.func(args), traceback=args.traceback)


if __name__ == "__main__":
    sys.exit(main())
