"""sim.report.outputs.format_summary: the per-device table names each device as the Gantt chart does (a 3D plan's
trace rank and the topology device it ran on) and has no memory column when no memory was measured."""

import pytest

from sim.plan.build import build_plan
from sim.plan.inputs import PlanInputs
from sim.predict import predict_built
from sim.report.gantt import _figure
from sim.report.outputs import format_summary


@pytest.fixture(scope="module")
def three_d():
    """A TP2 × DP2 × PP2 plan on 8 A100s whose pipeline ranks are not devices 0 and 1 (order tp-pp-dp puts pipeline
    rank 1 on device 2): its prediction's trace and metrics."""
    built = build_plan(PlanInputs("gpt:layers=4,hidden=256,heads=4,seq=64,vocab=500", "8xA100", "1f1b",
                                  microbatches=4, tp=2, dp=2, rank_order="tp-pp-dp"))
    prediction = predict_built(built)
    return prediction.trace, prediction.metrics


def _table(summary: str) -> tuple[str, list[str]]:
    """The table's header line and its rows."""
    lines = summary.splitlines()
    at = next(i for i, line in enumerate(lines) if line.startswith("per device"))
    return lines[at], lines[at + 1:]


def test_a_3d_plans_table_names_the_devices_the_chart_names(three_d):
    trace, metrics = three_d
    fig, _ = _figure(trace, "t")
    charted = [label.get_text() for label in fig.axes[0].get_yticklabels()]
    _, rows = _table(format_summary(metrics))
    assert len(rows) == len(charted) == 2
    assert [row[2:].split("  ")[0].rstrip() for row in rows] == charted
    assert [d["device_rank"] for d in metrics["devices"]] == [0, 2]  # so the name says gpu2, not only r1
    assert charted[1].startswith("r1 gpu2 ")


def test_no_memory_column_when_no_memory_was_measured(three_d):
    _, metrics = three_d
    header, rows = _table(format_summary(metrics))
    # GPUs: the allocated peak, then what the caching allocator reserves (sim.cost.allocator), then the capacity
    assert header.endswith("peak memory allocated, reserved / capacity") and all(row.endswith(" GB") for row in rows)
    assert all(f"{d['peak_memory_bytes'] / 1e9:.2f} GB, {d['reserved_memory_bytes'] / 1e9:.2f} GB / " in row
               for d, row in zip(metrics["devices"], rows, strict=True))
    # A measured run without --measure-memory: the devices carry no peak, and the table no column for one.
    unmeasured = {**metrics, "devices": [{k: v for k, v in d.items() if k != "peak_memory_bytes"}
                                         for d in metrics["devices"]]}
    header, rows = _table(format_summary(unmeasured))
    assert "memory" not in header and header.endswith("bubble  exposed")
    assert all(line == line.rstrip() for line in [header, *rows])
    assert [row.split()[-4] for row in rows] == [f"{d['bubble_fraction'] * 100:.1f}" for d in metrics["devices"]]
    assert [row.split()[-2] for row in rows] == [f"{sum(d['exposed_comm_fraction'].values()) * 100:.1f}"
                                                 for d in metrics["devices"]]


def test_the_summary_and_the_charts_title_give_the_time_split(three_d, tmp_path, monkeypatch):
    import sim.report.gantt as gantt
    from sim.report.outputs import write_run_outputs

    trace, metrics = three_d
    exposed = metrics["exposed_comm_fraction"]
    assert exposed["tp"] > 0 and exposed["dp"] > 0  # TP 2 × DP 2: both kinds wait somewhere
    line = next(line for line in format_summary(metrics).splitlines() if line.startswith("device time"))
    assert f"bubble {metrics['bubble_fraction'] * 100:.1f} %" in line
    assert f"TP {exposed['tp'] * 100:.1f} %" in line and f"DP {exposed['dp'] * 100:.1f} %" in line
    assert "EP" not in line  # a kind that was never exposed is left out
    titles = []
    monkeypatch.setattr(gantt, "draw_gantt", lambda trace, path, title: titles.append(title))
    write_run_outputs(tmp_path / "out", trace, metrics, title="plan")
    assert titles == [f"plan · {line.removeprefix('device time').strip()}"]
