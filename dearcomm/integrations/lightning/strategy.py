"""DearStrategy: Lightning's DDP strategy with dearcomm in place of DistributedDataParallel.

Everything around the model is Lightning's DDPStrategy: the launcher
(``_SubprocessScriptLauncher`` for ``devices=N``, or torchrun/SLURM's
processes), the cluster environment, the process group, samplers, barriers
and reductions. What differs is the model and its optimizer:

- setup (fit): ``dearcomm.wrap(lightning_module, optimizer)`` where DDP would
  wrap the module; the Trainer then steps the returned DistributedOptimizer.
  Other Trainer functions (validate, test, predict) only broadcast rank 0's
  parameters, as DDPStrategy does.
- training_step runs inside the module's ``__call__`` (as DDP's forward), so
  dearcomm's hooks on the root see each training forward (buffer broadcast).
- ``accumulate_grad_batches``: the accumulating micro-batches run under
  ``no_sync()``.
- clipping and stepping: precision.py.
- validation starts with ``sync()``: the last step's all-gathers are finished
  before anything reads parameters.
- teardown: ``close()``, so the LightningModule is again a plain module
  holding the trained parameters, and the Trainer's optimizer the user's own
  with the trained state (as DDPStrategy unwraps DDP).
"""
from __future__ import annotations

import logging
from contextlib import contextmanager
from datetime import timedelta
from typing import Any, Dict, Generator, List, Literal, Mapping, Optional, Sequence, Union

import torch
from lightning.fabric.plugins import CheckpointIO, ClusterEnvironment
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.fabric.strategies import _StrategyRegistry
from lightning.fabric.utilities.optimizer import _optimizers_to_device
import lightning.pytorch as pl
from lightning.pytorch.callbacks import Callback, StochasticWeightAveraging, WeightAveraging
from lightning.pytorch.overrides.distributed import _sync_module_states
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.strategies import DDPStrategy
from lightning.pytorch.strategies.strategy import _ForwardRedirection
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities import GradClipAlgorithmType

import dearcomm
from dearcomm import DearModule
from dearcomm._self_planning import plans_itself
from dearcomm._wrap import resolve_options

from . import precision

log = logging.getLogger(__name__)


