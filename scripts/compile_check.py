"""What the compile-time checks of the kernels share (check_pdl_ptx.py, check_mhc_loads.py):
they compile kernels for sm_90 on any machine, log what they found and exit 1 on a finding."""

from __future__ import annotations

import argparse
import logging
import os
import sys
from collections.abc import Callable

log = logging.getLogger("compile_check")


def run(check: Callable[[], list[str]], doc: str) -> None:
    """Parse the (empty) command line with `doc` as help, run `check`, log its problems, exit."""
    formatter = argparse.RawDescriptionHelpFormatter
    argparse.ArgumentParser(description=doc, formatter_class=formatter).parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", datefmt="%H:%M:%S")
    if os.environ.get("TRITON_INTERPRET") == "1":
        raise SystemExit("unset TRITON_INTERPRET: the interpreter's kernels cannot be compiled")
    problems = check()
    for p in problems:
        log.error("%s", p)
    sys.exit(1 if problems else 0)
