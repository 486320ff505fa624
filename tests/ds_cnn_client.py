"""A DeepSpeed client in the style of DeepSpeedExamples' training/cifar/cifar10_deepspeed.py, with the import line
changed; started by tests/test_deepspeed_scripts.py under torchrun (2 CPU ranks).

    torchrun --nproc_per_node 2 tests/ds_cnn_client.py --stage 2 [--offload] --out DIR

Trains a small CNN on synthetic CIFAR-shaped data with a JSON-built Adam, WarmupLR and clipping, evaluates,
saves with client state, loads the checkpoint into a fresh engine (same eval loss, then the same next steps as
the engine that saved it), and on rank 0 rebuilds the model from ``zero_to_fp32``. Writes DIR/result_RANK.json.
"""

import argparse
import json
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F

import lightning_zero as deepspeed  # was: import deepspeed


def add_argument():
    parser = argparse.ArgumentParser(description="CIFAR")
    parser.add_argument("--local_rank", type=int, default=-1, help="local rank passed from distributed launcher")
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--stage", type=int, default=0, help="ZeRO stage")
    parser.add_argument("--offload", action="store_true", help="ZeRO-Offload of the optimizer to the CPU")
    parser.add_argument("--out", required=True)
    parser = deepspeed.add_config_arguments(parser)
    return parser.parse_args()


class SyntheticCIFAR(torch.utils.data.Dataset):
    """CIFAR-shaped images: one fixed pattern per class under noise. Learnable in a few dozen steps, no download."""

    def __init__(self, count, seed):
        g = torch.Generator().manual_seed(seed)
        patterns = torch.randn(10, 3, 32, 32, generator=torch.Generator().manual_seed(123))
        self.labels = torch.randint(0, 10, (count,), generator=g)
        self.images = patterns[self.labels] + 2.0 * torch.randn(count, 3, 32, 32, generator=g)

    def __len__(self):
        return len(self.images)

    def __getitem__(self, i):
        return self.images[i], self.labels[i]


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(3, 6, 5)
        self.pool = nn.MaxPool2d(2, 2)
        self.conv2 = nn.Conv2d(6, 16, 5)
        self.bn = nn.BatchNorm2d(16)
        self.fc1 = nn.Linear(16 * 5 * 5, 120)
        self.fc2 = nn.Linear(120, 84)
        self.fc3 = nn.Linear(84, 10)

    def forward(self, x):
        x = self.pool(F.relu(self.conv1(x)))
        x = self.pool(F.relu(self.bn(self.conv2(x))))
        x = torch.flatten(x, 1)
        x = F.relu(self.fc1(x))
        x = F.relu(self.fc2(x))
        return self.fc3(x)


def ds_config(args):
    return {
        "train_batch_size": 16,
        "steps_per_print": 2000,
        "optimizer": {"type": "Adam", "params": {"lr": 0.001, "betas": [0.8, 0.999], "eps": 1e-8, "weight_decay": 3e-7}},
        "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": 0, "warmup_max_lr": 0.001,
                                                     "warmup_num_steps": 10}},
        "gradient_clipping": 1.0,
        "prescale_gradients": False,
        "bf16": {"enabled": False},
        "fp16": {"enabled": False, "fp16_master_weights_and_grads": False, "loss_scale": 0, "loss_scale_window": 500,
                 "hysteresis": 2, "min_loss_scale": 1, "initial_scale_power": 15},
        "wall_clock_breakdown": False,
        "zero_optimization": {"stage": args.stage, "allgather_partitions": True, "reduce_scatter": True,
                              "allgather_bucket_size": 50000000, "reduce_bucket_size": 50000000, "overlap_comm": True,
                              "contiguous_gradients": True, "cpu_offload": args.offload},
    }


def evaluate(engine, data):
    engine.eval()
    total, count = 0.0, 0
    with torch.no_grad():
        for images, labels in torch.utils.data.DataLoader(data, batch_size=25):
            total += F.cross_entropy(engine(images.to(engine.device)), labels.to(engine.device), reduction="sum").item()
            count += len(labels)
    engine.train()
    return total / count


def train_steps(engine, batches):
    losses = []
    for images, labels in batches:
        loss = F.cross_entropy(engine(images.to(engine.device)), labels.to(engine.device))
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return losses


def main():
    args = add_argument()
    deepspeed.init_distributed()
    torch.manual_seed(0)
    trainset, testset = SyntheticCIFAR(320, seed=1), SyntheticCIFAR(100, seed=2)
    net = Net()
    parameters = filter(lambda p: p.requires_grad, net.parameters())
    model_engine, optimizer, trainloader, _ = deepspeed.initialize(args=args, model=net, model_parameters=parameters,
                                                                   training_data=trainset, config=ds_config(args))
    rank = model_engine.global_rank
    first_eval = evaluate(model_engine, testset)
    losses = []
    for _epoch in range(args.epochs):
        for images, labels in trainloader:
            losses += train_steps(model_engine, [(images, labels)])
    eval_loss = evaluate(model_engine, testset)
    ckpt = Path(args.out) / "ckpt"
    model_engine.save_checkpoint(str(ckpt), client_state={"epoch": args.epochs, "eval_loss": eval_loss})

    torch.manual_seed(5)  # a fresh engine starts from other values: the checkpoint must bring everything back
    fresh, _, _, _ = deepspeed.initialize(args=args, model=Net(), model_parameters=None,
                                          config=ds_config(args))
    load_path, client_state = fresh.load_checkpoint(str(ckpt))
    fresh_eval = evaluate(fresh, testset)
    g = torch.Generator().manual_seed(100 + rank)
    more = [(torch.randn(8, 3, 32, 32, generator=g), torch.randint(0, 10, (8,), generator=g)) for _ in range(3)]
    continued, resumed = train_steps(model_engine, more), train_steps(fresh, more)
    result = {"rank": rank, "world": model_engine.world_size, "stage": model_engine.zero_optimization_stage(),
              "first_eval": first_eval, "eval": eval_loss, "fresh_eval": fresh_eval, "losses": losses,
              "load_path": load_path, "client_state": client_state, "continued": continued, "resumed": resumed,
              "global_steps": [model_engine.global_steps, fresh.global_steps],
              "lr": [model_engine.get_lr()[0], fresh.get_lr()[0]],
              "micro_batch": model_engine.train_micro_batch_size_per_gpu(),
              "grad_norm": model_engine.get_global_grad_norm(), "optimizer": type(optimizer).__name__,
              "weight_decay": optimizer.param_groups[0]["weight_decay"]}
    if rank == 0:
        from lightning_zero.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

        plain = Net()
        plain.load_state_dict(get_fp32_state_dict_from_zero_checkpoint(str(ckpt)), strict=True)
        result["fp32_eval"] = evaluate_plain(plain, testset)
    (Path(args.out) / f"result_{rank}.json").write_text(json.dumps(result))


def evaluate_plain(model, data):
    model.eval()
    total = 0.0
    with torch.no_grad():
        for images, labels in torch.utils.data.DataLoader(data, batch_size=25):
            total += F.cross_entropy(model(images), labels, reduction="sum").item()
    return total / len(data)


if __name__ == "__main__":
    main()
