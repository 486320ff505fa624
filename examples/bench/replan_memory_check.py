"""Diagnostics: which GPU blocks outlive zero_auto's move (allocation stacks of live blocks)."""
import gc, sys, torch, types
sys.path.insert(0, "/tmp")
import lightning.pytorch as pl
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
    return [lightning_zero.ZeroConfig(stage=2, **off).to_dict(), "t"]
planner.plan_for_run = first
planner.fits_measured = lambda *a, **k: False
from lightning_zero import replan
trainer = pl.Trainer(accelerator="gpu", devices=1, strategy="zero_auto", max_steps=2, logger=False,
                     enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
st = trainer.strategy
class M:
    def start(self, d): pass
    def read(self): return 40 * 2**20
st._replanner.meter = M()
rebuild = st._rebuild_from_host
def hook():
    torch.cuda.synchronize(); print("ALLOCATED", torch.cuda.memory_allocated())
    snap = torch.cuda.memory._snapshot()
    for seg in snap["segments"]:
        for b in seg["blocks"]:
            if b["state"] == "active_allocated" and b["size"] > 50e6:
                print("BLOCK", b["size"]); [print("   ", f["filename"].split("/")[-1], f["line"], f["name"]) for f in b.get("frames", [])[:25]]
    params = {p.untyped_storage().data_ptr() for p in st.lightning_module.parameters()}
    for o in gc.get_objects():
        if isinstance(o, torch.Tensor) and o.untyped_storage().nbytes() > 50e6 and o.untyped_storage().data_ptr() not in params:
            print("BIG", type(o).__name__, tuple(o.shape), o.untyped_storage().nbytes())
            for r in gc.get_referrers(o):
                if isinstance(r, types.FrameType): print("   frame", r.f_code.co_name, r.f_code.co_filename.split('/')[-1], r.f_lineno)
                elif isinstance(r, dict): print("   dict", list(r.keys())[:8])
                else: print("   ", type(r).__name__, str(r)[:100] if not isinstance(r, torch.Tensor) else "")
    rebuild()
st._rebuild_from_host = hook
torch.cuda.memory._record_memory_history(max_entries=100000)
trainer.fit(Wide(), DataLoader(TensorDataset(torch.randn(1024, 512)), batch_size=256))
