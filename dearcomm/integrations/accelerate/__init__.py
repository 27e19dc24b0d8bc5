"""dearcomm under Hugging Face Accelerate (pip install 'dearcomm[accelerate]').

    from dearcomm.integrations import accelerate as dear_accelerate
    model, optimizer, loader, scheduler = dear_accelerate.prepare(accelerator, model, optimizer, loader, scheduler)

in place of ``accelerator.prepare(...)``: Accelerate keeps the launch, device
placement, mixed precision, dataloaders and schedulers; dearcomm takes the
place Accelerate gives DistributedDataParallel.
"""
from .._requires import require

require("accelerate", "accelerate")

from .prepare import prepare  # noqa: E402

__all__ = ["prepare"]
