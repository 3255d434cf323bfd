"""Hooks on a model and its optimizer: statistics per layer on observed steps, a cheap
finiteness check on the others, and on-demand requests, answered at the next step.

What runs on the training thread is device work only (small tensors, no .item()): at the
end of an observed step the per-layer results are stacked into one [layers x columns]
tensor and handed to the link thread, which copies it to the host and sends it.

A "step" is one optimizer step of an optimizer that holds the model's parameters (found
through torch's global optimizer hooks, so `watch` needs no optimizer argument); a model
trained without a torch optimizer counts forward passes in training mode instead.

Update/weight ratio: the optimizer step is hooked, and on observed steps only a fixed sample
of each watched parameter (stats.SAMPLE entries; all of a smaller one) is copied before it
and compared after it. That measures the real update of any optimizer (Adam's is not
lr * grad) over exactly one step, where comparing weights between report steps would hold a
copy of the model for the whole interval and measure N steps, not one.
"""

from __future__ import annotations

import fnmatch
import logging
import math
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import torch

from devbox.probe import alerts as alert_policy
from devbox.probe import replies, reporting, stats
from devbox.probe.replies import to_host
from devbox.probe.reporting import Plan, StepReporter
from devbox.protocol import ProbeRequest

log = logging.getLogger("devbox.probe")


def select(
    model: torch.nn.Module, layers: Sequence[str] | None
) -> list[tuple[str, torch.nn.Module]]:
    """The modules to watch: every leaf module, or those whose name matches a pattern."""
    named = [(name, m) for name, m in model.named_modules() if name]
    if layers is None:
        chosen = [(n, m) for n, m in named if not any(True for _ in m.children())]
        return chosen or [("model", model)]
    chosen = [(n, m) for n, m in named if any(fnmatch.fnmatchcase(n, p) for p in layers)]
    if not chosen:
        known = ", ".join(n for n, _ in named[:20]) or "none"
        raise ValueError(f"devbox.probe: no layer matches {list(layers)} (layers: {known})")
    return chosen


