"""A controller and its agents as plain processes on this machine: started by the test, awaited here."""

from __future__ import annotations

import subprocess


def outputs_of(procs: dict[str, subprocess.Popen], timeout: float = 200.0) -> tuple[dict[str, str], dict[str, int]]:
    """Wait for every process (each within `timeout`): their output and exit status by name; none outlives it."""
    outputs, codes = {}, {}
    try:
        for name, proc in procs.items():
            outputs[name], _ = proc.communicate(timeout=timeout)
            codes[name] = proc.returncode
    finally:
        for proc in procs.values():
            proc.kill()
            proc.communicate()
    return outputs, codes
