"""The example model and data: embedded corpus, char windows, GPT forward/backward, tying, meta init."""

from __future__ import annotations

import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from lightning_zero.demo.data import (
    CORPUS_MODULES,
    FALLBACK_PATH,
    CharDataModule,
    CharTokenizer,
    build_corpus,
    corpus_digest,
    split_blocks,
)
from lightning_zero.demo.gpt import GPT, GPTModule, param_groups, warmup_cosine

REPO_ROOT = Path(__file__).resolve().parents[1]

TINY = dict(vocab_size=50, seq_len=16, n_layer=2, n_head=2, d_model=32)


# ---- corpus ----------------------------------------------------------------------------------------
def test_corpus_is_large_real_english_and_deterministic() -> None:
    text = build_corpus()
    assert len(text.encode("utf-8")) > 50_000
    assert text == build_corpus()
    words = text.lower().split()
    assert words.count("the") > 500 and words.count("of") > 200  # prose, not code or noise
    assert len(set(text)) < 200  # a char vocabulary, not random bytes


def test_corpus_same_in_a_fresh_interpreter() -> None:
    """Another process (other hash seed, other import order) builds the same text."""
    code = "from lightning_zero.demo.data import build_corpus, corpus_digest; print(corpus_digest(build_corpus()))"
    env = {**os.environ, "PYTHONHASHSEED": "12345", "PYTHONPATH": str(REPO_ROOT)}
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, env=env, capture_output=True, text=True,
                         check=True, timeout=120)
    assert out.stdout.strip() == corpus_digest(build_corpus())


def test_corpus_modules_sorted_and_fallback_used_when_missing(caplog: pytest.LogCaptureFixture) -> None:
    assert list(CORPUS_MODULES) == sorted(CORPUS_MODULES)
    text = build_corpus(modules=("no_such_module_lz", "textwrap"))
    assert "skipping no_such_module_lz" in caplog.text
    assert FALLBACK_PATH.read_text(encoding="utf-8").strip() in text  # textwrap alone is below MIN_CHARS
    assert text.startswith(build_corpus(modules=("textwrap",), min_chars=0))


def test_tokenizer_round_trip() -> None:
    tok = CharTokenizer("hello world")
    assert tok.vocab_size == len(set("hello world"))
    assert tok.itos == sorted(tok.itos)
    ids = tok.encode("low hello")
    assert ids.dtype == torch.long and tok.decode(ids) == "low hello"


# ---- datamodule ------------------------------------------------------------------------------------
def _datamodule(**kw) -> CharDataModule:
    args = dict(seq_len=32, batch_size=4, train_windows=64, val_windows=16, seed=7) | kw
    dm = CharDataModule(**args)
    dm.setup("fit")
    return dm


def test_datamodule_shapes_and_targets() -> None:
    dm = _datamodule()
    assert dm.vocab_size == len(set(dm.text))
    x, y = next(iter(dm.train_dataloader()))
    assert x.shape == y.shape == (4, 32) and x.dtype == torch.long
    assert torch.equal(x[:, 1:], y[:, :-1])  # y is x shifted by one token
    assert int(x.max()) < dm.vocab_size
    assert len(dm.train_dataloader()) == 64 // 4
    vx, _ = next(iter(dm.val_dataloader()))
    assert vx.shape == (4, 32)


def test_windows_are_seeded() -> None:
    a, b, c = _datamodule(), _datamodule(), _datamodule(seed=8)
    assert torch.equal(a.train_set.offsets, b.train_set.offsets)
    assert torch.equal(a.val_set.offsets, b.val_set.offsets)
    assert not torch.equal(a.train_set.offsets, c.train_set.offsets)


def test_split_blocks_partitions_the_stream() -> None:
    tokens = torch.arange(1000)
    train, val = split_blocks(tokens, block=100, val_every=5)
    assert len(train) == 800 and len(val) == 200
    assert torch.equal(torch.sort(torch.cat([train, val])).values, tokens)
    assert val[0] == 400  # the 5th block


# ---- model -----------------------------------------------------------------------------------------
def test_forward_backward_on_cpu() -> None:
    torch.manual_seed(0)
    module = GPTModule(**TINY)
    x = torch.randint(0, TINY["vocab_size"], (3, TINY["seq_len"]))
    logits = module(x)
    assert logits.shape == (3, TINY["seq_len"], TINY["vocab_size"])
    loss, _ = module._loss((x, torch.roll(x, -1, dims=1)))
    assert abs(loss.item() - math.log(TINY["vocab_size"])) < 0.5  # near-uniform at init
    loss.backward()
    for name, p in module.named_parameters():
        assert p.grad is not None and torch.isfinite(p.grad).all(), name


def test_attention_is_causal() -> None:
    torch.manual_seed(0)
    model = GPT(**TINY).eval()
    x = torch.randint(0, TINY["vocab_size"], (1, TINY["seq_len"]))
    y = x.clone()
    y[0, -1] = (y[0, -1] + 1) % TINY["vocab_size"]
    # Changing the last token must not change any earlier position's logits.
    torch.testing.assert_close(model(x)[:, :-1], model(y)[:, :-1])


