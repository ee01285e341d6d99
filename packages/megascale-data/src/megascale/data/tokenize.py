"""Text to token ids: a byte-level tokenizer (no files, no dependencies) and Hugging Face `tokenizers` files,
alone or in a Hugging Face model directory (whose ``tokenizer_config.json``/``config.json`` name the
end-of-sequence token, so the data ends documents with the id the checkpoint was trained with).

Tokenizers run in lightweight worker processes started with "spawn", so this module must not import torch;
they are pickled to those workers, so each one pickles small (`HFTokenizer` sends its path, not its tables).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import numpy as np

__all__ = ["ByteTokenizer", "HFTokenizer", "Tokenizer", "load_tokenizer"]

EOS_CANDIDATES = ("</s>", "<|endoftext|>", "<eos>")


@runtime_checkable
class Tokenizer(Protocol):
    """What the data pipeline needs from a tokenizer."""

    vocab_size: int
    eos_id: int

    def encode(self, text: str) -> np.ndarray:
        """1-D int32 token ids of `text`, without an end-of-sequence id."""
        ...


class ByteTokenizer:
    """UTF-8 bytes as tokens: ids 0..255 are bytes, 256 is end-of-sequence (vocabulary of 257)."""

    vocab_size: int = 257
    eos_id: int = 256

    def encode(self, text: str) -> np.ndarray:
        """The UTF-8 bytes of `text` as int32 ids."""
        return np.frombuffer(text.encode("utf-8"), np.uint8).astype(np.int32)

    def decode(self, ids: np.ndarray | list[int]) -> str:
        """Text of byte ids (the eos id and invalid UTF-8 are dropped/replaced)."""
        data = bytes(int(i) for i in np.asarray(ids).ravel() if 0 <= i < 256)
        return data.decode("utf-8", errors="replace")

    def __repr__(self) -> str:
        return "ByteTokenizer()"


class HFTokenizer:
    """A Hugging Face `tokenizers` JSON file (``tokenizer.json``).

    Args:
        path: Path to the tokenizer's JSON file.
        eos_token: The end-of-sequence token; by default the first of ``</s>``, ``<|endoftext|>``, ``<eos>``
            that the tokenizer knows.

    Raises:
        ImportError: `tokenizers` is not installed (``pip install 'megascale-data[tokenizers]'``).
        ValueError: No end-of-sequence token could be found.
    """

    def __init__(self, path: str | os.PathLike[str], eos_token: str | None = None) -> None:
        try:
            from tokenizers import Tokenizer as _Tokenizer
        except ImportError as e:
            raise ImportError(
                "HFTokenizer needs the `tokenizers` package: pip install 'megascale-data[tokenizers]'"
            ) from e
        self.path = os.fspath(path)
        self.eos_token = eos_token
        try:
            self._tokenizer = _Tokenizer.from_file(self.path)
        except Exception as e:
            raise ValueError(f"cannot load tokenizer file {self.path}: {e}") from e
        self.vocab_size: int = self._tokenizer.get_vocab_size(with_added_tokens=True)
        candidates = (eos_token,) if eos_token is not None else EOS_CANDIDATES
        ids = [(t, self._tokenizer.token_to_id(t)) for t in candidates]
        found = [(t, i) for t, i in ids if i is not None]
        if not found:
            raise ValueError(
                f"tokenizer {self.path} has no end-of-sequence token among {list(candidates)}; "
                "pass eos_token= naming one of its special tokens"
            )
        self.eos_token, self.eos_id = found[0][0], int(found[0][1])

    @classmethod
    def from_directory(cls, directory: str | os.PathLike[str]) -> HFTokenizer:
        """The tokenizer of a Hugging Face model directory: its ``tokenizer.json``, ending documents with the
        end-of-sequence token its ``tokenizer_config.json`` names, or else the one whose id ``config.json`` /
        ``generation_config.json`` give as ``eos_token_id``; the two must agree where both are present."""
        root = Path(directory)
        file = root / "tokenizer.json"
        if not file.is_file():
            raise ValueError(
                f"{root} has no tokenizer.json: a Hugging Face model directory saved with a fast tokenizer "
                "(tokenizer.save_pretrained) holds one; or pass the path of a tokenizers .json file"
            )
        named = _eos_token_named(root / "tokenizer_config.json")
        tokenizer = cls(file, eos_token=named) if named is not None else None
        for config in (root / "generation_config.json", root / "config.json"):
            ids = _eos_ids_in(config)
            if not ids:
                continue
            if tokenizer is None:  # the first id the model stops at, as a token of this tokenizer
                token = _token_of(file, ids[0])
                if token is None:
                    raise ValueError(f"{config}: eos_token_id {ids[0]} is not an id of {file}")
                tokenizer = cls(file, eos_token=token)
            elif tokenizer.eos_id not in ids:
                raise ValueError(
                    f"{root / 'tokenizer_config.json'} names eos_token {tokenizer.eos_token!r} (id "
                    f"{tokenizer.eos_id}) but {config} has eos_token_id {ids if len(ids) > 1 else ids[0]}: "
                    "the data would end documents with a token the model does not stop at"
                )
            break
        return tokenizer if tokenizer is not None else cls(file)

    def encode(self, text: str) -> np.ndarray:
        """Token ids of `text` as int32, without special tokens added by post-processing."""
        ids = self._tokenizer.encode(text, add_special_tokens=False).ids
        return np.asarray(ids, dtype=np.int32)

    def decode(self, ids: np.ndarray | list[int]) -> str:
        """Text of token ids (special tokens skipped)."""
        return str(self._tokenizer.decode([int(i) for i in np.asarray(ids).ravel()]))

    def __getstate__(self) -> dict[str, Any]:
        return {"path": self.path, "eos_token": self.eos_token}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(state["path"], state["eos_token"])  # type: ignore[misc]

    def __repr__(self) -> str:
        return f"HFTokenizer({self.path!r}, eos_token={self.eos_token!r})"


def load_tokenizer(spec: str = "bytes") -> Tokenizer:
    """Build a tokenizer from a short spec.

    Args:
        spec: ``"bytes"`` for `ByteTokenizer`, the path of a Hugging Face `tokenizers` ``.json`` file, or a
            Hugging Face model directory holding ``tokenizer.json`` (``HFTokenizer.from_directory``).

    Returns:
        The tokenizer.

    Raises:
        ValueError: The spec is neither ``"bytes"``, an existing ``.json`` file nor a directory with one.
    """
    if spec == "bytes":
        return ByteTokenizer()
    if spec.endswith(".json") and os.path.isfile(spec):
        return HFTokenizer(spec)
    if os.path.isdir(spec):
        return HFTokenizer.from_directory(spec)
    raise ValueError(
        f"unknown tokenizer {spec!r}: use 'bytes' (byte-level, vocabulary 257), the path of an existing "
        "Hugging Face tokenizers .json file, or a Hugging Face model directory holding tokenizer.json"
    )


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise ValueError(f"cannot read {path}: {e}") from e
    if not isinstance(data, dict):
        raise ValueError(f"{path} is not a JSON object")
    return data


def _eos_token_named(path: Path) -> str | None:
    """The ``eos_token`` of a ``tokenizer_config.json`` (a string, or an AddedToken dict's content)."""
    token = _read_json(path).get("eos_token")
    if isinstance(token, dict):
        token = token.get("content")
    if token is not None and not isinstance(token, str):
        raise ValueError(f"{path}: eos_token {token!r} is neither a string nor a token object")
    return token


def _eos_ids_in(path: Path) -> list[int]:
    """The ``eos_token_id`` of a model's ``config.json``/``generation_config.json`` (one id or several)."""
    value = _read_json(path).get("eos_token_id")
    ids = value if isinstance(value, list) else [] if value is None else [value]
    if not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
        raise ValueError(f"{path}: eos_token_id {value!r} is not an id or a list of ids")
    return ids


def _token_of(file: Path, token_id: int) -> str | None:
    from tokenizers import Tokenizer as _Tokenizer

    token = _Tokenizer.from_file(str(file)).id_to_token(token_id)
    return None if token is None else str(token)
