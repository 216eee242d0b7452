"""The run_train.sh checks of many command lines in one process (tests/project/test_doc_commands.py).

`python tests/workers/preflights.py CHECKS.json`, where CHECKS.json is a list of {"argv": [...], "world":
N, "how": "preflight" | "config"}: `preflight` runs `titanlite.launcher.preflight.preflight(argv, N)`, the checks
run_train.sh runs before it starts N ranks (config, run plan, mesh, model, tokenizer, data, folders);
`config` only loads the config as run_train.sh does first. Prints a JSON list of [exit code, what the
run would have printed], one per check: 0 and "", or a user error's exit code and its line.
"""

from __future__ import annotations

import json
import sys
import traceback

from titanlite.config import load_config
from titanlite.errors import UserError, exit_code
from titanlite.launcher.preflight import preflight


def check(spec: dict) -> list:
    try:
        if spec["how"] == "preflight":
            preflight(spec["argv"], spec["world"])
        else:
            load_config(spec["argv"])
        return [0, ""]
    except UserError as e:
        return [exit_code(e), f"titanlite: error: {e}"]
    except SystemExit as e:  # argparse: an unknown option
        return [e.code if isinstance(e.code, int) else 2, f"exit {e.code}"]
    except Exception:  # noqa: BLE001 - a crash is reported as the check's outcome, as a rank's would be
        return [1, traceback.format_exc()]


if __name__ == "__main__":
    with open(sys.argv[1]) as f:
        specs = json.load(f)
    print(json.dumps([check(s) for s in specs]))
