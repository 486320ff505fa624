"""Blocks compiled in configure_model (``block.compile()``) under every stage, against eager DDP."""

from __future__ import annotations

import lightning.pytorch as pl
from dist_utils import trained_state
from model_zoo import ZooLM, zoo_data, zoo_strategy

import lightning_zero

REF = "ddp_find_unused_parameters_true"


class CompiledLM(ZooLM):
    def __init__(self, backend: str) -> None:
        super().__init__("plain")
        self.backend = backend

    def configure_model(self) -> None:
        for block in self.blocks:
            block.compile(backend=self.backend)


def compiled_case(rank: int, world: int, runs: list[tuple[str, str]]) -> dict:
    """runs: (strategy, backend); backend "" trains the eager model."""
    assert lightning_zero
    out = {}
    for strategy, backend in runs:
        pl.seed_everything(0, verbose=False)
        module = CompiledLM(backend) if backend else ZooLM("plain")
        trainer = pl.Trainer(accelerator="cpu", devices=world, strategy=zoo_strategy(strategy), max_epochs=1,
                             logger=False, enable_checkpointing=False, enable_progress_bar=False,
                             enable_model_summary=False)
        trainer.fit(module, zoo_data())
        out[(strategy, backend)] = {"losses": module.losses, "global_step": trainer.global_step,
                                    "state": trained_state(trainer, module)}
    return out


class WholeCompiledLM(ZooLM):
    """The user compiles the whole forward (every block inside one compiled function) while the strategy's
    ``activation_checkpointing`` checkpoints each Block."""

    def __init__(self, backend: str) -> None:
        super().__init__("plain")
        self.backend = backend
        self._compiled = None

    def configure_model(self) -> None:
        import torch

        self._compiled = torch.compile(super().forward, backend=self.backend)

    def forward(self, idx):
        return self._compiled(idx)


def whole_compiled_checkpointed_case(rank: int, world: int, runs: list[tuple[str, str]]) -> dict:
    """runs: (strategy, backend); backend "" trains the eager model without checkpointing (the reference)."""
    assert lightning_zero
    out = {}
    for strategy, backend in runs:
        pl.seed_everything(0, verbose=False)
        module = WholeCompiledLM(backend) if backend else ZooLM("plain")
        options = {"activation_checkpointing": ("Block",)} if backend else {}
        trainer = pl.Trainer(accelerator="cpu", devices=world, strategy=zoo_strategy(strategy, **options),
                             max_epochs=1, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                             enable_model_summary=False)
        trainer.fit(module, zoo_data())
        out[(strategy, backend)] = {"losses": module.losses, "global_step": trainer.global_step,
                                    "state": trained_state(trainer, module)}
    return out
