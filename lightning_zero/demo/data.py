"""A character-level language-modelling dataset that needs no download.

The corpus is real English text that ships with Python: the docstrings of a fixed, sorted list
of pure-Python standard-library modules (the module's own docstring, then those of its public
classes and functions, in name order). It is the same string on every machine with the same
Python minor version, so loss curves are comparable across runs and machines. A module that
cannot be imported is skipped; if the text left is too short, the English text shipped beside
this file (``corpus_fallback.txt``) is appended.
"""

from __future__ import annotations

import hashlib
import importlib
import inspect
import logging
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Optional

import lightning.pytorch as pl
import torch
from torch import Tensor
from torch.utils.data import DataLoader, Dataset

from . import check_settings

__all__ = ["CORPUS_MODULES", "CharDataModule", "CharTokenizer", "WindowDataset", "build_corpus", "corpus_digest"]

log = logging.getLogger(__name__)

# Pure-Python modules only: a C accelerator (pickle, heapq, decimal) or a platform branch (os,
# subprocess) would make the text differ between builds of the same Python version.
CORPUS_MODULES: tuple[str, ...] = tuple(sorted((
    "argparse", "calendar", "cmd", "configparser", "contextlib", "dataclasses", "difflib", "email.message",
    "enum", "fractions", "ftplib", "gettext", "http.client", "http.cookiejar", "imaplib", "inspect",
    "ipaddress", "logging", "mailbox", "optparse", "pprint", "sched", "shlex", "smtplib", "statistics",
    "string", "tarfile", "textwrap", "tokenize", "trace", "typing", "unittest.case", "urllib.parse", "zipfile",
)))
FALLBACK_PATH = Path(__file__).with_name("corpus_fallback.txt")
MIN_CHARS = 50_000  # below this a char model has little to learn; append the shipped text


def _module_docs(name: str) -> Iterable[str]:
    """The docstrings of module ``name`` and of the public classes/functions it defines, in name order."""
    module = importlib.import_module(name)
    yield inspect.getdoc(module) or ""
    for attr in sorted(vars(module)):
        obj = getattr(module, attr)
        # Only objects defined here: re-exported ones would repeat another module's text.
        if attr.startswith("_") or getattr(obj, "__module__", None) != name:
            continue
        if inspect.isclass(obj) or inspect.isfunction(obj):
            yield inspect.getdoc(obj) or ""


def build_corpus(modules: Sequence[str] = CORPUS_MODULES, fallback: Path = FALLBACK_PATH,
                 min_chars: int = MIN_CHARS) -> str:
    """The embedded corpus: docstrings of ``modules`` (see the module docstring), paragraphs joined by blank lines."""
    parts: list[str] = []
    seen: set[str] = set()  # getdoc inherits a base class's docstring; keep each text once
    for name in sorted(modules):
        try:
            docs = list(_module_docs(name))
        except ImportError as err:
            log.warning("corpus: skipping %s (%s)", name, err)
            continue
        for doc in docs:
            if doc and doc not in seen:
                seen.add(doc)
                parts.append(doc)
    text = "\n\n".join(parts)
    if len(text) < min_chars:
        log.warning("corpus: only %d characters from the standard library; appending %s", len(text), fallback.name)
        text = (text + "\n\n" + fallback.read_text(encoding="utf-8")).strip()
    return text


def corpus_digest(text: str) -> str:
    """A short fingerprint to print beside results (equal digests: equal data)."""
    return hashlib.sha256(text.encode("utf-8")).hexdigest()[:16]


class CharTokenizer:
    """Maps each distinct character of a text to an id (sorted by code point, so ids are stable)."""

    def __init__(self, chars: Iterable[str]) -> None:
        self.itos: list[str] = sorted(set(chars))
        self.stoi: dict[str, int] = {c: i for i, c in enumerate(self.itos)}

    @property
    def vocab_size(self) -> int:
        return len(self.itos)

    def encode(self, text: str) -> Tensor:
        """A 1D int64 tensor of ids; characters outside the vocabulary are an error (KeyError)."""
        return torch.tensor([self.stoi[c] for c in text], dtype=torch.long)

    def decode(self, ids: Iterable[int] | Tensor) -> str:
        values = ids.tolist() if isinstance(ids, Tensor) else ids
        return "".join(self.itos[i] for i in values)


class WindowDataset(Dataset):
    """Fixed windows of a token stream: item ``i`` is ``(x, y)``, y being x shifted by one token.

    Args:
        tokens: the 1D token stream.
        offsets: 1D start of each window; ``offsets[i] + seq_len + 1 <= len(tokens)``.
        seq_len: window length.
    """

    def __init__(self, tokens: Tensor, offsets: Tensor, seq_len: int) -> None:
        if offsets.numel() and int(offsets.max()) + seq_len + 1 > tokens.numel():
            raise ValueError("a window runs past the end of the token stream")
        self.tokens, self.offsets, self.seq_len = tokens, offsets, seq_len

    def __len__(self) -> int:
        return self.offsets.numel()

    def __getitem__(self, i: int) -> tuple[Tensor, Tensor]:
        start = int(self.offsets[i])
        chunk = self.tokens[start:start + self.seq_len + 1]
        return chunk[:-1], chunk[1:]


