"""Fault injection at named points, for tests that kill or stall a run at a chosen moment.

``BOOGU_FAULT="<action>:<point>[:<step>][@<rank>]"`` (several separated by commas) makes the
trainer act when it reaches ``point`` at training step ``step`` (the step being run, counting from
1; any step when omitted) on rank ``rank`` (any rank when omitted):

* ``kill``: SIGKILL itself (what ``kill -9`` or a node failure does; nothing is flushed);
* ``stall``: sleep for an hour (a hung rank);
* ``raise``: raise `InjectedFault` (an in-process crash).

The points are listed in `POINTS`. Without the variable, `fault_point` is a dictionary lookup.
"""

from __future__ import annotations

import os
import signal
import time

ENV = "BOOGU_FAULT"

POINTS = (
    "step_start",  # before the rollout of a step
    "after_rollout",  # rollouts and rewards done, before the update
    "after_update",  # optimizer stepped, before the weight sync
    "checkpoint_staged",  # every checkpoint file written, before the folder is committed
    "checkpoint_committed",  # the checkpoint folder is in place
    "step_end",  # after the step's record is logged
)


class InjectedFault(RuntimeError):
    """Raised by a ``raise:`` fault."""


def _parse(spec: str) -> list[tuple[str, str, int | None, int | None]]:
    out = []
    for item in filter(None, (s.strip() for s in spec.split(","))):
        body, _, rank = item.partition("@")
        action, _, rest = body.partition(":")
        point, _, step = rest.partition(":")
        if action not in ("kill", "stall", "raise") or point not in POINTS:
            raise ValueError(
                f"{ENV}={spec!r}: expected <kill|stall|raise>:<point>[:<step>][@<rank>] with a point in {POINTS}"
            )
        out.append((action, point, int(step) if step else None, int(rank) if rank else None))
    return out


def fault_point(point: str, step: int, rank: int = 0) -> None:
    """Act on a matching ``BOOGU_FAULT`` entry; otherwise do nothing."""
    spec = os.environ.get(ENV)
    if not spec:
        return
    for action, where, at_step, at_rank in _parse(spec):
        if where != point or (at_step is not None and at_step != step) or (at_rank not in (None, rank)):
            continue
        if action == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        if action == "stall":
            time.sleep(3600)
        raise InjectedFault(f"{ENV}: injected fault at {point} (step {step}, rank {rank})")
