"""Test hook: the FSDP2 training path for any world size, on gloo CPU processes too.

In production several GPU processes run under FSDP2 with the config in `dynamicrubric/accelerate/fsdp.yaml`;
one GPU is a plain one-process launch. Two things keep that path out of reach of a CPU test and of a one-GPU
check: the launcher passes the config only for several GPU processes, and accelerate 1.15 never chooses FSDP
for CPU processes (`AcceleratorState` turns the process group's type into FSDP only for accelerator types,
MULTI_GPU, MULTI_XPU, ...; state.py), so CPU processes launched with that config get DDP (MULTI_CPU). torch's
FSDP2 itself (`fully_shard`, DCP, `get_model_state_dict`) runs on gloo.

With DYNRUBRIC_TEST_FSDP=1 the launcher passes the same config file to the same `accelerate launch` for any
world size (one process is then a one-rank torchrun launch, FSDP2 on one GPU), and on CPU processes each
training process makes accelerate take, for MULTI_CPU, the step it takes for MULTI_GPU (set FSDP, keep the
plugin). Everything after that is the production code: TRL's and accelerate's FSDP2 wrapping, the DCP
checkpoints, the final gather. tests/test_fsdp_cpu.py and bench/gpu_launch.py set it; unset, nothing changes.
"""

from __future__ import annotations

import os

FSDP_TEST_ENV = "DYNRUBRIC_TEST_FSDP"


def asked() -> bool:
    """Whether this run takes the FSDP2 path whatever its world size and device (the test hook)."""
    return os.environ.get(FSDP_TEST_ENV) == "1"


def apply_if_asked() -> None:
    """Before any Accelerator exists: accelerate's MULTI_GPU → FSDP step (state.py), for MULTI_CPU too."""
    if not asked():
        return
    from accelerate.state import AcceleratorState, PartialState
    from accelerate.utils import DistributedType

    init = AcceleratorState.__init__
    if getattr(init, "_fsdp_on_cpu", False):
        return

    def fsdp_on_cpu(self, *args, fsdp_plugin=None, **kwargs) -> None:
        init(self, *args, fsdp_plugin=fsdp_plugin, **kwargs)
        if self.distributed_type == DistributedType.MULTI_CPU and fsdp_plugin is not None:
            # What AcceleratorState.__init__ does for MULTI_GPU (mixed precision is "no" on a CPU).
            self.distributed_type = DistributedType.FSDP
            self.fsdp_plugin = fsdp_plugin
            PartialState._shared_state["distributed_type"] = DistributedType.FSDP

    fsdp_on_cpu._fsdp_on_cpu = True
    AcceleratorState.__init__ = fsdp_on_cpu
