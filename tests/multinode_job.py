"""One "node" of a two-node job, started by torchrun (see test_multinode.py).

    python -m torch.distributed.run --nnodes 2 --nproc-per-node 1 --node-rank R \
        --master-addr 127.0.0.1 --master-port P tests/multinode_job.py STRATEGY OUT_DIR

Trains a tiny LightningModule with ``Trainer(num_nodes=2, devices=1)`` for a few steps and
writes ``OUT_DIR/STRATEGY_rank{R}.pt`` (losses; the final state dict on global rank 0). It
ends like a user's script: it returns after fit and leaves the process group to exit. The last
exit handler (registered first) lists the threads still alive when interpreter finalization
starts in ``OUT_DIR/STRATEGY_rank{R}_threads.txt``.
"""

from __future__ import annotations

import atexit
import os
import sys

import lightning.pytorch as pl
import torch
from dist_utils import trained_state
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import lightning_zero
from lightning_zero import ZeroStrategy

STRATEGIES = {
    "ddp": lambda: "ddp",
    "zero2": lambda: "zero2",  # the registered name, as a user writes it: one bucket
    # several buckets: reduce-scatters in flight while backward runs
    "zero2_buckets": lambda: ZeroStrategy(stage=2, reduce_bucket_size=300),
    # parameters sharded in groups, all-gathers prefetched
    "zero3": lambda: ZeroStrategy(stage=3, reduce_bucket_size=300, min_group_params=200,
                                  param_persistence_threshold=0),
}


class TinyNet(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(17, 16)
        self.blocks = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 16), nn.LayerNorm(16))
        self.head = nn.Linear(16, 17)
        self.losses: list[float] = []

    def training_step(self, batch, batch_idx):
        (idx,) = batch
        logits = self.head(self.blocks(self.emb(idx[:, :-1])))
        loss = nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), idx[:, 1:].reshape(-1))
        self.losses.append(float(loss.detach()))
        self.log("train_loss", loss, sync_dist=True)
        return loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-2, weight_decay=0.1)


def _threads() -> list[str]:
    return sorted(open(f"/proc/self/task/{t}/comm").read().strip() for t in os.listdir("/proc/self/task"))


def main(strategy: str, out_dir: str) -> None:
    assert lightning_zero  # registers "zero2"
    # atexit runs handlers last-in first-out: this one runs after those the Trainer registers
    path = os.path.join(out_dir, f"{strategy}_rank{os.environ['RANK']}_threads.txt")
    atexit.register(lambda: open(path, "w").write("\n".join(_threads())))
    torch.set_num_threads(1)
    pl.seed_everything(0, verbose=False)
    model = TinyNet()
    g = torch.Generator().manual_seed(5)
    data = DataLoader(TensorDataset(torch.randint(0, 17, (32, 7), generator=g)), batch_size=4)  # 4 batches/rank
    trainer = pl.Trainer(accelerator="cpu", devices=1, num_nodes=2, strategy=STRATEGIES[strategy](), max_epochs=1,
                         accumulate_grad_batches=2, gradient_clip_val=0.5, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(model, data)
    rank = trainer.global_rank
    assert trainer.world_size == 2 and trainer.node_rank == rank and trainer.global_step == 2, (
        trainer.world_size, trainer.node_rank, rank, trainer.global_step)
    state = trained_state(trainer, model)  # on every rank: stage 3 gathers
    state = state if rank == 0 else {}
    torch.save({"losses": model.losses, "state": state}, os.path.join(out_dir, f"{strategy}_rank{rank}.pt"))


if __name__ == "__main__":
    main(*sys.argv[1:3])
