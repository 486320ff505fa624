"""Bad checkpoint paths and foreign checkpoints: one line naming the path (or key) and the fix."""

from __future__ import annotations

import shutil

import lightning.pytorch as pl
import pytest
import torch
from checkpoint_cases import StepLM, dummy_loader
from torch import nn

import lightning_zero  # noqa: F401
from lightning_zero import ZeroStrategy
from lightning_zero.checkpoint.files import CheckpointPathError


def _trainer(steps: int = 2, **options) -> pl.Trainer:
    return pl.Trainer(accelerator="cpu", devices=1, strategy=ZeroStrategy(stage=2, **options), max_steps=steps,
                      logger=False, enable_checkpointing=False, enable_progress_bar=False,
                      enable_model_summary=False, num_sanity_val_steps=0, limit_val_batches=0)


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    d = tmp_path_factory.mktemp("errors")
    trainer = _trainer()
    trainer.fit(StepLM(), dummy_loader())
    trainer.save_checkpoint(d / "good.ckpt")
    return trainer, d


def _one_line(err: BaseException, *needles: str) -> str:
    message = str(err).strip("'\"")
    assert "\n" not in message, message
    for needle in needles:
        assert needle in message, message
    return message


def test_sharded_save_onto_a_file(saved):
    trainer, d = saved
    (d / "file.ckpt").write_text("x")
    with pytest.raises(CheckpointPathError) as info:
        trainer.save_checkpoint(d / "file.ckpt")
    _one_line(info.value, str(d / "file.ckpt"), "is a file", "checkpoint_format='full'")


def test_full_save_onto_a_directory(tmp_path):
    trainer = _trainer(checkpoint_format="full")
    trainer.fit(StepLM(), dummy_loader())
    (tmp_path / "dir.ckpt").mkdir()
    with pytest.raises(CheckpointPathError) as info:
        trainer.save_checkpoint(tmp_path / "dir.ckpt")
    _one_line(info.value, str(tmp_path / "dir.ckpt"), "is a directory")


def test_unwritable_path(saved):
    trainer, d = saved
    (d / "plain_file").write_text("x")
    target = d / "plain_file" / "sub" / "x.ckpt"  # a file where a directory must be: mkdir fails, even as root
    with pytest.raises(CheckpointPathError) as info:
        trainer.save_checkpoint(target)
    _one_line(info.value, str(target), "writable")


class _Bigger(StepLM):
    def __init__(self) -> None:
        super().__init__()
        self.extra = nn.Linear(4, 4)


class _Smaller(StepLM):
    def __init__(self) -> None:
        super().__init__()
        del self.shared


@pytest.mark.parametrize("model, needle", [(_Bigger, "missing keys ['extra.bias', 'extra.weight']"),
                                           (_Smaller, "unexpected keys ['shared.bias', 'shared.weight']")])
def test_checkpoint_of_another_model(saved, model, needle):
    _, d = saved
    with pytest.raises(KeyError) as info:
        _trainer(steps=3).fit(model(), dummy_loader(), ckpt_path=d / "good.ckpt")
    _one_line(info.value, str(d / "good.ckpt"), needle)


