"""``long_run.png`` (``sim.faults.chart``): a long title (a Llama spec, a 3D layout and the run's figures) is wrapped
inside the figure, every character kept, as the Gantt chart's is."""

import re

import sim.faults.chart
from sim.run import main

#: A Llama 3.1 8B spec written out in full is ~140 characters: with the layout and the run's figures, the title
#: overran the 990-pixel figure's edge.
PLAN = ["--model", "llama3.1-8b,seq=4096", "--topology", "8x8xH100", "--tp", "8", "--dp", "8", "--pp", "1",
        "--global-batch", "64", "--zero", "1", "--recompute", "--iterations", "2000", "--mtbf", "4", "--mtbf-scope",
        "cluster", "--fault-trials", "1"]


def test_a_long_title_is_wrapped_inside_the_figure_with_every_character(tmp_path, monkeypatch, capsys):
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    drawn = []

    def keep(fig, dpi=None):  # the figure as it would be written
        drawn.append(fig)
        return b""

    monkeypatch.setattr(sim.faults.chart, "figure_png", keep)
    assert main([*PLAN, "--out", str(tmp_path / "out")]) == 0
    capsys.readouterr()
    (fig,) = drawn
    title = fig.axes[0].title
    renderer = FigureCanvasAgg(fig).get_renderer()
    box = title.get_window_extent(renderer=renderer)
    assert 0 <= box.x0 and box.x1 <= fig.bbox.width and box.y1 <= fig.bbox.height, (box, fig.bbox)
    plan = _plan_title(tmp_path / "out")
    expected = f"{plan} · 2,000 iterations"
    text = title.get_text()
    assert text.count("\n") >= 1  # long enough to need two lines
    assert re.sub(r"\s", "", text).startswith(re.sub(r"\s", "", expected))
    assert re.sub(r"\s", "", text).endswith("seed0")


def _plan_title(out):
    """The Gantt chart's title of the plan written there (the long run's title begins with it)."""
    from sim.ir.plan import Plan
    from sim.report.outputs import plan_title

    return plan_title(Plan.loads((out / "plan.json").read_text()))