class DearStrategy(DDPStrategy):
    """Data-parallel training with dearcomm: ``Trainer(strategy=DearStrategy(), devices=N)``.

    The dearcomm options are those of :func:`dearcomm.wrap` (README, "Options
    of dearcomm.wrap"); ``timeout`` is the process group's, which dearcomm's
    collectives use too. Clipping comes from ``Trainer(gradient_clip_val=)``
    (by norm). The other arguments are DDPStrategy's.
    """

    def __init__(
        self,
        *,
        bucket_mb: Union[float, str] = 25.0,
        partition_mb: Union[float, str, None] = None,
        blocks: Optional[Mapping[str, Sequence[int]]] = None,
        priorities: Optional[Mapping[str, int]] = None,
        max_delay: Optional[int] = None,
        delays: Optional[Mapping[str, int]] = None,
        credit_mb: Union[float, str, None] = None,
        schedule: str = "dear",
        update: Optional[str] = None,
        find_unused_parameters: bool = False,
        comm_dtype: Optional[torch.dtype] = None,
        broadcast_buffers: bool = True,
        accelerator: Optional["pl.accelerators.Accelerator"] = None,
        parallel_devices: Optional[List[torch.device]] = None,
        cluster_environment: Optional[ClusterEnvironment] = None,
        checkpoint_io: Optional[CheckpointIO] = None,
        precision_plugin: Optional[Precision] = None,
        process_group_backend: Optional[str] = None,
        timeout: Optional[timedelta] = default_pg_timeout,
        start_method: Literal["popen", "spawn", "fork", "forkserver"] = "popen",
    ) -> None:
        self._dear_options: Dict[str, Any] = dict(
            bucket_mb=bucket_mb, partition_mb=partition_mb, blocks=blocks, priorities=priorities,
            max_delay=max_delay, delays=delays, credit_mb=credit_mb, schedule=schedule, update=update,
            find_unused_parameters=find_unused_parameters, comm_dtype=comm_dtype, broadcast_buffers=broadcast_buffers)
        _refuse_planning_at_first_forward(self._dear_options)  # and a bad option fails, before any process starts
        super().__init__(accelerator=accelerator, parallel_devices=parallel_devices,
                         cluster_environment=cluster_environment, checkpoint_io=checkpoint_io,
                         precision_plugin=precision_plugin, process_group_backend=process_group_backend,
                         timeout=timeout, start_method=start_method)
        self._forward_redirection = _ForwardRedirection()
        self._failed = False

    @property
    def schedule(self) -> str:
        return self._dear_options["schedule"]

    def setup(self, trainer: "pl.Trainer") -> None:
        assert self.accelerator is not None and self.model is not None
        self._failed = False  # a failure of an earlier fit(), validate() or test() is over
        self.accelerator.setup(trainer)
        fitting = trainer.state.fn == TrainerFn.FITTING
        if fitting and self._layer_sync:
            self.model = self._layer_sync.apply(self.model)
        self.precision_plugin.convert_module(self.model)
        self.model_to_device()  # dearcomm's buckets take the parameters as they are now: device and dtype first
        if fitting:
            self.setup_optimizers(trainer)
            self._wrap(trainer)
        else:
            _sync_module_states(self.model)  # nothing to reduce: rank 0's parameters, as DDPStrategy does
        self.setup_precision_plugin()
        if fitting:
            _optimizers_to_device(self.optimizers, self.root_device)

    def _wrap(self, trainer: "pl.Trainer") -> None:
        if len(self.optimizers) != 1:
            raise ValueError(
                f"dearcomm: DearStrategy trains the LightningModule with one optimizer; configure_optimizers() "
                f"returned {len(self.optimizers)}. Put the parameters in one optimizer (param groups may differ)")
        scaler = getattr(self.precision_plugin, "scaler", None)
        clip_in_step = None
        if scaler is not None and trainer.gradient_clip_val and \
                trainer.gradient_clip_algorithm in (None, GradClipAlgorithmType.NORM):
            clip_in_step = float(trainer.gradient_clip_val)  # after the GradScaler unscaled, inside step()
        self._user_optimizer = self.optimizers[0]
        # A timeout of the user's own bounds dearcomm's waits too (the group's default, 30 minutes, would
        # make a rank-0-only optimizer.state_dict() wait that long before saying so).
        timeout = self._timeout if self._timeout != default_pg_timeout else None
        self.model, optimizer = dearcomm.wrap(self.model, self._user_optimizer, max_grad_norm=clip_in_step,
                                              timeout=timeout, **self._dear_options)
        self.optimizers = [optimizer]  # LR schedulers keep working: it shares param_groups with the user's
        precision.adapt(self.precision_plugin, clip_in_step)

    def on_train_start(self) -> None:
        super().on_train_start()
        callbacks = self.lightning_module.trainer.callbacks
        callbacks[:] = [c for c in callbacks if not isinstance(c, _FinishStepBeforeAveraging)]  # a second fit()
        averaging = [c for c in callbacks if isinstance(c, (WeightAveraging, StochasticWeightAveraging))]
        if averaging and isinstance(self.model, DearModule) and self.schedule != "wfbp":
            # Before them in the callback list: they read the parameters at a batch's or an epoch's end.
            callbacks.insert(0, _FinishStepBeforeAveraging(self.model, averaging))
            log.info("dearcomm: %s reads the parameters after the steps it averages, so DearStrategy finishes those "
                     "steps' all-gathers before it (the next forward no longer overlaps them); an EMA from "
                     "model.register_update_hook keeps the overlap (docs/guide.md)", type(averaging[0]).__name__)

    def configure_ddp(self) -> None:
        raise NotImplementedError("dearcomm: DearStrategy wraps the model with dearcomm in setup(), not with DDP")

    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        # Through the root's __call__, as DDP's forward runs around training_step.
        assert self.lightning_module is not None and self.model is not None
        with self.precision_plugin.train_step_context():
            return self._forward_redirection(self.model, self.lightning_module, "training_step", *args, **kwargs)

    @contextmanager
    def block_backward_sync(self) -> Generator[None, None, None]:
        """The micro-batches that accumulate (``accumulate_grad_batches``) communicate nothing."""
        if isinstance(self.model, DearModule):
            with self.model.no_sync():
                yield
        else:
            yield

    def on_validation_start(self) -> None:
        if isinstance(self.model, DearModule):
            self.model.sync()  # validation during fit reads the last step's parameters
        super().on_validation_start()

    def on_exception(self, exception: BaseException) -> None:
        self._failed = True
        super().on_exception(exception)

    def teardown(self) -> None:
        if isinstance(self.model, DearModule):
            if self._failed:
                # No collective: the failed peer never joins one (gathering the
                # optimizer's state waited for the group's timeout, minutes).
                self.model._detach()
                self.optimizers = [self._user_optimizer]
            else:
                self._unwrap()
        self._failed = False
        precision.restore(self.precision_plugin)
        super().teardown()

    def _unwrap(self) -> None:
        """Back to the user's module and optimizer, holding what training
        reached, as DDPStrategy unwraps DDP: trainer.save_checkpoint() after
        fit() then saves them as DDP would (dearcomm's optimizer no longer
        steps once its model is closed)."""
        state = self.optimizers[0].state_dict()  # full; with update="sharded" gathered from every rank
        self.model.close()  # finishes the last all-gathers: the module holds the trained parameters
        self._user_optimizer.load_state_dict(state)
        self.optimizers = [self._user_optimizer]

    @classmethod
    def register_strategies(cls, strategy_registry: _StrategyRegistry) -> None:
        if "dear" not in strategy_registry:
            strategy_registry.register("dear", cls, description="dearcomm's DeAR schedule in place of DDP")


