"""The runs of a dump folder: every trainer start that trains is one run, numbered and named so that the
runs written into one dump folder (its metrics.jsonl rows, its TensorBoard folders) can be told apart.

A run is numbered when it starts training, before its first step: one more than the largest number
recorded in the dump folder (`runs.jsonl`, or metrics.jsonl's rows), and recorded at once as a row of
`<dump_folder>/runs.jsonl`, so no two runs share a number, not even one that died before its first
logged step. A start that trains nothing (resumed at `training.steps`, a stop signal before the first
step) is no run: it writes nothing.

A run's name is its number and what differs between the runs of one dump folder: the layout (the mesh
degrees above 1, `1proc` for one process), FSDP2, compilation and the step it resumed from, e.g.
`run003-dp_shard2-tp2-compile-from_step100`. It names the run's TensorBoard folder, `<tb>/<name>`,
which TensorBoard lists in the order of the runs (numbers of three digits).
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass

RUNS_FILE = "runs.jsonl"


def layout_label(mesh: dict[str, int], dp_impl: str, compiled: bool, experts: str = "") -> str:
    """What tells one layout's runs from another's: the mesh degrees above 1 (`dp_shard2-tp2`; `1proc`
    for one process), `experts` (`ep2`, where experts are spread), `fsdp2` and `compile` when set."""
    parts = [f"{name}{degree}" for name, degree in mesh.items() if degree > 1] or ["1proc"]
    if experts:
        parts.append(experts)
    if dp_impl == "fsdp2":
        parts.append("fsdp2")
    if compiled:
        parts.append("compile")
    return "-".join(parts)


@dataclass(frozen=True)
class Run:
    """One run of a dump folder: its layout (`layout_label`), the step it starts after (0, or the
    resumed step), its last step and world size; `number` is set when it is recorded (`numbered`)."""

    layout: str
    from_step: int
    steps: int
    world_size: int
    number: int = 0
    started: str = ""

    def numbered(self, number: int) -> Run:
        return dataclasses.replace(self, number=number, started=time.strftime("%Y-%m-%dT%H:%M:%S%z"))

    @property
    def name(self) -> str:
        resumed = f"-from_step{self.from_step}" if self.from_step else ""
        return f"run{self.number:03d}-{self.layout}{resumed}"

    def row(self) -> dict:
        """Its runs.jsonl row (the `run` number is added by the file)."""
        return dict(
            name=self.name,
            started=self.started,
            from_step=self.from_step,
            steps=self.steps,
            world_size=self.world_size,
            layout=self.layout,
        )
