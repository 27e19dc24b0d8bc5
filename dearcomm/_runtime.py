"""The per-model runtime: discovers parameters and modules, installs the hooks,
records the forward order and builds the C++ engine at the first backward.

Hooks and what they do:
  forward pre-hook
      first forward (on every module): record which modules run, in order, and
      the parameters they own; a parameter whose module never runs (read
      directly by an ancestor, as nn.MultiheadAttention reads out_proj.weight)
      belongs to the nearest ancestor that ran. Afterwards only modules with
      parameters to wait for keep the hook:
      after step():   training forward -> engine.require_bucket(b) for the
                      module's buckets (waits for its all-gather);
                      no-grad/eval forward -> engine.flush().
  forward pre-hook on the root
      training forward: an error if the last backward raised midway (its
      collectives no longer pair up).
  forward hook on the root
      training forward: rank 0's buffers to every rank (broadcast_buffers=
      True, model has buffers), so later forwards start from them, as with
      DDP; a hook on each output tensor queues the end-of-backward callback
      when backward reaches it.
  post-accumulate-grad hook (every parameter that requires grad)
      engine.mark_grad_ready(i, grad): pack (nothing to pack where .grad is
      its bucket view: autograd accumulated into the bucket), and launch
      reductions in order; the first one of a backward queues the
      end-of-backward callback if no output hook did. That callback checks
      that every parameter got its gradient and finishes the reductions
      where .grad is what they read or write (wfbp: .grad holds the average
      when backward returns, as with DDP; dear with .grad views: the
      reduce-scatters read .grad, which code between backward and step(),
      such as GradScaler.unscale_, may write);
      (dear) notes the gradients' version counters, which step() checks.

Every hook holds the runtime weakly, so no hook keeps a dropped model alive
(the model, its runtime and optimizer refer to each other: the garbage
collector frees them at its next run; model.close() releases the engine's
buffers at once), and is excluded from torch.compile (graph breaks at the
hooks; the engine's state is not something to guard on).
"""
from __future__ import annotations

import gc
import itertools
import logging
import os
import weakref
from typing import Callable, Dict, List, Optional, Tuple

import torch
import torch.distributed as dist
from torch import nn

from . import _C, _cuda
from ._options import WrapOptions
from ._delayed import DelayedUpdates
from ._delays import bucket_delays
from ._cpu_switches import check_switches
from ._engine_group import engine_group
from ._priorities import bucket_priorities
from ._torch_collectives import all_gather_object_within, broadcast_within, group_timeout, within
from .overlap import OverlapMonitor
from ._update import strategy_class
from ._weak import weakly

logger = logging.getLogger("dearcomm")

# Called with [(name, parameter), ...] of one bucket once its parameters hold
# the result of the last optimizer.step().
UpdateHook = Callable[[List[Tuple[str, nn.Parameter]]], None]


def grad_views_enabled() -> bool:
    """DEARCOMM_GRAD_VIEWS=0 keeps .grad out of the buckets (every backward
    packs): a switch for A/B measurements and debugging, not a tuning knob."""
    return os.environ.get("DEARCOMM_GRAD_VIEWS", "1") != "0"


def buckets_of(slot) -> range:
    """The buckets that hold a parameter's elements: several where it spans buckets."""
    return range(slot.bucket, slot.last_bucket + 1)


def completion_of(layout) -> "_C.Completion":
    """The executor's rule, "a parameter is complete when the last of its
    buckets is" (csrc/core/layout.h), over ``layout``: done(b) returns each
    parameter once, with the last of its buckets reported."""
    return _C.Completion([(b.first_param, b.num_params) for b in layout.buckets],
                         [(s.bucket, s.last_bucket) for s in layout.params])


# Every model wrapped in this process, in the order of wrap(): errors that
# name a parameter also name its model where there are several (a GAN's
# generator and discriminator may both have a '0.weight').
_WRAPPED: "weakref.WeakSet[DearRuntime]" = weakref.WeakSet()
_WRAP_ORDER = itertools.count()
_RELABELLED = (RuntimeError, ValueError, TypeError)  # what the engine's errors arrive as


def _weak_hook(method):
    """A weak hook (see weakly) that torch.compile skips."""
    return torch.compiler.disable(weakly(method))


