"""What a rank runs: its set-up, its steps and loop, and how it ends.

`trainer` builds a run (`build`: device, process group, model; `loader`: the data, read once per
data-parallel replica by `replica_batches`; `optimizer`) and runs the loop around `step`'s step runner,
with validation (`validation`). Around the loop: the stop-signal recorder installed first (`signals`),
the agreement of every rank on stop signals and non-finite steps (`resilience`), the progress the
launcher's hang watchdog reads (`progress`), the rank's log (`rank_logging`) and its end under the
launcher (`rank_exit`). The launcher (`titanlite.launcher`) sits above this package and starts the ranks;
nothing here imports it.
"""
