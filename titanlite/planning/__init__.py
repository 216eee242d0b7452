"""The layout search's models: the layouts a world could use (`layout_space`), their memory from parameter
shapes (`layout_memory`), their step time (`step_time`; data parallelism's collectives in
`data_parallel_time`, a group's link in `link`) on a GPU kind (`gpus`). The search itself and its
calibration against published runs are tools (`tools/layout_search.py`, `tools/calibration.py`)."""
