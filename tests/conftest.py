"""Test-session header: which slice of the parity matrix this run checks."""

from __future__ import annotations


def pytest_report_header(config):
    import parity_matrix as pm

    which = pm.chosen_slice()
    cells = pm.cells_of_slice(which)
    shown = "all" if which == "all" else f"{int(which) % pm.SLICES} of 0..{pm.SLICES - 1}"
    return [f"parity matrix: slice {shown} (PARITY_SLICE={which}), {len(cells)} of {len(pm.all_cells())} cells, "
            f"{len(pm.groups(cells))} reference groups"]
