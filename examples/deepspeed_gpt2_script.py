"""A GPT-2 training script written for DeepSpeed, run on lightning_zero with its import line changed.

Everything below is DeepSpeed's API as its tutorials use it (argparse flags, ``init_distributed``,
``zero.Init``, ``initialize`` with ``training_data``, ``model_engine.train()``, ``backward``/``step``,
``save_checkpoint`` with client state, ``load_checkpoint`` to resume, ``save_16bit_model``); only the
import says ``lightning_zero``. With ``import deepspeed`` instead it runs on DeepSpeed unchanged.

    torchrun --nproc_per_node 2 examples/deepspeed_gpt2_script.py --deepspeed \\
        --deepspeed_config examples/ds_config_gpt2.json --tiny --save_dir /tmp/gpt2_ds   # CPU: 2 gloo ranks
    python examples/deepspeed_gpt2_script.py --deepspeed_config examples/ds_config_gpt2.json --tiny   # 1 process

Run it again with the same ``--save_dir`` and it resumes from the last epoch it saved. Needs
``transformers`` (the ``hf`` extra).
"""

import argparse

import torch
from transformers import GPT2Config, GPT2LMHeadModel

import lightning_zero as deepspeed  # was: import deepspeed


class RandomWindows(torch.utils.data.Dataset):
    """Token windows in which each token repeats the one two places back: a pattern GPT-2 learns fast."""

    def __init__(self, count, length=64, vocab=256, seed=0):
        g = torch.Generator().manual_seed(seed)
        self.data = torch.randint(0, vocab, (count, length), generator=g)
        self.data[:, 2:] = self.data[:, :-2].clone()

    def __len__(self):
        return len(self.data)

    def __getitem__(self, i):
        return self.data[i]


def get_args():
    parser = argparse.ArgumentParser(description="GPT-2 with DeepSpeed")
    parser.add_argument("--local_rank", type=int, default=-1, help="local rank passed from distributed launcher")
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--tiny", action="store_true", help="2 layers x 64 (a CPU run) instead of GPT-2 small")
    parser.add_argument("--save_dir", default="checkpoints_gpt2")
    parser.add_argument("--export_dir", default=None, help="save_16bit_model here at the end")
    parser.add_argument("--zero_init", action="store_true", help="build the model under deepspeed.zero.Init")
    parser = deepspeed.add_config_arguments(parser)
    return parser.parse_args()


def evaluate(model_engine, data):
    model_engine.eval()
    loader = torch.utils.data.DataLoader(data, batch_size=8)
    total, count = 0.0, 0
    with torch.no_grad():
        for batch in loader:
            batch = batch.to(model_engine.device)
            total += model_engine(input_ids=batch, labels=batch).loss.item()
            count += 1
    model_engine.train()
    return total / count


def main():
    args = get_args()
    deepspeed.init_distributed()
    size = dict(n_layer=2, n_embd=64, n_head=2) if args.tiny else dict(n_layer=12, n_embd=768, n_head=12)
    config = GPT2Config(vocab_size=256, n_positions=64, bos_token_id=0, eos_token_id=0, **size)
    torch.manual_seed(0)
    with deepspeed.zero.Init(config_dict_or_path=args.deepspeed_config, enabled=args.zero_init):
        model = GPT2LMHeadModel(config)

    model_engine, optimizer, train_loader, lr_scheduler = deepspeed.initialize(
        args=args, model=model, model_parameters=model.parameters(), training_data=RandomWindows(256))
    eval_data = RandomWindows(32, seed=1)

    load_path, client_state = model_engine.load_checkpoint(args.save_dir)
    start_epoch = client_state["epoch"] + 1 if load_path is not None else 0
    if load_path is not None and model_engine.global_rank == 0:
        print(f"resumed from {load_path} at epoch {start_epoch} (global step {model_engine.global_steps})", flush=True)

    model_engine.train()
    for epoch in range(start_epoch, args.epochs):
        for step, batch in enumerate(train_loader):
            batch = batch.to(model_engine.device)
            outputs = model_engine(input_ids=batch, labels=batch)
            model_engine.backward(outputs.loss)
            model_engine.step()
            if model_engine.global_rank == 0 and step % 20 == 0:
                print(f"epoch {epoch} step {step} loss {outputs.loss.item():.4f} lr {model_engine.get_lr()[0]:.2e}",
                      flush=True)
        eval_loss = evaluate(model_engine, eval_data)
        if model_engine.global_rank == 0:
            print(f"epoch {epoch} eval loss {eval_loss:.4f} global step {model_engine.global_steps} "
                  f"grad norm {model_engine.get_global_grad_norm():.3f}", flush=True)
        model_engine.save_checkpoint(args.save_dir, client_state={"epoch": epoch, "eval_loss": eval_loss})

    if args.export_dir:
        model_engine.save_16bit_model(args.export_dir, "pytorch_model.bin")


if __name__ == "__main__":
    main()