def test_tied_weights_are_one_parameter() -> None:
    tied = GPT(**TINY, tie_embeddings=True)
    untied = GPT(**TINY, tie_embeddings=False)
    assert tied.lm_head.weight is tied.tok_emb.weight
    assert untied.lm_head.weight is not untied.tok_emb.weight
    assert untied.num_params() - tied.num_params() == TINY["vocab_size"] * TINY["d_model"]
    opt = torch.optim.SGD(tied.parameters(), lr=0.1)
    tied(torch.randint(0, TINY["vocab_size"], (2, 8))).sum().backward()
    opt.step()
    assert tied.lm_head.weight is tied.tok_emb.weight  # still one tensor after an update


def test_param_groups_decay_only_linear_matrices() -> None:
    model = GPT(**TINY)
    decay, no_decay = param_groups(model, 0.1)
    assert decay["weight_decay"] == 0.1 and no_decay["weight_decay"] == 0.0
    decay_ids = {id(p) for p in decay["params"]}
    assert id(model.tok_emb.weight) not in decay_ids and id(model.pos_emb.weight) not in decay_ids
    assert id(model.blocks[0].ln_1.weight) not in decay_ids and id(model.blocks[0].attn.qkv.bias) not in decay_ids
    assert id(model.blocks[0].attn.qkv.weight) in decay_ids
    assert all(p.dim() == 2 for p in decay["params"])
    n_grouped = len(decay["params"]) + len(no_decay["params"])
    assert n_grouped == len(list(model.parameters()))  # every parameter once (the tied one too)


def test_meta_device_construction_then_reset_parameters() -> None:
    with torch.device("meta"):
        model = GPT(**TINY)
    assert all(p.is_meta for p in model.parameters())
    model.to_empty(device="cpu")
    model.reset_parameters()
    assert model.lm_head.weight is model.tok_emb.weight  # re-tied (to_empty gives shared tensors separate storage)
    for name, p in model.named_parameters():
        assert torch.isfinite(p).all(), name
    assert 0.01 < model.blocks[0].attn.qkv.weight.std().item() < 0.03
    torch.testing.assert_close(model.blocks[0].ln_1.weight, torch.ones(TINY["d_model"]))
    out = model(torch.randint(0, TINY["vocab_size"], (2, 8)))
    assert torch.isfinite(out).all()


@pytest.mark.parametrize("tie", [True, False])
def test_meta_init_reproduces_eager_init(tie: bool) -> None:
    """Same seed, eager vs meta + to_empty + reset_parameters: identical values (init lives in leaf modules)."""
    torch.manual_seed(3)
    eager = GPT(**TINY, tie_embeddings=tie)
    torch.manual_seed(3)
    with torch.device("meta"):
        meta = GPT(**TINY, tie_embeddings=tie)
    meta.to_empty(device="cpu")
    meta.reset_parameters()
    for (name, a), (_, b) in zip(eager.state_dict().items(), meta.state_dict().items()):
        torch.testing.assert_close(a, b, rtol=0, atol=0, msg=name)


def test_build_in_configure_model() -> None:
    module = GPTModule(**TINY, build_in_configure_model=True)
    assert module.model is None
    module.configure_model()
    first = module.model
    module.configure_model()
    assert module.model is first  # idempotent


def test_warmup_cosine_schedule() -> None:
    f = warmup_cosine(warmup_steps=10, total_steps=110, min_ratio=0.1)
    assert f(0) == pytest.approx(0.1) and f(9) == pytest.approx(1.0)
    assert f(60) == pytest.approx(0.55)
    assert f(110) == pytest.approx(0.1) and f(500) == pytest.approx(0.1)


def test_generate_extends_the_prompt() -> None:
    module = GPTModule(**TINY)
    out = module.generate(torch.zeros(1, 3, dtype=torch.long), 20, top_k=5, generator=torch.Generator().manual_seed(0))
    assert out.shape == (1, 23) and int(out.max()) < TINY["vocab_size"]


def test_fits_with_a_plain_trainer(tmp_path: Path) -> None:
    """The module and data module work with stock Lightning (optimizer groups, scheduler, logging, metric)."""
    import lightning.pytorch as pl

    dm = CharDataModule(seq_len=16, batch_size=4, train_windows=32, val_windows=8)
    module = GPTModule(vocab_size=dm.vocab_size, seq_len=16, n_layer=1, n_head=2, d_model=32)
    trainer = pl.Trainer(accelerator="cpu", devices=1, strategy="auto", max_steps=3, limit_val_batches=2,
                         val_check_interval=3, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False, default_root_dir=tmp_path)
    trainer.fit(module, datamodule=dm)
    metrics = trainer.callback_metrics
    assert {"train/loss", "val/loss", "val/ppl"} <= set(metrics)
    assert math.isfinite(float(metrics["val/loss"]))
    assert float(metrics["val/ppl"]) == pytest.approx(math.exp(float(metrics["val/loss"])), rel=1e-3)