class Watcher(StepReporter):
    def __init__(
        self,
        model: torch.nn.Module,
        *,
        every: int,
        layers: Sequence[str] | None,
        thresholds: alert_policy.Thresholds,
        find_socket: Callable[[], str | None] | None = None,
    ) -> None:
        self.model = model
        self.modules = select(model, layers)
        names = [n for n, _ in self.modules]
        super().__init__(
            names, every=every, thresholds=thresholds, framework="torch", find_socket=find_socket
        )
        self._index = {n: i for i, n in enumerate(self.names)}
        self._layer_params: list[list[torch.nn.Parameter]] = [
            [p for p in m.parameters(recurse=len(list(m.children())) > 0) if p.requires_grad]
            for _, m in self.modules
        ]
        self._param_owner = [(i, p) for i, ps in enumerate(self._layer_params) for p in ps]
        self._consts: dict[tuple[Any, ...], torch.Tensor] = {}
        self._model_params = {id(p) for p in model.parameters()}
        self._observing = False  # the current step is observed (layer hooks compute)
        self._plan = Plan(False, False, ())
        self._acts: list[tuple[int, stats.Row]] = []
        self._keep: set[int] = set()  # layers whose output a request wants this step
        self._kept: dict[int, torch.Tensor] = {}
        self._params_part: torch.Tensor | None = None
        self._before: list[torch.Tensor] | None = None
        self._before_norms: torch.Tensor | None = None
        self._samples: list[torch.Tensor | None] = []  # stats.sample_indices per parameter
        self._scratch = stats.Scratch()
        self._in_step = False  # a forward ran since the last step ended
        self._stepper: weakref.ref[torch.optim.Optimizer] | None = None
        self._owned: dict[int, bool] = {}
        self._broken = False
        self._handles: list[Any] = []
        self._hook()
        self.start()

    # --- hooks ------------------------------------------------------------------------

    def _hook(self) -> None:
        from torch.optim.optimizer import (
            register_optimizer_step_post_hook,
            register_optimizer_step_pre_hook,
        )

        root = torch._dynamo.disable(self._guarded(self._begin))
        self._handles.append(self.model.register_forward_pre_hook(lambda m, a: root()))
        # Outside a compiled graph too: at most a graph break after the model's last op.
        check = torch._dynamo.disable(self._guarded(self._check_output))
        self._handles.append(self.model.register_forward_hook(lambda m, a, out: check(out)))
        for i, (_, module) in enumerate(self.modules):
            self._handles.append(module.register_forward_hook(self._layer_hook(i)))
        pre, post = self._guarded(self._pre_step), self._guarded(self._post_step)
        self._handles.append(register_optimizer_step_pre_hook(lambda o, a, k: pre(o)))
        self._handles.append(register_optimizer_step_post_hook(lambda o, a, k: post(o)))

    def _layer_hook(self, index: int) -> Callable[[Any, Any, Any], None]:
        # Traced by torch.compile into the model's graph: it reads two attributes (guards
        # with two values each, so warm-up compiles both variants once) and does device
        # work only. Its body cannot fail on a tensor output.
        def hook(module: Any, args: Any, out: Any) -> None:
            if self._observing:
                if not isinstance(out, torch.Tensor):
                    out = next((o for o in _flat(out) if isinstance(o, torch.Tensor)), None)
                    if out is None:
                        return
                if out.is_floating_point():
                    self._acts.append((index, stats.activation(out, self._scratch)))
                if index in self._keep:
                    self._kept[index] = out.detach()

        return hook

    def _guarded(self, fn: Callable[..., None]) -> Callable[..., None]:
        """The probe never raises into training: the first failure switches it off."""

        def call(*args: Any) -> None:
            if self._broken:
                return
            try:
                fn(*args)
            except Exception:
                self._broken, self._observing = True, False
                log.exception("devbox.probe failed and is now off; training goes on")

        return call

    def _begin(self) -> None:
        if not self.model.training:
            self._observing = False  # evaluation passes are not training steps
            return
        if self._in_step and self._stepper is None:
            self._end_step()  # no optimizer: a forward pass is a step
        self._in_step = True
        self._plan = self.plan()
        self._keep = {self._index[n] for n in self._plan.wants("activation")}
        self._observing = self._plan.observe
        self._acts, self._kept = [], {}

    def _check_output(self, out: Any) -> None:
        """Every step while watched (at report steps otherwise), unless the step is observed
        anyway: is the model's output finite? NaN/Inf anywhere upstream reaches it (a NaN
        born in the backward pass does at the next step, through the weights). One small
        reduction; on a GPU the link thread reads the answer, on the CPU (where reading
        is free) the training thread does, and the link hears only of a bad one."""
        if not self._plan.check or not self.model.training:
            return
        if not isinstance(out, torch.Tensor):
            out = next((o for o in _flat(out) if isinstance(o, torch.Tensor)), None)
        if out is not None and out.is_floating_point():
            total = out.detach().sum(dtype=torch.float32)
            if total.device.type != "cpu":
                self.submit_check(self.step, to_host(total.reshape(1)))
            elif not math.isfinite(total.item()):  # on the CPU reading it is free
                self.force = True
                self.submit_check(self.step, lambda: math.nan)

    def _owns(self, optimizer: torch.optim.Optimizer) -> bool:
        key = id(optimizer)
        if key not in self._owned:
            params = (p for g in optimizer.param_groups for p in g["params"])
            self._owned[key] = any(id(p) in self._model_params for p in params)
        return self._owned[key]

    def _pre_step(self, optimizer: torch.optim.Optimizer) -> None:
        if not self._owns(optimizer):
            return
        if self._stepper is None or self._stepper() is None:
            self._stepper = weakref.ref(optimizer)
        elif self._stepper() is not optimizer:
            return  # a second optimizer of the same model: the first one counts steps
        if not self.link.connected:
            return
        if not self._observing:
            return
        with_grad = [(i, p) for i, p in self._param_owner if p.grad is not None]
        grads = [p.grad for _, p in with_grad]
        device = self._device()
        owner = self._const("owner", tuple(i for i, _ in with_grad), torch.long)
        layers = len(self.names)
        grad_norm, grad_bad = stats.per_layer_norms(grads, owner, layers)
        params = [p.detach() for _, p in self._param_owner]
        all_owner = self._const("owner", tuple(i for i, _ in self._param_owner), torch.long)
        weight_norm, _ = stats.per_layer_norms(params, all_owner, layers)
        owners = {i for i, _ in with_grad}
        has_grad = self._const("mask", tuple(i in owners for i in range(layers)), torch.bool)
        has_params = self._const("mask", tuple(bool(ps) for ps in self._layer_params), torch.bool)
        nan = torch.full((layers,), math.nan, device=device)
        grad_norm = torch.where(has_grad, grad_norm, nan)
        weight_norm = torch.where(has_params, weight_norm, nan)
        samples = self._sample_indices(params)
        self._before = [stats.pick(p, i, copy=True) for p, i in zip(params, samples, strict=True)]
        self._before_norms = weight_norm
        self._params_part = torch.stack([grad_norm, grad_bad, weight_norm, nan], 1)
        self._answer_parameter_requests()

    def _post_step(self, optimizer: torch.optim.Optimizer) -> None:
        if self._stepper is None or self._stepper() is not optimizer:
            return
        if self._before is not None and self._params_part is not None:
            params = [p.detach() for _, p in self._param_owner]
            samples = self._sample_indices(params)
            after = [stats.pick(p, i, copy=False) for p, i in zip(params, samples, strict=True)]
            torch._foreach_sub_(self._before, after)  # in place: no second copy
            # Sums of squares of the sampled differences, scaled up to the whole tensor.
            norms = torch.stack(torch._foreach_norm(self._before)).float()
            scale = self._const("scale", self._sample_scale(params), torch.float32)
            owner = self._const("owner", tuple(i for i, _ in self._param_owner), torch.long)
            squares = torch.zeros(len(self.names), device=owner.device)
            moved = squares.index_add_(0, owner, norms * norms * scale).sqrt()
            assert self._before_norms is not None
            ratio = moved / self._before_norms  # 0/0 (no weights): NaN, sent as null
            self._params_part[:, 3] = ratio
            self._before = self._before_norms = None
        self._end_step()

    def _end_step(self) -> None:
        self._in_step = False
        observed = self._observing
        if observed:
            self._report(self.step)
        self.step_ended(observed=observed)

    def _report(self, step: int) -> None:
        self._observing = False
        device = self._device()
        layers = len(self.names)
        act = torch.full((layers, reporting.ACT), math.nan, device=device)
        if self._acts:
            rows = self._const("owner", tuple(i for i, _ in self._acts), torch.long)
            values = [v for _, v in self._acts]
            if all(isinstance(v, list) for v in values):  # computed on the CPU: numbers
                act[rows] = torch.tensor(values, device=device)
            else:
                act[rows] = torch.stack([torch.as_tensor(v).to(device) for v in values])
        part = self._params_part
        if part is None:
            part = torch.full((layers, len(reporting.PARAM_COLUMNS)), math.nan, device=device)
            part[:, 1] = 0.0
        matrix = torch.cat([act, part], 1)
        self._params_part, self._acts = None, []
        self._answer_activation_requests(step)
        self.submit_report(step, to_host(matrix))
        self._answer_leftover_requests()

    def _sample_indices(self, params: list[torch.Tensor]) -> list[torch.Tensor | None]:
        """stats.sample_indices of each parameter, made once (again if the model moved)."""
        if len(self._samples) != len(params) or any(
            i is not None and i.device != p.device
            for i, p in zip(self._samples, params, strict=True)
        ):
            self._samples = [stats.sample_indices(p.numel(), p.device) for p in params]
        return self._samples

    @staticmethod
    def _sample_scale(params: list[torch.Tensor]) -> tuple[float, ...]:
        return tuple(max(1.0, p.numel() / stats.SAMPLE) for p in params)

    def _const(self, kind: str, values: tuple[Any, ...], dtype: torch.dtype) -> torch.Tensor:
        """A small constant tensor on the model's device, made once per distinct value: a
        fresh torch.tensor(..., device="cuda") copies from pageable memory and waits for
        the whole stream, a host sync on every observed step."""
        key = (kind, values)
        if key not in self._consts:
            self._consts[key] = torch.tensor(values, dtype=dtype, device=self._device())
        return self._consts[key]

    def _device(self) -> torch.device:
        for _, p in self._param_owner:
            return p.device
        return torch.device("cpu")

    # --- requests ---------------------------------------------------------------------

    def _answer_parameter_requests(self) -> None:
        for r in [r for r in self.active if r["tensor"] != "activation"]:
            params = self._layer_params[self._index[r["layer"]]]
            if r["tensor"] == "gradient":
                parts = [p.grad.detach().flatten() for p in params if p.grad is not None]
            else:
                parts = [p.detach().flatten() for p in params]
            self.answered(r)
            if not parts:
                self.reply_error(r, f"layer {r['layer']} has no {r['tensor']} now")
            else:
                self._answer(r, torch.cat(parts), self.step)

    def _answer_activation_requests(self, step: int) -> None:
        for r in [r for r in self.active if r["tensor"] == "activation"]:
            x = self._kept.get(self._index[r["layer"]])
            if x is not None:
                self.answered(r)
                self._answer(r, x, step)
        self._kept, self._keep = {}, set()

    def _answer_leftover_requests(self) -> None:
        # Without an optimizer step, parameter requests are answered at the step's end.
        if self._stepper is None:
            self._answer_parameter_requests()
        self.expire()

    def _answer(self, r: ProbeRequest, x: torch.Tensor, step: int) -> None:
        self.submit(replies.answer(r, x, step))

    # --- the end ----------------------------------------------------------------------

    def close(self) -> None:
        """Remove every hook and close the link; the model trains as if never watched."""
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        self._observing = False
        self._samples, self._scratch = [], stats.Scratch()
        super().close()


def _flat(out: Any) -> list[Any]:
    if isinstance(out, dict):
        return list(out.values())
    if isinstance(out, list | tuple):
        return list(out)
    return [out]
