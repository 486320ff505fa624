"""What is still allocated on the GPU when zero_auto builds its second placement (diagnostic).

The MLP of tests/test_gpu.py under zero_auto, forced to move after its first step (stage 2 on the GPU, then
stage 2 with offload): at the rebuild it prints the allocator's figure, the figure after one small
allocation (frees that wait on stream events are only processed by the next allocation), and the live
blocks over 1 MB with the stack that allocated them.
"""
import gc
import sys
import traceback

import lightning.pytorch as pl
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import lightning_zero
from lightning_zero import planner


class Wide(pl.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(512, 4096), nn.GELU(), nn.Linear(4096, 4096), nn.GELU(), nn.Linear(4096, 1))

    def training_step(self, batch, batch_idx):
        return self.net(batch[0]).pow(2).mean()

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-4)


def first(*a, measured=None, **k):
    off = {} if measured is None else {"offload_optimizer": "cpu"}
    return [lightning_zero.ZeroConfig(stage=2, **off).to_dict(), "probe"]


planner.plan_for_run = first
planner.fits_measured = lambda *a, **k: False
torch.cuda.memory._record_memory_history(max_entries=200000)
trainer = pl.Trainer(accelerator="gpu", devices=1, strategy="zero_auto", max_steps=2, logger=False,
                     enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
st = trainer.strategy
rebuild = st._rebuild_from_host
seen = {}


def at_rebuild():
    torch.cuda.synchronize()
    seen["rebuild"] = torch.cuda.memory_allocated()
    torch.empty(16, device="cuda")
    seen["after_small_alloc"] = torch.cuda.memory_allocated()
    gc.collect()
    seen["after_gc"] = torch.cuda.memory_allocated()
    torch._C._cuda_clearCublasWorkspaces()  # cuBLAS/cuBLASLt workspaces live in the caching allocator
    seen["after_clearing_cublas_workspaces"] = torch.cuda.memory_allocated()
    print("RESIDUE", seen, flush=True)
    for name, param in st.lightning_module.named_parameters():
        print("PARAM", name, param.device, None if param.grad is None else (param.grad.device, param.grad.numel()))
    for obj in gc.get_objects():
        if isinstance(obj, torch.Tensor) and obj.is_cuda and obj.untyped_storage().nbytes() > 1_000_000:
            print("PYTENSOR", tuple(obj.shape), obj.untyped_storage().nbytes(), [type(r).__name__ for r in gc.get_referrers(obj)][:6])
    snap = torch.cuda.memory._snapshot()
    for seg in snap["segments"]:
        for block in seg["blocks"]:
            if block["state"] == "active_allocated" and block["size"] > 1_000_000:
                print(f"LIVE {block['size'] / 1e6:.1f} MB stream {seg.get('stream')}")
                for fr in (block.get("frames") or [])[:40]:
                    name = fr.get("filename", "")
                    if "lightning_zero" in name or "torch/autograd" in name or "lightning/" in name or "residue" in name:
                        print(f"    {name.split('site-packages/')[-1]}:{fr.get('line')} {fr.get('name')}")
    sys.stdout.flush()
    rebuild()


st._rebuild_from_host = at_rebuild
gc.disable()
try:
    trainer.fit(Wide(), DataLoader(TensorDataset(torch.randn(1024, 512)), batch_size=256))
except Exception:
    traceback.print_exc()
gc.enable()