class DearRuntime:
    def __init__(self, module: nn.Module, options: WrapOptions) -> None:
        self.options = options
        self.update = strategy_class(options.update_strategy)  # its class: where the averaged gradients live
        self.group = options.process_group or dist.group.WORLD
        self.rank = dist.get_rank(self.group)
        self.world_size = dist.get_world_size(self.group)
        self.timeout = options.timeout or group_timeout(self.group)

        # Parameters that train, under their first name (tied weights appear once).
        self._module = module
        self.names: Dict[nn.Parameter, str] = {}
        for name, param in module.named_parameters():
            if param.requires_grad:
                self.names[param] = name
        if not self.names:
            raise ValueError("dearcomm: the module has no parameter that requires grad; nothing to train")
        self.by_name: Dict[str, nn.Parameter] = {name: p for p, name in self.names.items()}
        self._check_blocks()
        self._wrap_order = next(_WRAP_ORDER)
        _WRAPPED.add(self)

        self.engine: Optional[_C.Engine] = None
        self._layout_logged = False  # the engine's buckets were logged at INFO
        self.params: List[nn.Parameter] = []  # forward order, once the engine exists
        self.index: Dict[nn.Parameter, int] = {}
        self.on_engine_built: List[Callable[[_C.Engine], None]] = []
        self.on_close: List[Callable[[], None]] = []  # what close() undoes beyond the runtime's own hooks
        # The optimizer's part of reconfigure(): called while the old engine
        # exists (its state in full form); what it returns, once the new options are in.
        self.on_reconfigure: List[Callable[[], Callable[[], None]]] = []
        self.on_step_skipped: List[Callable[[], None]] = []  # zero_grad() between backward and step()
        self.planning = False  # wrap()'s "auto" profiles the model: the hooks stand aside
        self.auto = None  # an AutoPlanner where some option of wrap() is "auto"
        self.delayed = DelayedUpdates(self)  # deft's checkpoints and guard (_delayed.py); idle without delays
        self.planner = None  # a SelfPlanner where usbyte or deft plans at the first forward (_self_planning.py)
        self._ran: List[nn.Module] = []      # first forward: modules in the order they ran
        self._ran_set = set()
        self._module_params: Dict[nn.Module, List[nn.Parameter]] = {}
        self._module_buckets: Dict[nn.Module, List[int]] = {}
        self._end_of_backward_queued = False  # this backward's end-of-backward callback is queued
        self._grads_arrived = False  # a gradient reached the engine since the last end of backward
        self.backwards = 0  # backwards that reached the engine and ended (several may precede a step)
        self._unused_this_step: frozenset = frozenset()  # find_unused_parameters: none in any backward since the step
        self.sync_gradients = True  # False inside DearModule.no_sync()
        self._zeros: Dict[int, torch.Tensor] = {}  # find_unused_parameters: stand-in gradients
        self.unused_everywhere: frozenset = frozenset()  # find_unused_parameters: no rank's last backward used these
        self._grad_versions: Optional[List[Tuple[Optional[torch.Tensor], int]]] = None  # dear, after backward
        self._update_hooks: Dict[int, UpdateHook] = {}
        self._next_hook_id = 0
        self._unreported: List[int] = []  # buckets updated by the last step whose update hooks have not run
        self._reported: Optional[_C.Completion] = None  # which parameters the update hooks reported
        self._forward_handles: Dict[nn.Module, object] = {}
        self._handles = []
        self.closed = False  # close() was called
        self.overlap = OverlapMonitor(self)  # model.overlap_report()
        self._frozen: List[Tuple[str, nn.Parameter]] = []  # frozen when the engine was built (_refuse_unfrozen)

        for sub in module.modules():
            owned = [p for p in sub.parameters(recurse=False) if p in self.names]
            if owned:
                self._module_params[sub] = owned
            self._forward_handles[sub] = sub.register_forward_pre_hook(_weak_hook(self._on_forward))
        for param in self.names:
            self._handles.append(param.register_post_accumulate_grad_hook(_weak_hook(self._on_grad)))
        self._engine_group: Optional[dist.ProcessGroup] = None  # the CPU engine's connections (_engine_group.py)
        self._broadcasts_buffers = options.broadcast_buffers and next(module.buffers(), None) is not None
        # Before the root's own wait for its parameters' all-gathers (prepended): that wait would fail first.
        self._handles.append(module.register_forward_pre_hook(_weak_hook(self._check_last_backward_ended),
                                                              prepend=True))
        self._handles.append(module.register_forward_hook(_weak_hook(self._after_training_forward)))

    # ---- hooks -------------------------------------------------------------

    def _on_forward(self, module: nn.Module, args) -> None:
        engine = self.engine
        if self.planning or module not in self._forward_handles:
            return  # a copy of a submodule (copy.deepcopy(model.block)) keeps the hook, not its role
        if engine is None:
            if module not in self._ran_set:
                self._ran_set.add(module)
                self._ran.append(module)
            return
        if engine.state != _C.IterationState.GATHERING:
            return
        if torch.is_grad_enabled() and module.training:
            buckets = self._module_buckets[module]
            for bucket in buckets:
                engine.require_bucket(bucket)
            if self._unreported:
                self._report_updates(buckets)
        else:
            self.sync()  # eval / no_grad: see every update

    def _after_training_forward(self, module: nn.Module, args, output) -> None:
        """The root's forward hook; outside no_sync() and "auto"'s profiling,
        a training forward's buffers go to every rank and its outputs get
        the hooks that end the backward."""
        if not (module.training and torch.is_grad_enabled()) or self.planning or not self.sync_gradients:
            return
        self._refuse_unfrozen()
        if self._broadcasts_buffers:
            self._broadcast_buffers(module)
        self._hook_outputs(output)

    def _refuse_unfrozen(self) -> None:
        """A parameter frozen when the engine was built and trainable now
        would get a gradient that is neither averaged nor applied (the
        buckets hold the trainable ones): refused, by name. (A trainable
        parameter frozen since gets no gradient: backward's check names it.)
        Runs every training forward: a pass over the frozen ones only."""
        unfrozen = [n for n, p in self._frozen if p.requires_grad]
        if unfrozen:
            raise ValueError(
                f"dearcomm: parameter(s) {unfrozen[:8]} became trainable after wrap(); their gradients would be "
                "neither averaged nor applied. Make them trainable before wrap() (to unfreeze them later, train "
                "them from the start in an optimizer param group whose lr stays 0 until then)")

    def _broadcast_buffers(self, module: nn.Module) -> None:
        # As DDP (broadcast_buffers=True), every rank's forwards start from
        # rank 0's buffers (BatchNorm's running statistics) after a
        # synchronising training forward: DDP broadcasts before the next
        # forward, an eval one included, which would make a rank-0-only eval
        # a collective; broadcasting right after the training forward gives
        # every later forward the same buffers with no collective outside
        # training. Inside no_sync() each rank keeps its own, as with DDP.
        buffers = list(module.buffers())  # as they are now: a buffer may have been reassigned since wrap()
        # Version counters kept, as DDP keeps them: this forward (and an
        # earlier one of the iteration: two views, real and fake batches)
        # saved BatchNorm's running statistics for backward, which would
        # refuse them after the copy; training-mode backward reads their
        # versions, not their values.
        with torch.no_grad(), torch.autograd._unsafe_preserve_version_counter(tuple(buffers)):
            broadcast_within(buffers, dist.get_global_rank(self.group, 0), self.group, self.timeout,
                             "the broadcast of rank 0's buffers after a training forward")

    def _hook_outputs(self, output) -> None:
        """A hook on the training forward's outputs queues the
        end-of-backward callback when backward reaches them, on the graph
        task that runs the whole backward (as FSDP does). Queued from the
        first gradient instead, it would run at the end of a reentrant
        checkpoint's inner backward where that gradient arrived first (the
        last layer checkpointed), before the other layers' gradients."""
        hook = _weak_hook(self._backward_reached_outputs)
        for leaf in torch.utils._pytree.tree_leaves(output):
            # Not a leaf tensor (a parameter returned as it is): its hooks would outlive the iteration.
            if isinstance(leaf, torch.Tensor) and leaf.requires_grad and leaf.grad_fn is not None:
                leaf.register_hook(hook)

    def _backward_reached_outputs(self, grad: torch.Tensor) -> None:
        self._queue_end_of_backward()

    def _queue_end_of_backward(self) -> None:
        if not self._end_of_backward_queued:
            self._end_of_backward_queued = True
            torch.autograd.Variable._execution_engine.queue_callback(_weak_hook(self._end_of_backward))

    def _check_last_backward_ended(self, module: nn.Module, args) -> None:
        """A training forward outside any backward while the last backward's
        end never ran: that backward raised after some gradients reached the
        engine (an out-of-memory caught by the loop, say). Its reductions were
        issued for some buckets and not others, on this rank and maybe
        differently on the others: the ranks' collectives no longer pair up."""
        if not (self._end_of_backward_queued and module.training and torch.is_grad_enabled()):
            return
        if torch._C._current_graph_task_id() != -1:
            return  # a forward recomputed inside backward (activation checkpointing)
        if not self._grads_arrived:
            self._end_of_backward_queued = False  # it raised before any gradient reached dearcomm: nothing to undo
            return
        raise RuntimeError(
            "dearcomm: the previous backward did not finish (an exception was raised inside it, after some "
            "gradients had reached dearcomm): its collectives were issued for some buckets and not for others, "
            "so the ranks' communication no longer pairs up and training cannot go on (as with DDP). Resume from "
            "a checkpoint in a new process; to skip bad batches, check the loss before backward()")

    def model_label(self) -> str:
        """Which wrapped model this is, where this process holds several
        ("model 2 of the 2 wrapped (Discriminator)"); "" where it holds one."""
        gc.collect()  # an error path: models dropped but not yet collected do not count
        wrapped = sorted(_WRAPPED, key=lambda r: r._wrap_order)
        if len(wrapped) < 2:
            return ""
        plain = getattr(type(self._module), "_dear_plain_class", type(self._module))
        return f"model {wrapped.index(self) + 1} of the {len(wrapped)} wrapped ({plain.__name__})"

    def naming_the_model(self, error: BaseException) -> BaseException:
        """``error`` naming this model after "dearcomm: " where the process
        holds several wrapped models (see model_label); else ``error``. For
        ``raise runtime.naming_the_model(e) from None`` in an except clause
        (a try costs nothing where nothing raises: the hook runs per
        gradient)."""
        text = str(error)
        if type(error) not in _RELABELLED or not text.startswith("dearcomm: "):
            return error
        label = self.model_label()
        if not label:
            return error
        return type(error)(f"dearcomm: [{label}] {text[len('dearcomm: '):]}").with_traceback(error.__traceback__)

    def _on_grad(self, param: nn.Parameter) -> None:
        if self.planning:
            return  # "auto" profiling one rank's compute
        if not self.sync_gradients:
            return  # accumulating: .grad sums micro-batches, the last backward communicates
        if self.engine is None:
            with _C.no_python_tls():  # its collectives' Works must not keep backward's Python objects
                self._build_engine()
        if not self._grads_arrived:
            self._grads_arrived = True
            again = self.engine.state in (_C.IterationState.BACKWARD, _C.IterationState.REDUCED)  # no step since
            if again and self.auto is not None:
                self.auto.forbid_delays()  # several backwards a step: deft's delayed buckets would refuse them
            if self._unreported:
                self.sync()  # the engine would flush anyway; the update hooks see it first
            self._queue_end_of_backward()  # where the loss did not come from the root's outputs
        try:
            self.engine.mark_grad_ready(self.index[param], param.grad)
        except _RELABELLED as e:
            raise self.naming_the_model(e) from None

    def _end_of_backward(self) -> None:
        self._end_of_backward_queued = False
        if not self._grads_arrived:
            return  # a backward that reached no parameter: torch.autograd.grad(outputs, inputs)
        try:
            self._finish_backward()
        except BaseException as e:
            # Its reductions were issued for some buckets: as a backward that
            # raised midway, named at the next training forward.
            self._end_of_backward_queued = self._grads_arrived = True
            if isinstance(e, _RELABELLED):
                raise self.naming_the_model(e) from None
            raise

    def _finish_backward(self) -> None:
        self._grads_arrived = False
        engine = self.engine
        missing = engine.missing_grads()
        if missing:
            self._check_not_replaced(missing)
        unused_here = []  # no gradient in this backward, none accumulated before
        if self.options.find_unused_parameters:
            for i in missing:
                # As DDP: an unused parameter contributes its .grad, which holds
                # what earlier no_sync() micro-batches accumulated; zeros if none.
                # Unused in an earlier backward of this step too, its .grad is
                # the zeros packed then (a bucket view): still unused.
                grad = self.params[i].grad
                if grad is None or i in self._unused_this_step:
                    unused_here.append(i)
                    if grad is None:
                        if i not in self._zeros:
                            self._zeros[i] = torch.zeros_like(self.params[i], memory_format=torch.contiguous_format)
                        grad = self._zeros[i]
                engine.mark_grad_ready(i, grad)
            self._unused_this_step = frozenset(unused_here)
        # Raises naming parameters without a gradient; issues what the schedule
        # held back; waits for the reductions where the schedule says so (wfbp:
        # .grad holds the average, as with DDP) or where they read .grad's
        # memory, which the user's code may write next (scaler.unscale_, clipping).
        engine.end_backward()
        if self.options.find_unused_parameters:
            self._agree_on_unused(unused_here)
        self.delayed.after_backward()  # a loaded checkpoint's delayed gradients; the guard's figures
        self._grad_versions = self.update.grad_versions(self.params)  # None where step() applies .grad as it is then
        self.backwards += 1

    def _agree_on_unused(self, unused_here: List[int]) -> None:
        """find_unused_parameters: which parameters no rank used (and none had
        a .grad from no_sync() micro-batches), one small all-reduce per
        backward, as DDP's. As with DDP they keep .grad None and step() leaves
        them and their optimizer state alone: a zero gradient would still
        move them under momentum or weight decay."""
        flags = torch.zeros(len(self.params), dtype=torch.int32, device=self.params[0].device)
        flags[unused_here] = 1
        within(self.timeout, "the all-reduce of which parameters got no gradient (find_unused_parameters)",
               dist.all_reduce, flags, op=dist.ReduceOp.MIN, group=self.group)
        self.unused_everywhere = frozenset(flags.nonzero().flatten().tolist())
        if self.update.averaged_in_grad:  # .grad holds the average, zeros for these: None, as DDP leaves it
            delayed = self.delayed.delays or {}
            for i in self.unused_everywhere:
                if self.names[self.params[i]] not in delayed:  # a delayed bucket's .grad is an earlier step's
                    self.params[i].grad = None

    def _check_not_replaced(self, indices: List[int]) -> None:
        """A parameter replaced after wrap() (``module.weight = nn.Parameter(...)``)
        gets no gradient hook and is in no bucket: its old self misses a
        gradient. Named here, rather than as an unused parameter."""
        replaced = []
        for i in indices:
            name = self.names[self.params[i]]
            try:
                current = self._module.get_parameter(name)
            except AttributeError:
                current = None
            if current is not self.params[i]:
                replaced.append(name)
        if replaced:
            raise RuntimeError(
                f"dearcomm: parameter(s) {replaced} of the wrapped model were replaced after wrap() (e.g. "
                "module.weight = nn.Parameter(...)); dearcomm's buckets and the optimizer still hold the old "
                "ones, so the new ones would train unsynchronised. Copy new values in place instead (after "
                "model.sync(): with torch.no_grad(): module.weight.copy_(value), or load_state_dict()), or change "
                "the model before wrap()")

    # ---- what step() checks and reports -------------------------------------

    def grads_changed_since_backward(self, allowed_changes: int = 0) -> List[str]:
        """dear: names of parameters whose .grad was modified (more than
        ``allowed_changes`` in-place writes: scaler.unscale_ makes one) or
        replaced after backward. Their change would be silently lost: the
        gradients that step() applies were reduce-scattered during backward."""
        if self._grad_versions is None:
            return []
        changed = []
        for param, (grad, version) in zip(self.params, self._grad_versions):
            if param.grad is not grad or (grad is not None and grad._version - version > allowed_changes):
                changed.append(self.names[param])
        return changed

    def forget_grad_versions(self) -> None:
        self._grad_versions = None

    def register_update_hook(self, hook: UpdateHook) -> "_UpdateHookHandle":
        self._next_hook_id += 1
        self._update_hooks[self._next_hook_id] = hook
        return _UpdateHookHandle(self, self._next_hook_id)

    def _log_layout(self) -> None:
        """The buckets training goes on with, once, at INFO on rank 0; while
        "auto" tries candidates (its own lines name them) at DEBUG, and at
        INFO at the first step after it settles, rebuilt or not."""
        if self.rank != 0 or self._layout_logged or self.engine is None:
            return
        trial = self.auto is not None and not self.auto.settled
        layout = self.engine.layout
        logger.log(logging.DEBUG if trial else logging.INFO,
                   "dearcomm: schedule=%s update=%s, %d parameters in %d buckets on %s\n%s",
                   self.options.schedule, self.options.update, len(self.params), len(layout.buckets),
                   self.engine.backend, layout.describe())
        self._layout_logged = not trial

    def after_step(self, updated: bool = True) -> None:
        """Called by the optimizer at the end of step(): which buckets' update
        hooks are due once their parameters are current; "auto" checks its
        prediction against the measured iterations. ``updated=False``: a step
        zero_grad() skipped, which calls no update hook."""
        self._unused_this_step = frozenset()
        self.overlap.step_ended()
        if self.auto is not None:
            self.auto.step_ended()
            self._log_layout()
        if self._update_hooks and updated:
            self._unreported = list(range(len(self.engine.layout.buckets)))
            self._reported.reset()
            if self.engine.state != _C.IterationState.GATHERING:
                self._report_updates(list(self._unreported))  # wfbp, or a skipped step: current already
        self.delayed.step_ended()  # last: switching delays off rebuilds the engine

    def _report_updates(self, buckets: List[int]) -> None:
        """Runs the update hooks for ``buckets``, now current. A parameter that
        spans buckets is reported once, with the last of them; a bucket with
        no parameter completed reports nothing."""
        for bucket in buckets:
            if bucket not in self._unreported:
                continue
            self._unreported.remove(bucket)
            params = [self.params[i] for i in self._reported.done(bucket)]
            if params:
                for hook in list(self._update_hooks.values()):
                    hook([(self.names[p], p) for p in params])

    # ---- engine ------------------------------------------------------------

    def reconfigure(self, options: WrapOptions) -> None:
        """Trains with ``options`` from the next backward on ("auto" chose
        them): the engine, if built, is dropped after its pending work and
        laid out again at the next backward; the optimizer moves its state
        to the new update strategy (on_reconfigure)."""
        self.sync()
        finish = [callback() for callback in self.on_reconfigure]
        if self.engine is not None:
            self._drain.detach()
            for param in self.params:
                param.grad = None  # views into the old buckets; the next backward writes new ones
            self.engine = None
            self._module_buckets.clear()
        self.options = options
        self.update = strategy_class(options.update_strategy)
        for done in finish:
            done()

    def _check_blocks(self) -> None:
        """WrapOptions.blocks (and the names in priorities) against the
        parameters they name (at wrap time: the errors can give names, which
        the planner's cannot)."""
        blocks = self.options.blocks or {}
        params = self.by_name
        for option in ("blocks", "priorities", "delays"):
            unknown = sorted(set(getattr(self.options, option) or {}) - set(params))
            if unknown:
                raise ValueError(f"dearcomm: {option} names {unknown}, which are not trainable parameters of the "
                                 f"module")
        for name, pieces in blocks.items():
            p = params[name]
            unit = _C.partition_unit(self.world_size, p.dtype)
            if sum(pieces) != p.numel():
                raise ValueError(f"dearcomm: blocks[{name!r}] add up to {sum(pieces)} elements, but the parameter "
                                 f"has {p.numel()}")
            uneven = [n for n in pieces[:-1] if n % unit]
            if uneven:
                raise ValueError(f"dearcomm: blocks[{name!r}] has pieces of {uneven} elements; every piece but the "
                                 f"last must be a multiple of {unit} (world_size {self.world_size} x 64 bytes of "
                                 f"{p.dtype})")

    def _explicit_blocks(self, names: List[str]) -> List[List[int]]:
        """WrapOptions.blocks in forward order: an empty list where none."""
        blocks = self.options.blocks
        return [list(blocks.get(name, ())) for name in names] if blocks else []

    def _build_engine(self) -> None:
        now = {p for p in self._module.parameters() if p.requires_grad}
        if now != set(self.names):
            added = [n for n, p in self._module.named_parameters() if p.requires_grad and p not in self.names]
            removed = [n for p, n in self.names.items() if p not in now]
            raise ValueError(f"dearcomm: the module's trainable parameters changed after wrap() (added {added}, "
                             f"removed or frozen {removed}); change the model before wrapping it")
        self._frozen = [(n, p) for n, p in self._module.named_parameters() if p not in self.names]
        readers = self._parameter_readers()
        self.params = self._agree_on_forward_order(readers)
        self.index = {p: i for i, p in enumerate(self.params)}
        names = [self.names[p] for p in self.params]

        layout = _C.plan_buckets(
            [p.numel() for p in self.params],
            [p.dtype for p in self.params],
            self.options.bucket_cap_bytes,
            self.world_size,
            self.options.partition_bytes,
            self._explicit_blocks(names),
        )
        device = self.params[0].device
        backend = _cuda.nccl_backend(self.group, device, self.timeout) if device.type == "cuda" else None
        if backend is None and self._engine_group is None:
            check_switches(self.group, self.timeout)  # the CPU backend's: they choose its collectives
            self._engine_group = engine_group(self.group, self.timeout)  # kept when auto rebuilds the engine
        choice = self.options.choice
        if self.options.priorities:
            ranks = [self.options.priorities.get(name) for name in names]
            choice = choice.with_bucket_priorities(bucket_priorities(layout, ranks))
        if self.options.delays:
            choice = choice.with_bucket_delays(
                bucket_delays(layout, [self.options.delays.get(name, 0) for name in names], names))
        self.engine = _C.Engine(
            layout, self.params, names, self.group if backend is not None else self._engine_group,
            choice, self.timeout.total_seconds(), backend, self.options.comm_dtype,
            grad_views_enabled(),
        )
        self._reported = completion_of(layout)
        # A model dropped right after step() still has all-gathers in flight
        # into the engine's buffers: they must finish before the engine goes.
        self._drain = weakref.finalize(self._module, _drain, self.engine)
        self._drain.atexit = False  # at exit the process group may be gone; nothing is read again anyway
        for module, params in readers.items():
            self._module_buckets[module] = sorted({b for p in params for b in buckets_of(layout.params[self.index[p]])})
        for module, handle in list(self._forward_handles.items()):
            if not self._module_buckets.get(module):
                handle.remove()  # nothing to wait for: no Python call per forward
                del self._forward_handles[module]
        self._layout_logged = False
        self._log_layout()
        for callback in self.on_engine_built:
            callback(self.engine)

    def _parameter_readers(self) -> Dict[nn.Module, List[nn.Parameter]]:
        """Which module's forward pre-hook must make each parameter current:
        its owner, and, for a parameter whose owner did not run in the first
        forward, the nearest ancestor that did — a module whose forward reads
        a child's parameter without calling the child (nn.MultiheadAttention
        and out_proj; F.linear(x, self.child.weight)) runs its pre-hook before
        that read. A parameter no running module contains goes to the root."""
        parent: Dict[nn.Module, nn.Module] = {}
        for module in self._module.modules():
            for child in module.children():
                parent.setdefault(child, module)
        readers: Dict[nn.Module, List[nn.Parameter]] = {}
        for module, owned in self._module_params.items():
            readers.setdefault(module, []).extend(owned)  # a later forward may call it after all
            reader = module
            while reader not in self._ran_set and reader in parent:
                reader = parent[reader]
            if reader is not module:
                readers.setdefault(reader if reader in self._ran_set else self._module, []).extend(owned)
        return readers

    def _agree_on_forward_order(self, readers: Dict[nn.Module, List[nn.Parameter]]) -> List[nn.Parameter]:
        """Every rank lays out buckets in rank 0's first-forward order (a
        data-dependent first forward may differ between ranks), after checking
        that every rank trains the same parameters; parameters rank 0's forward
        did not use go last, in registration order."""
        mine_order: List[nn.Parameter] = []
        seen = set()
        for module in self._ran:
            for param in readers.get(module, ()):
                if param not in seen:
                    seen.add(param)
                    mine_order.append(param)
        mine = [(name, tuple(p.shape), str(p.dtype)) for p, name in self.names.items()]
        # The first backward's: a peer still in its first forward (or stalled) is bounded by wrap(timeout=).
        everyone = all_gather_object_within((mine, [self.names[p] for p in mine_order]), self.group, self.timeout,
                                            "the first backward's check that every rank trains the same parameters",
                                            next(iter(self.names)).device)
        for rank, (theirs, _) in enumerate(everyone):
            if theirs != mine:
                diff = next((i for i, (a, b) in enumerate(zip(mine, theirs)) if a != b), min(len(mine), len(theirs)))
                raise ValueError(
                    f"dearcomm: [rank {self.rank}] rank {rank} trains different parameters: {len(theirs)} vs "
                    f"{len(mine)}; first difference at position {diff}: "
                    f"{theirs[diff] if diff < len(theirs) else None} vs {mine[diff] if diff < len(mine) else None}. "
                    "Every rank must wrap the same model.")
        order = [self.by_name[name] for name in everyone[0][1]]
        used = set(order)
        return order + [p for p in self.names if p not in used]

    def zero_grad(self, params, set_to_none: bool = True) -> None:
        """zero_grad() of the optimizer and of the module: see
        Engine.zero_grads for a .grad that is a view into its bucket (None, or
        zero-filled in place and kept); any other .grad gets torch's
        zero_grad(set_to_none)."""
        engine, others = self.engine, []
        if engine is None:
            others = list(params)
        else:
            mine = []
            for param in params:
                i = self.index.get(param)
                if i is None:
                    others.append(param)
                else:
                    mine.append(i)
            # A backward whose end ran through: one that raised (midway, or at
            # its end) leaves both set, and the next training forward names it.
            ended = not (self._end_of_backward_queued or self._grads_arrived)
            if len(set(mine)) == len(self.params) and ended and not self.planning and \
                    engine.state in (_C.IterationState.BACKWARD, _C.IterationState.REDUCED):
                self._skip_step()
            others += [self.params[i] for i in engine.zero_grads(mine, set_to_none)]
        for param in others:  # torch's zero_grad, for every .grad that is no bucket view
            if param.grad is None:
                continue
            if set_to_none:
                param.grad = None
            else:
                if param.grad.grad_fn is not None:
                    param.grad.detach_()
                else:
                    param.grad.requires_grad_(False)
                param.grad.zero_()

    def _skip_step(self) -> None:
        """Every gradient zeroed between a backward and step(): the step is
        skipped, as GradScaler skips one (the reductions finish, nothing is
        applied, the parameters stay current), and the next backward starts
        a new iteration. The loop that skips a step where the gradient norm is
        not finite runs as under DDP; every rank must skip the same steps.
        Under dear the step's all-gathers still go out (unchanged shards, or
        averages left unapplied) and skip_step() waits for them, so a rank that
        skips alone issues the engine's collectives as the others do, and the
        parameters are current when the skip returns."""
        if self.delayed.delays:
            raise NotImplementedError(
                "dearcomm: zero_grad() between backward and step() skips the step, which schedule='deft' with "
                "delayed buckets cannot do: a delayed gradient of an earlier backward is applied at this step. "
                "Skip steps with wrap(..., max_delay=0), or call step()")
        self.engine.begin_step(averages_needed=True)
        self.forget_grad_versions()
        for callback in self.on_step_skipped:
            callback()  # before the gathers that skip_step() issues under dear: they read the master shards
        self.engine.skip_step()
        self.after_step(updated=False)  # no update hook: a DDP loop that skips updates no EMA either

    def sync(self) -> None:
        if self.engine is not None:
            self.engine.flush()
            if self._unreported:
                self._report_updates(list(self._unreported))

    def hook_handles(self) -> list:
        """Every hook this runtime installed (on modules and parameters)."""
        planners = [p.handle for p in (self.auto, self.planner) if p is not None]
        return list(self._forward_handles.values()) + self._handles + planners

    def close(self) -> None:
        """Removes every hook, without finishing pending work (sync() first
        for that; after a failure a peer may be gone); the engine and its
        buffers go with the last reference to them."""
        if self.engine is not None:
            self._drain.detach()
        for handle in self.hook_handles():
            handle.remove()
        self._forward_handles.clear()
        self._handles.clear()
        self.engine = None
        self._engine_group = None  # its connections go with the engine
        self.closed = True
        self.on_engine_built.clear()
        self.on_step_skipped.clear()
        self._update_hooks.clear()
        for undo in self.on_close:
            undo()
        self.on_close.clear()


def _drain(engine: _C.Engine) -> None:
    """Waits for a dropped model's collectives (and, replicated, applies its
    last update if the optimizer still exists)."""
    try:
        engine.flush()
    except Exception as e:  # noqa: BLE001 - nobody is left to raise to
        logger.warning("dearcomm: a dropped model's pending all-gathers failed: %s", e)


class _UpdateHookHandle:
    def __init__(self, runtime: DearRuntime, key: int) -> None:
        self._runtime, self._key = weakref.ref(runtime), key

    def remove(self) -> None:
        runtime = self._runtime()
        if runtime is not None:
            runtime._update_hooks.pop(self._key, None)
