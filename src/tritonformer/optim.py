"""`tritonformer.optim.AdamW`: torch's AdamW (same arguments, state and state_dict; a subclass), its
step two launches for each dtype and device of a parameter group, whatever the tensor count
(ops/adamw.py; docs/optim.md).

    opt = tritonformer.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.1)

The step counts live on the parameters' device (as torch's capturable AdamW keeps them, whatever
`capturable` says), so the step can be captured in a CUDA graph (`tritonformer.capture_step`), with
the learning rate a float or a tensor (which schedulers update in place). `foreach` and `fused` are
taken and ignored: there is one implementation. float64 params take torch's arithmetic, a tensor at
a time. `differentiable=True` is refused.

`step_in_backward=True` steps each parameter inside `backward()`, as soon as its gradient is
complete (a post-accumulate-grad hook), and frees that gradient: a step's peak memory then holds
no model-sized set of gradients (docs/optim.md). The results are those of the usual step. Keep
calling `step()` (it finds nothing left to do, but `capture_step` learns of the optimizer from
it) and `zero_grad()`. It does not suit what needs every gradient before the step (clipping by
the global norm, accumulating over several backward passes) nor reentrant checkpointing (a
weight used in two segments gets two steps); another optimizer over the same parameters sees
no gradients (a second one with step_in_backward is refused while the first lives).
"""

from __future__ import annotations

import contextlib
import functools
import weakref

import torch

from . import runtime
from .ops.adamw import adamw_step, adamw_step_reference

__all__ = ["AdamW"]


class AdamW(torch.optim.AdamW):
    def __init__(self, params, lr: float | torch.Tensor = 1e-3, betas=(0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 1e-2, amsgrad: bool = False, *, maximize: bool = False, foreach=None,
                 capturable: bool = False, differentiable: bool = False, fused=None,
                 step_in_backward: bool = False) -> None:
        if differentiable:
            raise ValueError("tritonformer.optim.AdamW has no differentiable step; use torch.optim.AdamW for that")
        if not isinstance(step_in_backward, bool):
            raise TypeError(f"step_in_backward must be a bool, got {type(step_in_backward).__name__}")
        # Read by add_param_group, which torch's __init__ calls for each group.
        self._step_in_backward = step_in_backward
        super().__init__(params, lr, betas, eps, weight_decay, amsgrad, maximize=maximize, capturable=capturable)
        self._compile_ahead()

    def add_param_group(self, param_group: dict) -> None:
        super().add_param_group(param_group)
        if getattr(self, "_step_in_backward", False):
            index = len(self.param_groups) - 1
            params = [p for p in self.param_groups[index]["params"] if p.requires_grad]
            for p in params:
                owner = _STEPPED_IN_BACKWARD.get(id(p))
                if owner is not None and owner[0]() is p and owner[1]() not in (None, self):
                    raise ValueError("step_in_backward: a parameter is already stepped inside backward by another "
                                     "live optimizer; delete that one first (both would step it)")
            # The group by its index when the hook runs (load_state_dict replaces the groups' dicts);
            # the optimizer by a weak reference (the parameters' hooks must not keep it alive).
            hook = functools.partial(_step_in_hook, weakref.ref(self), index)
            for p in params:
                _STEPPED_IN_BACKWARD[id(p)] = (weakref.ref(p), weakref.ref(self))
                p.register_post_accumulate_grad_hook(hook)

    def _compile_ahead(self) -> None:
        """Compile the step's kernel for each group's dtypes in the background now, not at the
        first step (about a second of a small model's warm-up)."""
        for group in self.param_groups:
            for dtype, device in {(p.dtype, p.device) for p in group["params"] if p.is_cuda}:
                if dtype not in runtime.FLOAT_DTYPES:
                    continue
                example = [[torch.zeros(16, dtype=dtype, device=device)] for _ in range(5)]
                step = functools.partial(adamw_step, *example[:4], [torch.zeros((), device=device)], lr=0.0,
                                         maximize=group["maximize"],
                                         max_exp_avg_sqs=example[4] if group["amsgrad"] else None)
                with torch.cuda.device(device):
                    runtime.compile_ahead(("adamw", device, dtype, group["amsgrad"], group["maximize"]), step)

    def __setstate__(self, state) -> None:
        super().__setstate__(state)
        self._counts_on_devices()

    def load_state_dict(self, state_dict) -> None:
        super().load_state_dict(state_dict)
        self._counts_on_devices()

    def _counts_on_devices(self) -> None:
        """Step counts as this step reads them: float32 on each parameter's device (a state_dict of
        torch's non-capturable AdamW holds them on the CPU)."""
        for group in self.param_groups:
            for p in group["params"]:
                state = self.state.get(p)
                if state and "step" in state:
                    state["step"] = torch.as_tensor(state["step"], dtype=torch.float32).to(p.device)

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            self._step_params(group, group["params"])
        return loss

    def _step_params(self, group: dict, group_params: list) -> None:
        """The step of those of a group's parameters that have a gradient, a launch pair for each
        device and dtype among them."""
        amsgrad = group["amsgrad"]
        buckets: dict[tuple, tuple[list, ...]] = {}
        for p in group_params:
            grad = p.grad
            if grad is None:
                continue
            if grad.is_sparse:
                raise RuntimeError("AdamW does not support sparse gradients")
            state = self.state[p]
            if not state:
                state["step"] = torch.zeros((), dtype=torch.float32, device=p.device)
                state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                if amsgrad:
                    state["max_exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            lists = buckets.get((p.device, p.dtype))
            if lists is None:
                lists = buckets[(p.device, p.dtype)] = ([], [], [], [], [], [])
            lists[0].append(p)
            lists[1].append(grad)
            lists[2].append(state["exp_avg"])
            lists[3].append(state["exp_avg_sq"])
            lists[4].append(state["step"])
            if amsgrad:
                lists[5].append(state["max_exp_avg_sq"])
        beta1, beta2 = (float(b) for b in group["betas"])
        for (device, dtype), (params, grads, exp_avgs, exp_avg_sqs, steps, max_sqs) in buckets.items():
            lr = group["lr"]
            if isinstance(lr, torch.Tensor) and lr.device != device:
                lr = lr.item()  # a CPU tensor's value: no wait for a device
            # float64 params take torch's arithmetic, a tensor at a time (the kernel computes in float32).
            step = adamw_step_reference if dtype == torch.float64 else adamw_step
            options = dict(lr=lr, beta1=beta1, beta2=beta2, eps=group["eps"], weight_decay=group["weight_decay"],
                           maximize=group["maximize"], max_exp_avg_sqs=max_sqs if amsgrad else None)
            # The launch goes to the current device: make it the params'.
            on_device = device.type == "cuda" and device.index != torch.cuda.current_device()
            with torch.cuda.device(device) if on_device else contextlib.nullcontext():
                step(params, grads, exp_avgs, exp_avg_sqs, steps, **options)


# id(parameter) -> (the parameter, its step_in_backward optimizer), both weakly: one optimizer a
# parameter steps it inside backward.
_STEPPED_IN_BACKWARD: dict[int, tuple[weakref.ref, weakref.ref]] = {}


@torch.no_grad()
def _step_in_hook(optimizer: weakref.ref, index: int, p: torch.Tensor) -> None:
    """step_in_backward's hook: p's step, its gradient freed (nothing once the optimizer is gone)."""
    opt = optimizer()
    if opt is not None:
        opt._step_params(opt.param_groups[index], [p])
        p.grad = None
