"""What TensorBoard shows for a run, read back from its event files:
`python -m titanlite.tools.dashboard <dump_folder>/tb[/<run>]`.

Prints the custom-scalars layout: each category, and in it each chart's title and tags with the tag's
description, read through the event loader TensorBoard's own server uses, so the description of the
dashboards in docs/metrics.md and the tests check what a browser would show. Given
the TensorBoard folder itself (`<dump_folder>/tb`), it shows the newest run (the last name: runs are
named in order, docs/metrics.md#runs) and names it on the first line. A folder that does not exist or
holds no events is one line and exit code 2.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass, field

from titanlite.errors import UserError, run_tool


@dataclass
class Scalar:
    display_name: str
    description: str
    values: list[tuple[int, float]] = field(default_factory=list)


@dataclass
class Dashboard:
    layout: dict[str, dict[str, list[str]]]
    """Custom-scalars layout: category -> chart title -> tags."""
    scalars: dict[str, Scalar]
    """Scalar tag -> its display name, description and (step, value) points."""


def read_dashboard(run_dir: str) -> Dashboard:
    """The layout and scalars of one TensorBoard run folder (one trainer start)."""
    from tensorboard.backend.event_processing.plugin_event_accumulator import EventAccumulator
    from tensorboard.plugins.custom_scalar import layout_pb2
    from tensorboard.util import tensor_util

    acc = EventAccumulator(run_dir)
    acc.Reload()
    layout: dict[str, dict[str, list[str]]] = {}
    tags = acc.Tags()["tensors"]
    for tag in tags:
        if acc.SummaryMetadata(tag).plugin_data.plugin_name != "custom_scalars":
            continue
        proto = layout_pb2.Layout()
        proto.ParseFromString(acc.Tensors(tag)[-1].tensor_proto.string_val[0])
        for category in proto.category:
            charts = layout.setdefault(category.title, {})
            for chart in category.chart:
                charts[chart.title] = list(chart.multiline.tag)
    scalars = {}
    for tag in tags:
        meta = acc.SummaryMetadata(tag)
        if meta.plugin_data.plugin_name != "scalars":
            continue
        points = [(e.step, float(tensor_util.make_ndarray(e.tensor_proto))) for e in acc.Tensors(tag)]
        scalars[tag] = Scalar(meta.display_name, meta.summary_description, points)
    if not layout and not scalars:
        raise UserError(f"no TensorBoard events in {run_dir}")
    return Dashboard(layout, scalars)


def newest_run(folder: str) -> str | None:
    """The run folder to show for `folder`: itself when it holds event files, else its newest run
    subfolder that does (the last by name), else None."""
    if any(name.startswith("events.out.tfevents") for name in os.listdir(folder)):
        return folder
    runs = sorted(
        entry.path
        for entry in os.scandir(folder)
        if entry.is_dir() and any(name.startswith("events.out.tfevents") for name in os.listdir(entry.path))
    )
    return runs[-1] if runs else None


def describe(board: Dashboard) -> str:
    """The dashboard in words, as docs/metrics.md shows it."""
    lines = []
    for category, charts in board.layout.items():
        lines.append(f"{category}:")
        for title, tags in charts.items():
            for tag in tags:
                s = board.scalars.get(tag)
                about = f" - {s.description}" if s and s.description else ""
                lines.append(f"  {title}  [{tag}]{about}")
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    if len(argv) != 1 or argv[0] in ("-h", "--help"):
        print(__doc__.strip())
        return 0 if argv and argv[0] in ("-h", "--help") else 2
    folder = argv[0]
    if not os.path.isdir(folder):
        what = "is not a folder" if os.path.exists(folder) else "does not exist"
        raise UserError(f"{folder} {what} (give <dump_folder>/tb or one run folder in it)")
    run = newest_run(folder)
    if run is None:
        raise UserError(f"no TensorBoard events in {folder} or its run folders")
    if run != folder:
        print(f"{os.path.basename(run)} (the newest run in {folder}):")
    print(describe(read_dashboard(run)))
    return 0


if __name__ == "__main__":
    sys.exit(run_tool(main))
