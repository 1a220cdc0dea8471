"""Plans for torch.compile: the step that runs is Inductor's, so each plan's peak is measured.

Under `torch.compile` a plain region (one that keeps no nodes) becomes Dynamo's checkpoint op
inside the one graph (runtime.rewrite), and AOTAutograd's partitioner decides what else the
compiled step saves between regions. That is not the eager step the fake replay models: Inductor
can save more or less (benchmarks/results/solver-notes.md has a case). So
`CompiledReplay` is the `measure` for `solve_plan` in compile mode: it compiles the model
rewritten with the regions asked about, runs two real steps on the example inputs (the first
compiles; neither leaves a trace on grads, buffers or the RNG) and meters the second at the
allocator. The planner's budget correction loop (planner.solve.fit, NOTE [ budget correction ]) then
works on measured compiled peaks, and the compiled module of the chosen plan is kept for
training.

This runs real steps at the real size: the machine planning must have the memory of the step.
"""
from __future__ import annotations

import torch

from remat.planner.step.state import training_modes

from ..measure import peak_memory, preserved, training_loss
from .graph import rewrite


class CompiledReplay:
    """measure(regions) -> peak bytes of the compiled, rewritten step; compiled modules by plan."""

    what = "the compiled step, measured at the allocator (a real step per plan tried)"
    rounds = 6          # solves the budget correction may take (planner.solve.fit, NOTE [ budget correction ])

    def __init__(self, model: torch.nn.Module, analysis, loss_fn, compile_kwargs: dict):
        self.model, self.analysis, self.loss_fn = model, analysis, loss_fn
        self.compile_kwargs = compile_kwargs
        self.compiled: dict[tuple, torch.nn.Module] = {}
        self.peaks: dict[tuple, int] = {}
        self.names = tuple(c.name for c in analysis.cost_graph.nodes)

    def module(self, regions) -> torch.nn.Module:
        """The compiled model rewritten with `regions` (compiled once per plan)."""
        key = tuple(regions)
        if key not in self.compiled:
            a = self.analysis
            gm = rewrite(self.model, a.traced.gm, key, self.names, a.cost_graph.meta, tuple(m for m, _ in a.traced.opaque))
            self.compiled[key] = torch.compile(gm, **self.compile_kwargs)
        return self.compiled[key]

    def _step(self, compiled) -> None:
        training_loss(compiled(**self.analysis.example_inputs), self.loss_fn).backward()

    def __call__(self, regions) -> int:
        key = tuple(regions)
        if key not in self.peaks:
            compiled = self.module(key)
            inputs = [x for x in self.analysis.example_inputs.values() if isinstance(x, torch.Tensor)]
            device = next((x.device for x in inputs), torch.device("cpu"))
            with preserved(self.model), training_modes(self.model):
                compiled.train()
                for p in self.model.parameters():
                    p.grad = None
                self._step(compiled)                    # compiles (forward and backward graphs)
                for p in self.model.parameters():
                    p.grad = None
                self.peaks[key] = peak_memory(lambda: self._step(compiled), self.model, *inputs,
                                              device=device, allocator=True)
        return self.peaks[key]

