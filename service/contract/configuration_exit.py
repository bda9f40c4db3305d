"""How a process ends whose configuration no restart can mend: one line saying what to change, and status 78.

The line goes to stderr and to the termination-message file where one exists: a Kubernetes container's
(/dev/termination-log, shown in `kubectl describe pod`), or the one `blockserve serve` gives each role
(BLOCKSERVE_TERMINATION_MESSAGE_PATH), whence its supervisor reads it. The status tells that supervisor to stop
every role instead of restarting this one (service/launch/supervisor.py).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

CONFIGURATION_ERROR_STATUS = 78  # EX_CONFIG of sysexits.h
TERMINATION_MESSAGE_VARIABLE = "BLOCKSERVE_TERMINATION_MESSAGE_PATH"
KUBERNETES_TERMINATION_MESSAGE_PATH = "/dev/termination-log"  # a container's default terminationMessagePath


class ConfigurationError(Exception):
    """The process cannot run as configured (an unsupported model, say); the message says what to change."""


def configuration_error_line(command: str, error: Exception) -> str:
    """The one line that ends `blockserve <command>` for `error`."""
    return f"blockserve {command}: configuration error: {error}"


def end_with_configuration_error(line: str) -> int:
    """Print `line` to stderr and leave it as the termination message; the status to exit with."""
    print(line, file=sys.stderr, flush=True)
    path = Path(os.environ.get(TERMINATION_MESSAGE_VARIABLE, KUBERNETES_TERMINATION_MESSAGE_PATH))
    # Only a file that is there already: outside a container /dev/termination-log is nobody's to create.
    if path.is_file() and os.access(path, os.W_OK):
        path.write_text(line + "\n")
    return CONFIGURATION_ERROR_STATUS
