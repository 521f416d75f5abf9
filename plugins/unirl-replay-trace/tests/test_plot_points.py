"""The one helper both plots (``unirl trace replay`` and ``unirl trace calibrate``) scatter through:
a log-log axis can show only points with both coordinates above 0, so the helper keeps exactly those."""

from __future__ import annotations

import pytest

from unirl_replay_trace.output import pyplot, scatter_positive


def test_scatter_keeps_the_points_a_log_axis_can_show():
    plt = pyplot()
    if plt is None:  # matplotlib is in the dev stack; without it neither plot is drawn at all
        pytest.fail("matplotlib missing: the plots this helper draws cannot be checked")
    fig, ax = plt.subplots()
    try:
        drawn = scatter_positive(ax, [(10.0, 12.0), (0.0, 5.0), (3.0, 0.0), (4.0, None), (-1.0, 2.0), (7.0, 6.5)],
                                 marker="o")
        assert drawn == [10.0, 12.0, 7.0, 6.5]
        assert [tuple(p) for p in ax.collections[0].get_offsets()] == [(10.0, 12.0), (7.0, 6.5)]
        assert scatter_positive(ax, [(0.0, 1.0)]) == [] and len(ax.collections) == 1  # nothing drawn: no artist
    finally:
        plt.close(fig)
