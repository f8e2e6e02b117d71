"""What every benchmark script shares: its absl entry point, its errors and its JSON file."""

import json
import os
import sys

from absl import app

from gpupar.runtime.teardown import exit_without_teardown

DEFAULT_DATA_DIR = "/usr/share/datasets/fashion-mnist"
# The repository's root: benchmark processes start their workers there, wherever they run from.
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


class UsageError(Exception):
    """A bad flag value of a benchmark: the message says what to pass instead."""


def data_dir(value) -> str:
    """The Fashion-MNIST folder a --data_dir flag names (the default when empty), checked."""
    folder = value or DEFAULT_DATA_DIR
    if not os.path.isdir(folder):
        raise UsageError(f"--data_dir={folder} is not a folder; pass the folder with the four Fashion-MNIST IDX "
                         "files (Debian: apt-get install dataset-fashion-mnist)")
    return folder


def write_json(path: str, report: dict):
    """Writes the report as indented JSON, creating the folder, and says so."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(report, f, indent=2)
    print(f"wrote {path}")


def run(name: str, define_flags, main):
    """Defines the script's flags, parses them with absl and exits with main(argv)'s status.

    A UsageError is one line on stderr and status 2; main's own failures return their status.
    """
    define_flags()

    def checked(argv):
        if len(argv) > 1:
            print(f"{name}: error: unexpected argument(s) {' '.join(argv[1:])}", file=sys.stderr)
            exit_without_teardown(2)
        try:
            status = main()
        except UsageError as e:
            print(f"{name}: error: {e}", file=sys.stderr)
            status = 2
        exit_without_teardown(status)

    app.run(checked)