def split_blocks(tokens: Tensor, block: int, val_every: int) -> tuple[Tensor, Tensor]:
    """Every ``val_every``-th block of ``block`` tokens goes to validation, the rest to training.

    Interleaving (rather than holding out the tail) keeps both splits drawn from every module's text,
    while whole blocks keep windows from straddling the two splits except at a few block seams.
    """
    blocks = list(torch.split(tokens, block))
    val = [b for i, b in enumerate(blocks) if i % val_every == val_every - 1]
    train = [b for i, b in enumerate(blocks) if i % val_every != val_every - 1]
    return torch.cat(train), torch.cat(val)


def random_offsets(n_tokens: int, seq_len: int, count: int, generator: torch.Generator) -> Tensor:
    """``count`` window starts drawn uniformly (with replacement) from a stream of ``n_tokens``."""
    high = n_tokens - seq_len - 1
    if high <= 0:
        raise ValueError(f"a split of {n_tokens} tokens is too short for seq_len={seq_len}")
    return torch.randint(0, high, (count,), generator=generator)


def _whole(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


class CharDataModule(pl.LightningDataModule):
    """Train/val windows over the embedded corpus, character-level.

    The corpus and vocabulary are built in ``__init__`` (a fraction of a second, identical on every
    rank) so that ``vocab_size`` is known before the model is constructed.

    Args:
        seq_len: tokens per window.
        batch_size: windows per batch and rank.
        train_windows: windows in one training epoch (across all ranks; Lightning's DistributedSampler
            gives each rank its share, reshuffled every epoch).
        val_windows: windows of the validation set (fixed, drawn once).
        block_chars: size of the blocks that are dealt to train/val (see :func:`split_blocks`).
        val_every: every ``val_every``-th block is validation data (10: a 90/10 split).
        seed: seeds the window offsets; the same seed gives the same windows everywhere.
        num_workers: DataLoader workers (0: windows are slices of a tensor, workers only add start-up time).
        modules: override :data:`CORPUS_MODULES`.
    """

    def __init__(self, seq_len: int = 64, batch_size: int = 16, train_windows: int = 8192, val_windows: int = 256,
                 block_chars: int = 2048, val_every: int = 10, seed: int = 1234, num_workers: int = 0,
                 modules: Optional[Sequence[str]] = None) -> None:
        check_settings("data", {
            "seq_len": (seq_len, _whole(seq_len) and seq_len >= 1, "a whole number of 1 or more"),
            "batch_size": (batch_size, _whole(batch_size) and batch_size >= 1, "a whole number of 1 or more"),
            "train_windows": (train_windows, _whole(train_windows) and train_windows >= 1, "a whole number of 1 or more"),
            "val_windows": (val_windows, _whole(val_windows) and val_windows >= 1, "a whole number of 1 or more"),
            "block_chars": (block_chars, _whole(block_chars) and block_chars >= 1, "a whole number of 1 or more"),
            "val_every": (val_every, _whole(val_every) and val_every >= 2, "a whole number of 2 or more"),
            "num_workers": (num_workers, _whole(num_workers) and num_workers >= 0, "a whole number of 0 or more")})
        super().__init__()
        self.save_hyperparameters()
        self.text = build_corpus(tuple(modules) if modules else CORPUS_MODULES)
        self.tokenizer = CharTokenizer(self.text)
        self.train_set: Optional[WindowDataset] = None
        self.val_set: Optional[WindowDataset] = None

    @property
    def vocab_size(self) -> int:
        return self.tokenizer.vocab_size

    def setup(self, stage: Optional[str] = None) -> None:
        if self.train_set is not None:
            return
        h = self.hparams
        train_tokens, val_tokens = split_blocks(self.tokenizer.encode(self.text), h.block_chars, h.val_every)
        generator = torch.Generator().manual_seed(h.seed)  # CPU generator: same stream on every machine
        self.train_set = WindowDataset(train_tokens, random_offsets(len(train_tokens), h.seq_len,
                                                                    h.train_windows, generator), h.seq_len)
        self.val_set = WindowDataset(val_tokens, random_offsets(len(val_tokens), h.seq_len, h.val_windows,
                                                                generator), h.seq_len)

    def train_dataloader(self) -> DataLoader:
        assert self.train_set is not None, "call setup() first"
        # drop_last: every rank must run the same number of steps (uneven ones would hang in collectives).
        return DataLoader(self.train_set, batch_size=self.hparams.batch_size, shuffle=True, drop_last=True,
                          num_workers=self.hparams.num_workers)

    def val_dataloader(self) -> DataLoader:
        assert self.val_set is not None, "call setup() first"
        return DataLoader(self.val_set, batch_size=self.hparams.batch_size, shuffle=False, drop_last=True,
                          num_workers=self.hparams.num_workers)

    def describe(self) -> str:
        """One line for the log: size, vocabulary and fingerprint of the corpus."""
        return (f"embedded corpus: {len(self.text):,} characters, vocab {self.vocab_size}, "
                f"sha256 {corpus_digest(self.text)} ({len(CORPUS_MODULES)} stdlib modules' docstrings)")