class _Wider(StepLM):
    """The same keys with other sizes: a model built with another hidden width."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(24, 96), nn.Linear(96, 24)


def _checkpoint_in(fmt: str, saved, tmp_path):
    """The saved StepLM checkpoint in format ``fmt``: sharded, full, or sharded consolidated into one file."""
    path = saved[1] / "good.ckpt"
    if fmt == "full":
        path = tmp_path / "full.ckpt"
        writer = _trainer(checkpoint_format="full")
        writer.fit(StepLM(), dummy_loader())
        writer.save_checkpoint(path)
    elif fmt == "consolidated":
        from lightning_zero.checkpoint.export import write_checkpoint

        write_checkpoint(path, tmp_path / "consolidated.ckpt")
        path = tmp_path / "consolidated.ckpt"
    return path


@pytest.mark.parametrize("fmt", ["sharded", "full"])
@pytest.mark.parametrize("stage", [2, 3])
def test_checkpoint_of_other_sizes_names_the_tensors(saved, tmp_path, fmt, stage):
    """torch would print a line per tensor from deep inside the load; one line names the first ones."""
    path = _checkpoint_in(fmt, saved, tmp_path)
    trainer = pl.Trainer(accelerator="cpu", devices=1, strategy=ZeroStrategy(stage=stage), max_steps=3, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                         num_sanity_val_steps=0, limit_val_batches=0)
    with pytest.raises((KeyError, CheckpointPathError)) as info:
        trainer.fit(_Wider(), dummy_loader(), ckpt_path=path)
    _one_line(info.value, str(path), "'fc1.weight'", "(48, 24) there and (96, 24) here")


@pytest.mark.parametrize("damage, needle", [("drop_part", ".distcp is missing"),
                                            ("truncate_part", ".distcp is truncated"),
                                            ("drop_meta", "meta.pt is missing"),
                                            ("only_partial", "did not finish")])
def test_truncated_directory(saved, tmp_path, damage, needle):
    _, d = saved
    broken = tmp_path / "broken.ckpt"
    shutil.copytree(d / "good.ckpt", broken)
    part = sorted(broken.glob("__0_*.distcp"), key=lambda p: p.stat().st_size)[-1]
    if damage == "drop_part":
        part.unlink()
    elif damage == "truncate_part":
        part.write_bytes(part.read_bytes()[: part.stat().st_size // 2])
    elif damage == "drop_meta":
        (broken / "meta.pt").unlink()
    else:
        broken.rename(tmp_path / "broken.ckpt.partial")
    with pytest.raises(CheckpointPathError) as info:
        _trainer(steps=3).fit(StepLM(), dummy_loader(), ckpt_path=broken)
    _one_line(info.value, str(broken), needle)


def test_missing_checkpoint(tmp_path):
    with pytest.raises(CheckpointPathError) as info:
        _trainer(steps=3).fit(StepLM(), dummy_loader(), ckpt_path=tmp_path / "nope.ckpt")
    _one_line(info.value, str(tmp_path / "nope.ckpt"), "does not exist")


def test_checkpoint_format_is_validated():
    with pytest.raises(ValueError) as info:
        ZeroStrategy(checkpoint_format="shards")
    _one_line(info.value, "checkpoint_format", "'sharded'")


def test_full_file_loads_with_mmap(saved, tmp_path, monkeypatch):
    trainer = _trainer(checkpoint_format="full")
    trainer.fit(StepLM(), dummy_loader())
    trainer.save_checkpoint(tmp_path / "one.ckpt")
    seen = {}
    real_load = torch.load

    def spy(*args, **kwargs):
        seen.setdefault("mmap", kwargs.get("mmap"))
        return real_load(*args, **kwargs)

    monkeypatch.setattr(torch, "load", spy)
    _trainer(steps=3).fit(StepLM(), dummy_loader(), ckpt_path=tmp_path / "one.ckpt")
    assert seen["mmap"] is True


@pytest.mark.parametrize("save_last", [True, "link"])
def test_modelcheckpoint_top_k_deletes_directories_and_last_resumes(tmp_path, save_last):
    from lightning.pytorch.callbacks import ModelCheckpoint

    def trainer(steps: int) -> pl.Trainer:
        cb = ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=2, save_top_k=1, monitor="step", mode="max",
                             save_last=save_last)
        return pl.Trainer(accelerator="cpu", devices=1, strategy=ZeroStrategy(stage=3), max_steps=steps, logger=False,
                          callbacks=[cb], enable_progress_bar=False, enable_model_summary=False,
                          num_sanity_val_steps=0, limit_val_batches=0)

    class Logged(StepLM):
        def training_step(self, batch, batch_idx):
            self.log("step", float(self.global_step))
            return super().training_step(batch, batch_idx)

    trainer(6).fit(Logged(), dummy_loader())
    names = sorted(p.name for p in tmp_path.iterdir())
    assert len(names) == 2 and names[0].startswith("epoch=0-step=") and names[1] == "last.ckpt", names
    assert all((tmp_path / n / "meta.pt").is_file() for n in names)  # the older directories were deleted whole
    assert (tmp_path / "last.ckpt").is_symlink() == (save_last == "link")
    resumed = Logged()
    trainer(8).fit(resumed, dummy_loader(), ckpt_path="last")
    assert resumed.seen_steps == [6, 7]


def _overwrite(file, count: int = 4000) -> None:
    """Same size, other bytes: what a bad copy or a flipped disk block leaves."""
    data = bytearray(file.read_bytes())
    start = max(0, len(data) // 2 - count // 2)
    data[start:start + count] = bytes((b ^ 0x5A) for b in data[start:start + count])
    file.write_bytes(bytes(data))


@pytest.mark.parametrize("target", ["part", "meta.pt", ".metadata"])
def test_overwritten_bytes_are_named_not_trained_on(saved, tmp_path, target):
    """The size is right, the bytes are not: the checksum written with the checkpoint names the file
    (without it the weights would load as NaN and training would go on)."""
    _, d = saved
    broken = tmp_path / "broken.ckpt"
    shutil.copytree(d / "good.ckpt", broken)
    file = (sorted(broken.glob("__0_*.distcp"), key=lambda p: p.stat().st_size)[-1] if target == "part"
            else broken / target)
    _overwrite(file, min(4000, file.stat().st_size // 2))
    with pytest.raises(CheckpointPathError) as info:
        _trainer(steps=3).fit(StepLM(), dummy_loader(), ckpt_path=broken)
    _one_line(info.value, str(broken), file.name, "checksum")
    from lightning_zero.consolidate import main as consolidate

    assert consolidate([str(broken), str(tmp_path / "out.ckpt")]) == 2  # the tool checks too


@pytest.mark.parametrize("target", ["meta.pt", ".metadata"])
def test_truncated_small_files_are_named_without_checksums(saved, tmp_path, target):
    """A checkpoint without checksums.json (written before them): a damaged meta.pt / .metadata is still named."""
    _, d = saved
    broken = tmp_path / "broken.ckpt"
    shutil.copytree(d / "good.ckpt", broken)
    (broken / "checksums.json").unlink()
    file = broken / target
    file.write_bytes(file.read_bytes()[: file.stat().st_size // 3])
    with pytest.raises(CheckpointPathError) as info:
        _trainer(steps=3).fit(StepLM(), dummy_loader(), ckpt_path=broken)
    _one_line(info.value, str(broken), target, "damaged")


def test_checkpoint_without_checksums_still_loads(saved, tmp_path):
    _, d = saved
    old = tmp_path / "old.ckpt"
    shutil.copytree(d / "good.ckpt", old)
    (old / "checksums.json").unlink()
    trainer = _trainer(steps=3)
    trainer.fit(StepLM(), dummy_loader(), ckpt_path=old)
    assert trainer.global_step == 3


def test_load_from_checkpoint_reads_a_sharded_directory(tmp_path):
    """LightningModule.load_from_checkpoint(DIR) on our directory: the weights, as from a one-file checkpoint."""
    full = _trainer(checkpoint_format="full")
    full.fit(StepLM(), dummy_loader())
    full.save_checkpoint(tmp_path / "one.ckpt")
    sharded_trainer = _trainer()
    sharded_module = StepLM()
    sharded_trainer.fit(sharded_module, dummy_loader())
    sharded_trainer.save_checkpoint(tmp_path / "dir.ckpt")
    want = sharded_trainer.strategy.full_state_dict()
    loaded = StepLM.load_from_checkpoint(tmp_path / "dir.ckpt")
    got = loaded.state_dict()
    assert sorted(got) == sorted(want) and all(torch.equal(got[k], want[k]) for k in want)
    assert isinstance(StepLM.load_from_checkpoint(tmp_path / "one.ckpt"), StepLM)  # files: Lightning's own path


class _WithSGD(StepLM):
    """The same model and groups, another optimizer class."""

    def configure_optimizers(self):
        decay = [p for p in self.parameters() if p.requires_grad and p.dim() >= 2]
        rest = [p for p in self.parameters() if p.requires_grad and p.dim() < 2]
        return torch.optim.SGD([{"params": decay}, {"params": rest}], lr=self.lr, momentum=0.9)


@pytest.mark.parametrize("fmt", ["sharded", "full", "consolidated"])
def test_optimizer_state_of_another_class_is_refused(saved, tmp_path, fmt):
    """AdamW's exp_avg loaded into an SGD (and its betas into SGD's groups) would resume as neither."""
    path = _checkpoint_in(fmt, saved, tmp_path)
    with pytest.raises(ValueError) as info:
        _trainer(steps=3).fit(_WithSGD(), dummy_loader(), ckpt_path=path)
    _one_line(info.value, "holds AdamW state", "optimizer is SGD", "load_from_checkpoint")
    _trainer(steps=3).fit(StepLM(), dummy_loader(), ckpt_path=path)  # the same class still resumes
