#!/usr/bin/env bash
# Launch titanlite training: titanlite/launcher/launch.py (torch's elastic agent, torchrun's options) starts the
# ranks of this node. SIGTERM, SIGUSR1 or Ctrl-C stop every rank at the next step with a checkpoint
# (exit 0; Ctrl-C twice: at once, exit 130); before any rank started (the set-up, the launcher's imports)
# they are one line and exit 128 + signal; a rank's error is printed once (exit 2 bad input, 3
# divergence, 1 crash); if the launcher is killed, its ranks die with it.
#
#   ./run_train.sh [--config FILE] [--dry-run | --plan] [--section.key value ...]
#   ./run_train.sh --help                       every config key: type, default, description
#   ./run_train.sh --job.print_config           the merged config as JSON; nothing is launched
#
# --dry-run (or comm.mode = "fake_backend"): no torchrun; one CPU process plans the memory per GPU of a
# world of NGPU x NNODES ranks (titanlite/tools/dry_run.py). When NGPU is unset (even on a GPU node),
# the config's comm.fake_world_size is planned for (the 70B/405B configs name their intended size), else
# the visible GPUs (or 2) x NNODES.
# --plan: the same world, searched for the fastest parallel layout that fits (titanlite/tools/layout_search.py,
# --layout_search.gpu h100|h200|a100|b200|...): a ranked table and <dump_folder>/plan.toml, no torchrun.
#
# Environment:
#   NGPU         processes per node (default: the CUDA GPUs torch sees, honouring CUDA_VISIBLE_DEVICES;
#                without any, 2 CPU processes). Where the node has GPUs (nvidia-smi, SLURM) that torch
#                cannot use, nothing starts: one line, exit code 2
#   TITANLITE_DEVICE=cpu   train on CPU on purpose, also on a GPU node (the GPUs are hidden from the ranks)
#   NUMA_BINDING torch's --numa-binding for the ranks (node, socket, exclusive, core-complex; default none)
#   NNODES       number of nodes (default 1); NODE_RANK is implied by torchrun's c10d rendezvous
#   RDZV_ENDPOINT / MASTER_ADDR:MASTER_PORT   rendezvous host:port for multi-node (default localhost:29500)
#   RDZV_ID      job id shared by all nodes (default titanlite)
#   LOG_RANK     comma-separated local ranks whose output is shown (default 0)
#   MAX_RESTARTS restarts after a failure (default: comm.max_restarts from the config, else 0)
#   DRY_LAUNCH   1 = after the preflight, print the launch command line instead of running it
#   NCCL_SOCKET_IFNAME / GLOO_SOCKET_IFNAME   the network interfaces NCCL / gloo use (passed to every rank
#                as is; a name this node lacks: one line, exit code 2; docs/multinode.md)
# A stop signal before the launcher runs (the set-up, the config check, counting the GPUs) prints this line
# (after "titanlite: SIG<NAME> "), as the launcher does after, and exits 128 + signal: from the script's first
# command on through these traps, then through scripts/env.sh's (which also end the child being waited for).
TITANLITE_STOPPED="before any rank started: nothing was trained"
trap 'echo "titanlite: SIGINT $TITANLITE_STOPPED" >&2; exit 130' INT
trap 'echo "titanlite: SIGTERM $TITANLITE_STOPPED" >&2; exit 143' TERM
trap 'echo "titanlite: SIGUSR1 $TITANLITE_STOPPED" >&2; exit 138' USR1
set -euo pipefail
# The script's folder without a subshell ($(dirname ...) would run without these traps).
_here=${BASH_SOURCE[0]%/*}
[ "$_here" != "${BASH_SOURCE[0]}" ] || _here=.
source "$_here/scripts/env.sh"

CONFIG="$TITANLITE_ROOT/train_configs/debug_model.toml"
ARGS=()
DRY_RUN=0
PLAN=0
# The environment and the command line are input too: one line and exit code 2 before anything starts.
bad_env() { echo "titanlite: error: $1" >&2; exit 2; }
while [ $# -gt 0 ]; do
  case "$1" in
    --config) [ $# -ge 2 ] && [ -n "$2" ] && [[ "$2" != --* ]] || bad_env "--config needs a TOML file"
              CONFIG="$2"; shift 2 ;;
    --config=*) CONFIG="${1#--config=}"; [ -n "$CONFIG" ] || bad_env "--config needs a TOML file"; shift ;;
    --dry-run) DRY_RUN=1; shift ;;
    --plan) PLAN=1; shift ;;
    -h|--help) exec "$PYTHON" -m titanlite.config --help ;;
    *) ARGS+=("$1"); shift ;;
  esac
done

# A folder is not a config (the loader reports a missing file itself, in one line).
[ -d "$CONFIG" ] && bad_env "--config $CONFIG is a folder; give a TOML file such as train_configs/debug_model.toml"

# NGPU given by the user; a dry run plans for it (x NNODES) instead of the config's comm.fake_world_size.
GIVEN_NGPU=${NGPU:-}
[ -z "$GIVEN_NGPU" ] || [[ "$GIVEN_NGPU" =~ ^[1-9][0-9]*$ ]] \
  || bad_env "NGPU must be a positive integer (processes per node), got '$GIVEN_NGPU'"
NNODES=${NNODES:-1}
LOG_RANK=${LOG_RANK:-0}
[[ "$NNODES" =~ ^[1-9][0-9]*$ ]] || bad_env "NNODES must be a positive integer, got '$NNODES'"
[[ "$LOG_RANK" =~ ^[0-9]+(,[0-9]+)*$ ]] || bad_env "LOG_RANK must be comma-separated local ranks such as 0,1, got '$LOG_RANK'"
[[ "${MAX_RESTARTS:-0}" =~ ^[0-9]+$ ]] || bad_env "MAX_RESTARTS must be a non-negative integer, got '$MAX_RESTARTS'"

# comm.mode = "fake_backend" can only come from the config file or an override that names it: the
# config is parsed (a second or so) only then.
if [ "$DRY_RUN" = 0 ] && { grep -qs fake_backend "$CONFIG" || [[ "${ARGS[*]-}" == *fake_backend* ]]; }; then
  MODE=$("$PYTHON" -c 'import sys; from titanlite.config import load_config; print(load_config(sys.argv[1:]).comm.mode)' \
           --config "$CONFIG" "${ARGS[@]+"${ARGS[@]}"}" 2>/dev/null || true)
  [ "$MODE" = fake_backend ] && DRY_RUN=1
fi
# Ranks per node: NGPU, else the CUDA GPUs torch sees (CUDA_VISIBLE_DEVICES, MIG; not nvidia-smi's lines),
# else 2 CPU processes. A launch refuses a node whose GPUs torch cannot use (a CPU build of torch) unless
# TITANLITE_DEVICE=cpu says CPU on purpose, which also hides the GPUs from the ranks:
# titanlite/tools/visible_gpus.py. A dry run or a plan runs on any machine.
# Counting the GPUs imports a CUDA build of torch (seconds): the config is checked first, so a mistyped key
# is one line at once (with NGPU given, the launcher checks it before importing torch).
# Both run in the background (_titanlite_run, scripts/env.sh): a stop signal meanwhile is one line.
[ -n "$GIVEN_NGPU" ] || _titanlite_run "$PYTHON" -m titanlite.config --config "$CONFIG" "${ARGS[@]+"${ARGS[@]}"}"
CHECK=()
{ [ "$DRY_RUN" = 1 ] || [ "$PLAN" = 1 ]; } && CHECK=(--no-check)
_titanlite_run "$PYTHON" -m titanlite.tools.visible_gpus ${GIVEN_NGPU:+--ngpu "$GIVEN_NGPU"} "${CHECK[@]+"${CHECK[@]}"}"
NGPU=$_TITANLITE_STDOUT
[ "${TITANLITE_DEVICE:-}" = cpu ] && export CUDA_VISIBLE_DEVICES=""
# The launcher and the tools start with the stop signals blocked (coreutils' env, 8.31 and later): one that
# comes before their handlers exist (titanlite/run/signals.py, titanlite/errors.py) waits for them
# instead of killing the process.
BLOCKED=()
env --block-signal=INT true 2>/dev/null && BLOCKED=(env --block-signal=INT,TERM,USR1)
if [ "$DRY_RUN" = 1 ] || [ "$PLAN" = 1 ]; then
  # NGPU x NNODES when the user set NGPU; else the config's comm.fake_world_size, else WORLD_SIZE.
  FAKE_WORLD=()
  [ -n "$GIVEN_NGPU" ] && FAKE_WORLD=(--comm.fake_world_size $((NGPU * NNODES)))
  TOOL=titanlite.tools.dry_run
  [ "$PLAN" = 1 ] && TOOL=titanlite.tools.layout_search
  # Started with the stop signals blocked, as the launcher is: the tool's handlers (titanlite/errors.py,
  # run_tool) take one sent while it imports, and it reports the signal in this script's words.
  export TITANLITE_STOPPED
  WORLD_SIZE=$((NGPU * NNODES)) exec "${BLOCKED[@]+"${BLOCKED[@]}"}" "$PYTHON" -m "$TOOL" --config "$CONFIG" \
    "${FAKE_WORLD[@]+"${FAKE_WORLD[@]}"}" "${ARGS[@]+"${ARGS[@]}"}"
fi

# Validate the config, mesh and paths in one process first: bad input is one line and exit code 2,
# before any rank starts.
# The launcher runs the preflight itself (bad input: one line, exit code 2, before any rank starts) and
# takes comm.max_restarts from the config unless MAX_RESTARTS is set. DRY_LAUNCH runs it here.
RESTARTS=()
if [ "${DRY_LAUNCH:-0}" = 1 ]; then
  if [ -z "${MAX_RESTARTS:-}" ]; then
    WORLD_SIZE=$((NGPU * NNODES)) _titanlite_run "$PYTHON" -m titanlite.launcher.preflight --config "$CONFIG" \
      "${ARGS[@]+"${ARGS[@]}"}"
    MAX_RESTARTS=$_TITANLITE_STDOUT
  fi
fi
[ -n "${MAX_RESTARTS:-}" ] && RESTARTS=(--max-restarts "$MAX_RESTARTS")

if [ "$NNODES" = 1 ] && [ -z "${RDZV_ENDPOINT:-}" ]; then
  RDZV=(--standalone)
else
  RDZV=(--nnodes "$NNODES" --rdzv_backend c10d --rdzv_id "${RDZV_ID:-titanlite}"
        --rdzv_endpoint "${RDZV_ENDPOINT:-${MASTER_ADDR:-localhost}:${MASTER_PORT:-29500}}")
fi

export OMP_NUM_THREADS=${OMP_NUM_THREADS:-$(( $(nproc) / NGPU > 0 ? $(nproc) / NGPU : 1 ))}
NUMA=()
[ -n "${NUMA_BINDING:-}" ] && NUMA=(--numa-binding "$NUMA_BINDING")
LAUNCH=("$PYTHON" -m titanlite.launcher.launch "${RDZV[@]}" --nproc_per_node="$NGPU" "${RESTARTS[@]+"${RESTARTS[@]}"}"
        "${NUMA[@]+"${NUMA[@]}"}"
        --local-ranks-filter "$LOG_RANK" --role rank --tee 3
        -m titanlite.train --config "$CONFIG" "${ARGS[@]+"${ARGS[@]}"}")
if [ "${DRY_LAUNCH:-0}" = 1 ]; then
  echo "OMP_NUM_THREADS=$OMP_NUM_THREADS $(printf '%q ' "${LAUNCH[@]}")"
  exit 0
fi
exec "${BLOCKED[@]+"${BLOCKED[@]}"}" "${LAUNCH[@]}"
