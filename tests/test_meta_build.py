"""Stage 3 builds parameters on the meta device; buffers and hand-initialized parameters keep their values."""

from __future__ import annotations

import pytest
import torch
from dist_utils import run_ranks
from meta_build_cases import SEQ, fit_case, zero_init_case


@pytest.mark.slow
@pytest.mark.parametrize("real_init_bytes, scaled_init", [(0, False), (2**22, False), (2**22, True), (2000, False)],
                         ids=["meta", "real", "real_scaled_init", "real_then_meta"])
def test_a_nanogpt_style_model_in_configure_model_trains_as_under_ddp(real_init_bytes, scaled_init):
    """A causal-mask buffer, a hand-written LayerNorm (torch.ones, no reset_parameters) and a parameter filled
    in __init__: under DDP they are plain values; stage 3's meta build must keep every one of them. Built for real
    (below real_init_bytes), an init in the model's own __init__ (nanoGPT's scaled projections) is kept too; past
    it, the meta parameters continue from the random state where the real ones stopped, as a normal build."""
    ours = run_ranks(fit_case, 2, "zero3", False, real_init_bytes, scaled_init, lightning=True, timeout=180)
    ddp = run_ranks(fit_case, 2, "ddp", False, real_init_bytes, scaled_init, lightning=True, timeout=180)
    for mine, ref in zip(ours, ddp):
        assert mine["losses"] == pytest.approx(ref["losses"], rel=1e-5, abs=1e-6)
    for key, value in ddp[0]["state"].items():
        torch.testing.assert_close(ours[0]["state"][key], value, rtol=1e-5, atol=1e-6, msg=key)


@pytest.mark.slow
def test_a_parameter_drawn_in_init_is_kept_as_rank_0_drew_it():
    """Each rank draws its own value at construction (other seeds); as under DDP, every rank trains from rank 0's
    (lr 0: the values after fit are the initial ones)."""
    r0, r1 = run_ranks(fit_case, 2, "zero3", True, lightning=True, timeout=180)
    assert not torch.equal(r0["drawn"], r1["drawn"])
    assert all(torch.isfinite(torch.tensor(r0["losses"] + r1["losses"])))
    for r in (r0, r1):
        assert torch.equal(r["state"]["net.bump"], r0["drawn"])


def test_zero_init_keeps_buffers_and_refuses_a_parameter_nothing_initializes():
    r0, r1 = run_ranks(zero_init_case, 2, timeout=120)
    assert torch.equal(r0["mask"], torch.tril(torch.ones(SEQ, SEQ)).view(1, SEQ, SEQ))
    assert torch.equal(r0["positions"], torch.arange(SEQ).float().div(SEQ).unsqueeze(-1))
    assert r0["loss"] == r1["loss"] and torch.isfinite(torch.tensor(r0["loss"]))
    for r in run_ranks(zero_init_case, 2, True, timeout=120):
        assert "'bias'" in r["error"] and "reset_parameters() does not set them" in r["error"], r["error"]


class _Drawn(torch.nn.Module):
    """A parameter drawn in __init__ by a module without reset_parameters (a ViT's cls_token)."""

    def __init__(self) -> None:
        super().__init__()
        self.token = torch.nn.Parameter(torch.randn(8) * 0.02)


@pytest.mark.parametrize("middle,warned", [(_Drawn, True), (torch.nn.LayerNorm, False), (torch.nn.Identity, False)])
def test_a_real_draw_during_a_meta_build_is_named(middle, warned):
    """[Note: draws during a meta build]: the meta layers after such a draw cannot get a normal build's values."""
    import warnings

    from lightning_zero.engine.materialize import meta_parameters

    torch.manual_seed(0)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        with meta_parameters(torch.device("cpu"), real_bytes=0):
            torch.nn.Sequential(torch.nn.Linear(8, 8), middle() if middle is _Drawn else middle(8) if middle is
                                torch.nn.LayerNorm else middle(), torch.nn.Linear(8, 8))
    named = [str(w.message) for w in seen if "random numbers were drawn" in str(w.message)]
    assert bool(named) == warned and (not warned or "'_Drawn.token'" in named[0])