class _FinishStepBeforeAveraging(Callback):
    """Lightning's WeightAveraging callbacks (EMAWeightAveraging) read every
    parameter at a batch's end where they update, StochasticWeightAveraging
    at an epoch's start and end; under schedule="dear" the last step's
    all-gathers are then still writing them: each rank averaged its own
    shard new and the rest old, and the ranks' averages parted."""

    def __init__(self, model: DearModule, averaging: List[Callback]) -> None:
        self._model, self._averaging = model, averaging

    def _sync(self) -> None:
        if isinstance(self._model, DearModule) and not self._model._dear.closed:
            self._model.sync()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        step_idx = trainer.global_step - 1  # as WeightAveraging asks should_update
        if any(isinstance(c, WeightAveraging) and c.should_update(step_idx=step_idx) for c in self._averaging):
            self._sync()

    def on_train_epoch_start(self, trainer, pl_module) -> None:
        self._sync()

    def on_train_epoch_end(self, trainer, pl_module) -> None:
        self._sync()


def _refuse_planning_at_first_forward(options: Dict[str, Any]) -> None:
    """What plans at the first training forward profiles the model by calling
    it again with that forward's arguments; under Lightning those are
    training_step's, and the call reaches forward()."""
    start, auto, _ = resolve_options(**dict(options))
    planned = [f"{name}='auto'" for name in auto]
    if plans_itself(start):
        planned.append(f"schedule={start.schedule!r} without its plan")
    if planned:
        raise ValueError(
            f"dearcomm: DearStrategy cannot take {', '.join(planned)}: these plan at the first training forward by "
            "calling the model again with that forward's arguments, and under Lightning those are training_step's. "
            "Give the plan instead (usbyte: blocks and priorities from dearcomm.usbyte.plan_job; deft: delays from "
            "dearcomm.deft.plan_job; bucket_mb and the others: dearcomm.plan()), or train with Accelerate or a "
            "plain loop, where they plan themselves")
