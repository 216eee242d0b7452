"""Planning a run before any rank starts: the run plan (`run_plan`), the memory estimate of a parallelized
model (`memory`), and the layout search (`layout_search`) with its models: the layouts a world could use
(`layout_space`), their memory (`layout_memory`) from parameter shapes (`param_shapes`), their step time
(`step_time`; data parallelism's collectives in `data_parallel_time`, a group's link in `link`) on a GPU kind
(`gpus`). The commands and the calibration against published runs are tools (`tools/dry_run.py`,
`tools/layout_search.py`, `tools/calibration.py`)."""
