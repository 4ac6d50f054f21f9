"""    .venv/bin/python launch/data.py

Token streams for ``launch/pretrain.py``: real text with nothing to download, or yours.
The line above prints a summary of the embedded corpus and its split; the same for your
files: ``.venv/bin/python launch/data.py --data notes.txt docs.jsonl --tokenizer DIR``.

Sources:

* embedded (default): the ``.py`` files of the Python standard library installed on this
  machine (code, comments and docstrings; ``test``/``site-packages`` left out). Each file
  goes to train or validation by a hash of its relative path, so the split is the same on
  every rank and every run, and no file is in both.
* ``--data PATH ...``: text files (one document each), JSONL files (one document per
  line, field ``text`` or ``--text-field``), directories of those, or a dataset saved with
  ``datasets.save_to_disk`` (needs the ``datasets`` package). Documents are split by a
  hash of their name (``file`` or ``file:line``); a saved ``DatasetDict`` with a
  ``validation`` (or ``test``) split keeps it. When the hash split would leave a side
  empty (e.g. one file), the last ``val_fraction`` of the token stream is validation.

Tokens: byte-level by default (vocabulary 256, byte 0 separates documents), or a local
HF tokenizer (``--tokenizer PATH``; its EOS token separates documents).

Batches are functions of ``(seed, step, micro_step, rank)`` only, so a run resumed from
a checkpoint at step k reads exactly what the uninterrupted run read after step k.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.util
import json
import os
import sysconfig
import zlib
from dataclasses import dataclass, field
from typing import Iterable, List, Optional, Sequence, Tuple

import numpy as np
import torch

BYTE_VOCAB = 256
BYTE_SEPARATOR = 0  # NUL never occurs in text files: a free end-of-document token
DEFAULT_VAL_FRACTION = 0.05
SKIP_DIRS = {"site-packages", "dist-packages", "__pycache__", "test", "tests", "idle_test"}
TEXT_SUFFIXES = (".txt", ".md", ".rst", ".py", ".text")
JSONL_SUFFIXES = (".jsonl", ".json", ".ndjson")

Document = Tuple[str, str]  # (name, text)


def corpus_bytes(limit: int = 200_000) -> bytes:
    """Real text with nothing to download: sources of a few standard-library modules."""
    out = b""
    for name in ("json.decoder", "argparse", "functools", "textwrap", "dataclasses"):
        with open(importlib.util.find_spec(name).origin, "rb") as f:
            out += f.read()
        if len(out) >= limit:
            break
    return out[:limit]


# ---- tokenizers -------------------------------------------------------------------------
class ByteTokenizer:
    """UTF-8 bytes as tokens; nothing to download."""

    name = "bytes"
    vocab_size = BYTE_VOCAB
    separator = BYTE_SEPARATOR

    def encode_documents(self, texts: Sequence[str]) -> np.ndarray:
        blob = bytes([self.separator]).join(t.encode("utf-8", errors="replace") for t in texts)
        return np.frombuffer(blob + bytes([self.separator]), dtype=np.uint8).copy()

    def decode(self, ids: Iterable[int]) -> str:
        return bytes(int(i) for i in ids).decode("utf-8", errors="replace")


class HFTokenizer:
    """A tokenizer saved on local disk (``AutoTokenizer.from_pretrained(path)``), offline."""

    def __init__(self, path: str) -> None:
        if not os.path.exists(path):
            raise ValueError(f"--tokenizer: {path!r} does not exist; give a local directory saved with "
                             "tokenizer.save_pretrained (nothing is downloaded)")
        from transformers import AutoTokenizer

        self.tok = AutoTokenizer.from_pretrained(path, local_files_only=True)
        self.name = path
        self.vocab_size = len(self.tok)
        sep = self.tok.eos_token_id if self.tok.eos_token_id is not None else self.tok.sep_token_id
        if sep is None:
            raise ValueError(f"--tokenizer {path!r} has neither an EOS nor a SEP token to separate documents")
        self.separator = int(sep)

    def encode_documents(self, texts: Sequence[str], chunk: int = 256) -> np.ndarray:
        dtype = np.int32
        pieces = []
        for i in range(0, len(texts), chunk):
            for ids in self.tok(list(texts[i:i + chunk]), add_special_tokens=False)["input_ids"]:
                pieces.append(np.asarray(ids + [self.separator], dtype=dtype))
        return np.concatenate(pieces) if pieces else np.zeros(0, dtype=dtype)

    def decode(self, ids: Iterable[int]) -> str:
        return self.tok.decode([int(i) for i in ids])


def make_tokenizer(path: Optional[str]):
    return ByteTokenizer() if path is None else HFTokenizer(path)


# ---- documents --------------------------------------------------------------------------
def in_validation(name: str, val_fraction: float) -> bool:
    """Deterministic, machine-independent assignment of a document to the validation split."""
    return zlib.crc32(name.encode("utf-8")) % 1_000_000 < val_fraction * 1_000_000


def stdlib_root() -> str:
    return sysconfig.get_paths()["stdlib"]


def stdlib_documents(max_bytes: Optional[int] = None) -> List[Document]:
    """``(relative path, source)`` of the standard library's ``.py`` files, sorted by path.
    ``max_bytes`` keeps a deterministic subset (files in hash order) for quick runs."""
    root = stdlib_root()
    paths = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in SKIP_DIRS)
        for f in sorted(filenames):
            if f.endswith(".py"):
                full = os.path.join(dirpath, f)
                paths.append((os.path.relpath(full, root).replace(os.sep, "/"), full))
    if not paths:
        raise RuntimeError(f"no .py files under the standard library directory {root!r}; use --data")
    if max_bytes is not None:
        paths.sort(key=lambda p: zlib.adler32(p[0].encode()))
    docs, total = [], 0
    for rel, full in paths:
        with open(full, "rb") as f:
            text = f.read().decode("utf-8", errors="replace")
        docs.append((rel, text))
        total += len(text)
        if max_bytes is not None and total >= max_bytes:
            break
    docs.sort()
    return docs


def _jsonl_documents(path: str, field_name: str) -> List[Document]:
    docs = []
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as exc:
                raise ValueError(f"--data {path}:{lineno}: not a JSON line ({exc.msg}); JSONL files hold one "
                                 f"object per line with a {field_name!r} field") from None
            if not isinstance(row, dict) or not isinstance(row.get(field_name), str):
                keys = sorted(row) if isinstance(row, dict) else type(row).__name__
                raise ValueError(f"--data {path}:{lineno}: expected an object with a string field "
                                 f"{field_name!r}, got keys {keys} (choose the field with --text-field)")
            docs.append((f"{path}:{lineno}", row[field_name]))
    return docs


def _is_saved_dataset(path: str) -> bool:
    return os.path.isdir(path) and any(os.path.exists(os.path.join(path, f))
                                       for f in ("dataset_dict.json", "dataset_info.json", "state.json"))


def _saved_dataset_documents(path: str, field_name: str) -> Tuple[List[Document], Optional[List[Document]]]:
    """(train documents, validation documents or None) of a ``save_to_disk`` directory."""
    try:
        import datasets
    except ImportError:
        raise ValueError(f"--data {path}: this is a dataset saved with datasets.save_to_disk, but the "
                         "'datasets' package is not installed (pip install datasets), or export it "
                         "to JSONL") from None
    ds = datasets.load_from_disk(path)

    def docs_of(split, tag):
        if field_name not in split.column_names:
            raise ValueError(f"--data {path}: no column {field_name!r} in split {tag!r}; columns are "
                             f"{split.column_names} (choose one with --text-field)")
        return [(f"{path}[{tag}]:{i}", t) for i, t in enumerate(split[field_name]) if isinstance(t, str)]

    if isinstance(ds, datasets.DatasetDict):
        if "train" not in ds:
            raise ValueError(f"--data {path}: DatasetDict without a 'train' split (has {list(ds)})")
        val_name = next((s for s in ("validation", "valid", "test") if s in ds), None)
        return docs_of(ds["train"], "train"), (docs_of(ds[val_name], val_name) if val_name else None)
    return docs_of(ds, "all"), None


def user_documents(paths: Sequence[str], field_name: str = "text") -> Tuple[List[Document], Optional[List[Document]]]:
    """Documents of ``--data`` paths, in a fixed order; and a given validation set if any."""
    docs: List[Document] = []
    given_val: Optional[List[Document]] = None
    for path in paths:
        if not os.path.exists(path):
            raise ValueError(f"--data: {path!r} does not exist")
        if _is_saved_dataset(path):
            train, val = _saved_dataset_documents(path, field_name)
            docs += train
            if val is not None:
                given_val = (given_val or []) + val
            continue
        files = [path]
        if os.path.isdir(path):
            files = sorted(os.path.join(d, f) for d, _, fs in os.walk(path) for f in fs
                           if f.endswith(TEXT_SUFFIXES + JSONL_SUFFIXES))
            if not files:
                raise ValueError(f"--data {path}: directory holds no {TEXT_SUFFIXES + JSONL_SUFFIXES} files "
                                 "and is not a saved dataset")
        for f in files:
            if f.endswith(JSONL_SUFFIXES):
                docs += _jsonl_documents(f, field_name)
            else:
                with open(f, "rb") as fh:
                    docs.append((f, fh.read().decode("utf-8", errors="replace")))
    if not docs:
        raise ValueError(f"--data {list(paths)}: no documents found")
    return docs, given_val


# ---- the corpus -------------------------------------------------------------------------
@dataclass
class Corpus:
    train: torch.Tensor  # 1-D token ids (uint8 for bytes, int32 for a tokenizer)
    validation: torch.Tensor
    vocab_size: int
    source: str
    train_names: List[str] = field(default_factory=list)
    val_names: List[str] = field(default_factory=list)

    def describe(self) -> str:
        return (f"{self.source}: {self.train.numel():,} train / {self.validation.numel():,} validation tokens "
                f"({len(self.train_names)} / {len(self.val_names)} documents), vocab {self.vocab_size}")


def _to_tensor(ids: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(ids)


def build_corpus(data: Optional[Sequence[str]] = None, tokenizer: Optional[str] = None, *,
                 val_fraction: float = DEFAULT_VAL_FRACTION, text_field: str = "text",
                 max_bytes: Optional[int] = None) -> Corpus:
    if not 0.0 < val_fraction < 1.0:
        raise ValueError(f"--val-fraction: got {val_fraction}; allowed: 0 < val_fraction < 1")
    tok = make_tokenizer(tokenizer)
    if data:
        docs, given_val = user_documents(data, text_field)
        source = "data " + ", ".join(data)
    else:
        docs, given_val = stdlib_documents(max_bytes), None
        source = f"embedded Python {sysconfig.get_python_version()} standard library sources"
    if given_val is not None:
        train_docs, val_docs = docs, given_val
    else:
        train_docs = [d for d in docs if not in_validation(d[0], val_fraction)]
        val_docs = [d for d in docs if in_validation(d[0], val_fraction)]
    if train_docs and val_docs:
        train_ids = tok.encode_documents([t for _, t in train_docs])
        val_ids = tok.encode_documents([t for _, t in val_docs])
        names = ([n for n, _ in train_docs], [n for n, _ in val_docs])
    else:  # too few documents to split by name: hold out the tail of the stream
        ids = tok.encode_documents([t for _, t in docs])
        cut = int(round(len(ids) * (1.0 - val_fraction)))
        train_ids, val_ids = ids[:cut], ids[cut:]
        names = ([n for n, _ in docs], [f"{docs[-1][0]} (last {val_fraction:.0%} of tokens)"])
        source += " (split by position)"
    return Corpus(_to_tensor(train_ids), _to_tensor(val_ids), tok.vocab_size, source, *names)


# ---- batches ----------------------------------------------------------------------------
def _seed(*parts: int) -> int:
    digest = hashlib.blake2b("/".join(str(int(p)) for p in parts).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & ((1 << 63) - 1)


def _windows(stream: torch.Tensor, starts: torch.Tensor, seq: int) -> torch.Tensor:
    index = starts.view(-1, 1) + torch.arange(seq).view(1, -1)
    return stream[index].long()


def train_batch(stream: torch.Tensor, *, seed: int, step: int, micro_step: int, rank: int,
                micro: int, seq: int) -> torch.Tensor:
    """``micro`` random windows of ``seq`` tokens; a pure function of its arguments."""
    if stream.numel() <= seq:
        raise ValueError(f"training stream has {stream.numel()} tokens, fewer than --seq-len {seq}")
    gen = torch.Generator().manual_seed(_seed(seed, step, micro_step, rank))
    starts = torch.randint(0, stream.numel() - seq, (micro,), generator=gen)
    return _windows(stream, starts, seq)


def eval_batches(stream: torch.Tensor, *, n_batches: int, micro: int, seq: int, rank: int,
                 world: int) -> List[torch.Tensor]:
    """The fixed validation set: ``n_batches * micro * world`` windows evenly spaced over the
    stream, rank ``r`` taking every ``world``-th. Identical for every run and config."""
    if stream.numel() <= seq:
        raise ValueError(f"validation stream has {stream.numel()} tokens, fewer than --seq-len {seq}")
    total = n_batches * micro * world
    starts = torch.linspace(0, stream.numel() - seq - 1, total).long()[rank::world]
    return [_windows(stream, starts[i * micro:(i + 1) * micro], seq) for i in range(n_batches)]


def main() -> None:
    parser = argparse.ArgumentParser(description="Summarize the pretraining corpus (train/validation split)")
    parser.add_argument("--data", nargs="+", help="text/JSONL files or directories, or a saved dataset")
    parser.add_argument("--tokenizer", help="local HF tokenizer directory (default: bytes)")
    parser.add_argument("--text-field", default="text")
    parser.add_argument("--val-fraction", type=float, default=DEFAULT_VAL_FRACTION)
    args = parser.parse_args()
    corpus = build_corpus(args.data, args.tokenizer, val_fraction=args.val_fraction, text_field=args.text_field)
    print(corpus.describe())
    print("validation documents (first 10):", ", ".join(corpus.val_names[:10]))
    sample = corpus.train[:200].tolist()
    print("first train tokens:", repr(make_tokenizer(args.tokenizer).decode(sample))[:300])


if __name__ == "__main__":
    main()
