"""The delayed host step's rule in plain PyTorch, without lightning_zero: the demo GPT (gpt_tiny) on the embedded corpus,
exact AdamW against ZeRO-Offload's delayed parameter update (from step ``--start`` on, step t's update reaches the
weights forward uses one step late), at several learning rates. Tells what the rule itself costs from what an
implementation of it might: tests/test_delayed_step.py checks that ``delayed_step=True`` follows this rule.

    python examples/bench/stale_rule_sim.py --lrs 3e-3 1e-3 3e-4 --steps 200
"""

from __future__ import annotations

import argparse
import copy

import torch
import torch.nn.functional as F
from torch import nn

from lightning_zero.demo.data import CharDataModule
from lightning_zero.demo.gpt import GPT, param_groups, warmup_cosine


def train(base: GPT, data: CharDataModule, lr: float, steps: int, start: int | None, clip: float) -> float:
    """Validation loss after ``steps`` steps; ``start``: the first delayed step (None: exact throughout)."""
    torch.manual_seed(1)  # the loader's shuffle
    model, master = copy.deepcopy(base), copy.deepcopy(base)  # what forward uses / what the optimizer steps
    holder = nn.Module()
    holder.model = master
    opt = torch.optim.AdamW(param_groups(holder, 0.1), lr=lr, betas=(0.9, 0.95))
    sched = torch.optim.lr_scheduler.LambdaLR(opt, warmup_cosine(max(1, steps // 10), steps, 0.1))
    batches = iter(data.train_dataloader())
    pending = None
    for k in range(steps):
        x, y = next(batches)
        model.zero_grad()
        F.cross_entropy(model(x).flatten(0, 1), y.flatten()).backward()
        if clip:
            nn.utils.clip_grad_norm_(model.parameters(), clip)
        if pending is not None:  # the previous update reaches the weights now, after this backward
            model.load_state_dict(pending)
            pending = None
        for m, p in zip(master.parameters(), model.parameters()):
            m.grad = p.grad.clone()
        opt.step()
        sched.step()
        if start is None or k < start:
            model.load_state_dict(master.state_dict())
        else:
            pending = copy.deepcopy(master.state_dict())
    model.load_state_dict(master.state_dict())
    with torch.no_grad():
        losses = [F.cross_entropy(model(x).flatten(0, 1), y.flatten()).item() for x, y in data.val_dataloader()]
    return sum(losses) / len(losses)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--lrs", type=float, nargs="+", default=[3e-3, 1e-3, 3e-4])
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--start", type=int, default=1, help="first delayed step (1: from the second step on)")
    ap.add_argument("--clip", type=float, default=1.0)
    args = ap.parse_args()
    torch.manual_seed(0)
    data = CharDataModule()
    data.setup()
    base = GPT(data.vocab_size, 64, 4, 4, 256, 0.0, True)
    for lr in args.lrs:
        exact = train(base, data, lr, args.steps, None, args.clip)
        stale = train(base, data, lr, args.steps, args.start, args.clip)
        print(f"lr {lr:g}: validation loss after {args.steps} steps: exact {exact:.4f}, one step stale from step "
              f"{args.start + 1} {stale:.4f} ({(stale - exact) / exact:+.1%})", flush=True)


if __name__ == "__main__":
    main()
