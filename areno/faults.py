"""Fault injection for resume tests: ``ARENO_FAULT="kill:<phase>:<step>"`` SIGKILLs the process.

The training loop calls :func:`fault_point` at its phase boundaries; when the environment names
that phase and step, the process kills itself with SIGKILL (no cleanup, no flush, exactly what a
``kill -9`` or a lost node does). Several faults are separated by commas. Phases:

- ``rollout``: the rollout of ``step`` has taken its prompts and returned, nothing trained yet
  (in an asynchronous run the rollout pool keeps generating in the background at any phase);
- ``train``: the optimizer has stepped on ``step``'s batch, the rollout side has the old policy;
- ``policy_sync``: the new policy is in the rollout engine, the step's metrics are not logged;
- ``checkpoint_write``: the checkpoint of ``step`` has all its shards in the staging directory
  but no ``COMPLETE`` marker and has not been renamed into place.

``step`` counts from 1 like the metrics and the ``step_N`` checkpoint directories. The variable is
read once per process; an unset variable costs one dictionary lookup per call.
"""

from __future__ import annotations

import os
import signal

ENV_VAR = "ARENO_FAULT"
PHASES = ("rollout", "train", "policy_sync", "checkpoint_write")

_faults: frozenset[tuple[str, int]] | None = None


def parse_faults(spec: str) -> frozenset[tuple[str, int]]:
    """``"kill:train:3,kill:rollout:5"`` -> {("train", 3), ("rollout", 5)}; ValueError naming the bad part."""
    out = set()
    for part in (p.strip() for p in spec.split(",")):
        if not part:
            continue
        fields = part.split(":")
        if len(fields) != 3 or fields[0] != "kill" or fields[1] not in PHASES or not fields[2].isdigit():
            raise ValueError(
                f"{ENV_VAR}: {part!r} must look like kill:<phase>:<step> with phase one of "
                f"{PHASES} and step an integer >= 1 (e.g. kill:train:3)"
            )
        out.add((fields[1], int(fields[2])))
    return frozenset(out)


def fault_point(phase: str, step: int) -> None:
    """SIGKILL this process if ``ARENO_FAULT`` names ``phase`` at ``step``."""
    global _faults
    if _faults is None:
        _faults = parse_faults(os.environ.get(ENV_VAR, ""))
    if _faults and (phase, step) in _faults:
        os.kill(os.getpid(), signal.SIGKILL)
