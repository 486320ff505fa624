"""Stage 3 wrap policy: which modules form a gathered group, and which units each one needs.

Pure functions of the module tree (no hooks, no collectives): "what to shard" is decided
here once, "how a group runs" lives in :mod:`lightning_zero.engine.gather`.
"""

from __future__ import annotations

from collections.abc import Callable

from torch import nn

from ..config import ZeroConfigError
from .flat_unit import FlatUnit

__all__ = ["group_modules", "group_lookup", "build_needs", "owner_of", "members_of"]


def group_modules(root: nn.Module, class_names: tuple[str, ...], min_params: int) -> list[nn.Module]:
    """The root plus the modules that form a group of their own, in ``named_modules`` order.

    With ``class_names`` every module of those classes is a group. Otherwise a module with
    children becomes a group once its subtree holds ``min_params`` parameters that no
    deeper group took (leaf layers are never split off, so ``self.head.weight`` used in a
    loss still belongs to an enclosing, gathered group).
    """
    if class_names:
        chosen = [m for m in root.modules() if type(m).__name__ in class_names and m is not root]
        missing = set(class_names) - {type(m).__name__ for m in chosen}
        if missing:
            found = sorted({type(m).__name__ for m in root.modules()})
            raise ZeroConfigError(f"wrap_modules names {sorted(missing)}, which match no module of the model; its module "
                             f"classes are: {', '.join(found)}.")
        for m in chosen:
            if not _has_forward(m):
                raise ZeroConfigError(f"wrap_modules names {type(m).__name__}, which has no forward() (a container such "
                                 f"as ModuleList is iterated, never called), so its parameters would never be "
                                 f"gathered. Name the classes of the modules inside it instead.")
    else:
        chosen = []
        _size_policy(root, min_params, chosen, root)
    chosen_ids = {id(m) for m in chosen}
    return [root] + [m for m in root.modules() if id(m) in chosen_ids]


def _size_policy(module: nn.Module, min_params: int, chosen: list, root: nn.Module) -> int:
    free = sum(p.numel() for p in module.parameters(recurse=False))
    for name, child in module.named_children():
        if is_expert_container(name, child):  # see [Note: conditional groups]
            free += sum(p.numel() for p in child.parameters())
        else:
            free += _size_policy(child, min_params, chosen, root)
    if module is not root and any(True for _ in module.children()) and _has_forward(module) and free >= min_params:
        chosen.append(module)
        return 0
    return free


# [Note: conditional groups]
# A group's gather is a collective: every rank must run the same groups' forwards in the same order. A mixture of
# experts runs only the experts its tokens pick, which differ between ranks: an expert that formed a group of its
# own would be gathered by some ranks only, and they would wait for each other forever (or, with experts of equal
# shapes, exchange each other's pieces). So the size policy never splits a container of experts (a ModuleList or
# ModuleDict whose attribute name says "expert", as in Hugging Face's, fairseq's and Megatron's MoE layers): the
# layer that holds it, which every rank runs, gathers all its experts. Other conditional modules need wrap_modules
# naming the layer that always runs.
def is_expert_container(name: str, module: nn.Module) -> bool:
    return isinstance(module, (nn.ModuleList, nn.ModuleDict)) and "expert" in name.lower()


def _has_forward(module: nn.Module) -> bool:
    """Containers (ModuleList, ModuleDict) are never called: hooks on them would never fire."""
    return type(module).forward is not nn.Module.forward and not isinstance(module, (nn.ModuleList, nn.ModuleDict))


def group_lookup(module: nn.Module, groups: list[nn.Module]) -> Callable[[str], nn.Module]:
    """A function: qualified name (of a parameter or a module) -> the nearest group module above it."""
    prefix_of = {id(m): name for name, m in module.named_modules()}  # a shared module: its first name
    ordered = sorted(((prefix_of[id(g)], g) for g in groups), key=lambda t: -len(t[0]))

    def home(name: str) -> nn.Module:
        return next(g for prefix, g in ordered if prefix == "" or name == prefix or name.startswith(prefix + "."))

    return home


def members_of(module: nn.Module, groups: list[nn.Module]) -> dict[nn.Module, nn.Module]:
    """Each module that owns parameters directly, except group modules -> its nearest group module."""
    home, group_ids = group_lookup(module, groups), {id(g) for g in groups}
    return {m: home(name) for name, m in module.named_modules()
            if id(m) not in group_ids and any(True for _ in m.parameters(recurse=False))}


def build_needs(module: nn.Module, groups: list[nn.Module], unit_of: dict[int, FlatUnit]) -> dict[nn.Module,
                                                                                                    list[FlatUnit]]:
    """group module -> units of every parameter its subtree uses outside nested groups."""
    home = group_lookup(module, groups)
    needs: dict[nn.Module, list[FlatUnit]] = {g: [] for g in groups}
    for name, p in module.named_parameters(remove_duplicate=False):
        unit = unit_of.get(id(p))
        if unit is not None and unit not in needs[home(name)]:
            needs[home(name)].append(unit)
    return needs


def owner_of(module: nn.Module, groups: list[nn.Module]) -> dict[int, nn.Module]:
    """id(parameter) -> the group module that first names it (its unit's home)."""
    home = group_lookup(module, groups)
    return {id(p): home(name) for name, p in module.named_parameters()}
