"""A fake-CUDA dry run of the GPU path, on a machine without a GPU.

On a CPU every tensor, generator and collective lives on one device, so a CPU/CUDA mix, a random op
on the wrong generator, a CPU tensor handed to NCCL or a host read inside a loop passes every CPU
test and fails (or stalls) on the first GPU. Here the trainer's own code runs on tensors that claim
``device="cuda"`` (PyTorch's ``FakeTensorMode``: shapes, dtypes and devices propagate through the
real operators' meta kernels, no memory is used, a 10B model runs in seconds), with
``torch.distributed``'s ``fake`` process group for any world size in one process, and it checks:

* **devices**: fake mode refuses a CPU/CUDA mix at the op (``FakeTensorDeviceMismatchError``); every
  collective's tensors must be on the rank's CUDA device (:class:`DryRunMode` sees each ``c10d`` op,
  FSDP2's included); every random factory given a generator must make its tensor on the device the
  generator was made for (:func:`boogu_schedule.make_generator` is the seam: here it returns a
  :class:`FakeCudaGenerator`, a CPU generator that says which device it stands for);
* **host reads**: every device-to-host read (``.item()``, ``float(t)``, ``bool(t)``, ``.tolist()``)
  is recorded with the function that made it, and whether it ran inside a loop of the rollout or the
  update (a stall per iteration on a GPU); reads by design are listed by name;
* **memory**: the live bytes of every tensor (weights, LoRA state, activations, FSDP buffers) are
  tracked, and the peak of each phase is compared with ``trainer --plan``.

What a fake tensor cannot do, and the named stand-ins used instead:

* values: a fake tensor has none. Small tensors whose inputs are all known (index lists, token masks,
  group ids, seeds, window draws, the rewards below) are *shadowed*: the same op runs on real CPU
  copies (:data:`SHADOW_LIMIT` elements at most), so host reads of them return real values. Other
  reads (losses, norms, finiteness flags of model outputs) return a stand-in: 0, 0.0 or False ("no
  problem"), and are marked ``stand_in`` in the report. Collectives replicate this rank's values (as if
  every rank held the same).
* rewards: images of a fake model have no pixels; :class:`HostScores` scores each image with a seeded
  host-side random number (a user reward by import path, the route any reward takes).
* CUDA streams, events, ``synchronize``, ``set_device``, device queries and pinned memory need a
  driver: :class:`CudaStandIns` replaces those ``torch.cuda`` functions for the run (streams and events
  do nothing; a ``synchronize`` is recorded as a host read).
* the preflight compares real rollouts and is skipped (``preflight=false``).

What none of this shows: kernel choice, speed, NCCL behaviour (timeouts, async errors) and CUDA's
numerics. ``benchmarks/gpu_check.sh`` on a real GPU does; ``docs/gpu-path.md`` lists both.
"""

from __future__ import annotations

from boogu_dryrun.cases import (
    RECIPES,
    CaseConfig,
    CaseResult,
    Preset,
    build_parts,
    case_config,
    presets,
    run_case,
)
from boogu_dryrun.session import (
    BY_DESIGN,
    SHADOW_LIMIT,
    STAND_IN_ANSWERS,
    CollectiveCall,
    CudaStandIns,
    DryRunError,
    DryRunMode,
    FakeCudaGenerator,
    HostRead,
    HostScores,
    Session,
    fake_cuda,
)

__version__ = "0.1.0"

__all__ = [
    "BY_DESIGN",
    "RECIPES",
    "SHADOW_LIMIT",
    "STAND_IN_ANSWERS",
    "CaseConfig",
    "CaseResult",
    "CollectiveCall",
    "CudaStandIns",
    "DryRunError",
    "DryRunMode",
    "FakeCudaGenerator",
    "HostRead",
    "HostScores",
    "Preset",
    "Session",
    "build_parts",
    "case_config",
    "fake_cuda",
    "presets",
    "run_case",
]
