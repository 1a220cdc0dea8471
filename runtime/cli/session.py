"""A model under planning, from loading to real steps: the library code the CLI and
`runtime.testing` build on.

MODEL is a built-in example (gpt2, mlp, resnet, unet), `path/to/file.py:factory` or
`package.module:factory`. The factory takes no arguments and returns `(model, inputs)`,
`(model, inputs, loss_fn)` or `(model, args, loss_fn, kwargs)` (a runtime.examples.Example),
where inputs is a tuple (positional), a dict (keyword) or one tensor. docs/example_model.py is one;
benchmarks/zoo_models.py has the real architectures (`benchmarks/zoo_models.py:hf_llama`).
Here: load it (`load_model`), profile it on fake tensors and solve for a budget (`profile_model`,
`solve_budget`), and run real training steps under a plan to measure their peak and extra time
(`measure_peak_bytes`, `measure_extra_pct`). Errors from the user's code become one-line
ModelErrors (`model_code`).
"""
from __future__ import annotations

import importlib
import importlib.util
import time
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path
from typing import Callable, NamedTuple

import torch
from remat.planner.compat import tree_flatten

from remat.planner import Analysis, CostGraph, InfeasibleBudgetError, PlanOptions, TraceError, analyze, solve_plan
from remat.planner.api import analyze_for
from remat.planner.errors import BudgetError
from remat.planner.fit import unplanned_peak_bytes
from remat.planner.result import Plan

from .. import examples
from ..api import ExactReplay
from ..measure import peak_memory, preserved, training_loss
from ..measure.timing import StepTiming, interleaved_times, step_timing
from ..rewrite import REGION_PROBE, CompiledReplay, RecomputeTimes, rewrite_plan


class UsageError(Exception):
    """Bad command-line input: exit code 2, one line, no traceback."""


class ModelError(UsageError):
    """The model, its factory or its training step failed: exit code 2, one line."""


class Loaded(NamedTuple):
    model: torch.nn.Module
    args: tuple
    kwargs: dict
    loss_fn: Callable | None
    label: str


# ----------------------------------------------------------------------------- the model
def split_inputs(inputs) -> tuple[tuple, dict]:
    """A factory's inputs as (args, kwargs): a dict is keyword, a tensor one positional argument."""
    if isinstance(inputs, dict):
        return (), dict(inputs)
    if isinstance(inputs, torch.Tensor):
        return (inputs,), {}
    if isinstance(inputs, (tuple, list)):
        return tuple(inputs), {}
    raise TypeError(f"inputs must be a tuple, a dict or a tensor, got {type(inputs).__name__}")


def _import(where: str):
    if not where.endswith(".py"):
        return importlib.import_module(where)
    path = Path(where)
    if not path.is_file():
        raise UsageError(f"MODEL file {where!r} does not exist")
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def load_model(spec: str | None) -> Loaded:
    """The model, its inputs and loss from a MODEL spec (see the module docstring); None is gpt2."""
    if spec is None or spec in examples.EXAMPLES:
        name = spec or "gpt2"
        ex = examples.EXAMPLES[name]()
        return Loaded(ex.model, ex.inputs, {}, ex.loss_fn, f"built-in {name}")
    if ":" not in spec:
        raise UsageError(f"MODEL {spec!r}: use a built-in ({', '.join(examples.EXAMPLES)}), "
                         "path/to/file.py:factory or package.module:factory (e.g. docs/example_model.py:make)")
    where, factory_name = spec.rsplit(":", 1)
    with model_code(f"cannot load {spec!r}"):
        factory = getattr(_import(where), factory_name)
    with model_code(f"factory {spec!r} raised"):
        made = factory()
    if not isinstance(made, tuple) or len(made) not in (2, 3, 4):
        raise ModelError(f"factory {spec!r} must return (model, inputs), (model, inputs, loss_fn) or "
                         f"(model, args, loss_fn, kwargs), not {type(made).__name__}")
    with model_code(f"factory {spec!r}"):
        args, kwargs = split_inputs(made[1])
        if len(made) == 4 and made[3]:
            kwargs = {**kwargs, **dict(made[3])}
    return Loaded(made[0], args, kwargs, made[2] if len(made) >= 3 else None, spec)


@contextmanager
def model_code(what: str):
    """Errors from the user's code (or from running it) become one-line ModelErrors."""
    try:
        yield
    except (UsageError, InfeasibleBudgetError, BudgetError):
        raise
    except Exception as e:
        first_line = next((line for line in str(e).splitlines() if line.strip()), "")
        raise ModelError(f"{what}: {type(e).__name__}: {first_line}") from e


OPTIMIZERS = {"adamw": torch.optim.AdamW, "adam": torch.optim.Adam, "sgd": torch.optim.SGD,
              "sgd-momentum": lambda params: torch.optim.SGD(params, lr=0.01, momentum=0.9)}


def make_optimizer(name: str | None, model: torch.nn.Module):
    """`--optimizer NAME`: torch's optimizer with its defaults over the trainable parameters."""
    if name is None:
        return None
    if name not in OPTIMIZERS:
        raise UsageError(f"--optimizer {name!r}: use one of {', '.join(OPTIMIZERS)}")
    params = [p for p in model.parameters() if p.requires_grad]
    return OPTIMIZERS[name](params) if name != "sgd" else torch.optim.SGD(params, lr=0.01)


DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def hf_config_model(path: str, batch: int, seq: int, dtype: str) -> Loaded:
    """A Hugging Face causal LM built from a local config.json on `meta` (no weights, no hub),
    with a (batch, seq) batch of token ids as its inputs and labels: its loss is the model's."""
    if dtype not in DTYPES:
        raise UsageError(f"--dtype {dtype!r}: use one of {', '.join(DTYPES)}")
    if not Path(path).is_file():
        raise UsageError(f"--hf-config {path!r} is not a file")
    with model_code(f"cannot build a model from {path!r} (needs `pip install -e '.[hf]'`)"):
        import transformers
        config = transformers.AutoConfig.from_pretrained(path)
        with torch.device("meta"):
            model = transformers.AutoModelForCausalLM.from_config(config).to(DTYPES[dtype]).train()
            ids = torch.randint(config.vocab_size, (batch, seq))
    label = f"{type(model).__name__} from {path} (batch {batch}, seq {seq}, {dtype}, on meta)"
    return Loaded(model, (), {"input_ids": ids, "labels": ids}, lambda out: out.loss, label)


def profile_model(loaded: Loaded, say, options: PlanOptions = PlanOptions(), optimizer=None) -> Analysis:
    say(f"tracing and profiling {loaded.label} on fake tensors ...")
    with model_code(f"cannot profile {loaded.label}"):
        try:
            analysis = analyze_for(loaded.model, loaded.args, loaded.kwargs, loaded.loss_fn, options, optimizer,
                                   REGION_PROBE)
        except TraceError as e:
            raise ModelError(f"{e}. No graph, so no report here: plan_and_wrap still plans this model over "
                             "its module tree, measuring each choice with a real step") from e
    say(f"{len(analysis.cost_graph.nodes)} nodes profiled in {analysis.analyze_s:.1f} s")
    return analysis


def solve_budget(loaded: Loaded, analysis: Analysis, budget_bytes: int, options: PlanOptions,
                 compiled: bool = False) -> Plan:
    """The least-recompute plan for the budget, every candidate replayed exactly on fake tensors
    (with opaque modules, the larger of that and the simulator) or, `compiled`, compiled and run
    for real (runtime.rewrite.compiled; plain regions only). Raises InfeasibleBudgetError."""
    if compiled:
        options = replace(options, solve=replace(options.solve, sac=False))
        measure = CompiledReplay(loaded.model, analysis, loaded.loss_fn, {})
    else:
        measure = ExactReplay(loaded.model, analysis, loaded.loss_fn)
    return solve_plan(analysis.cost_graph, budget_bytes, options, analysis.traced.opaque, measure=measure)


# ----------------------------------------------------------------------------- real steps
def _device(loaded: Loaded) -> torch.device:
    tensors = [t for t in tree_flatten((loaded.args, loaded.kwargs))[0] if isinstance(t, torch.Tensor)]
    return tensors[0].device if tensors else torch.device("cpu")


def _forward_fn(loaded: Loaded, analysis: Analysis, plan: Plan | None) -> Callable:
    """The model's forward, or the plan's rewritten forward, on the example inputs."""
    if plan is None or not plan.regions:
        return lambda: loaded.model(*loaded.args, **loaded.kwargs)
    gm = rewrite_plan(loaded.model, analysis.traced.gm, plan)
    return lambda: gm(**analysis.example_inputs)


def _step_fn(loaded: Loaded, forward: Callable) -> Callable:
    params = list(loaded.model.parameters())

    def step():
        for p in params:
            p.grad = None
        training_loss(forward(), loaded.loss_fn).backward()
    return step


def measure_peak_bytes(loaded: Loaded, analysis: Analysis, plan: Plan | None, compiled: bool = False) -> int:
    """Peak live bytes of one real training step under the plan (None: without one); `compiled`:
    the rewritten model compiled afresh, its second step metered at the allocator."""
    if compiled:
        return CompiledReplay(loaded.model, analysis, loaded.loss_fn, {})(plan.regions if plan else ())
    step = _step_fn(loaded, _forward_fn(loaded, analysis, plan))
    with preserved(loaded.model):
        return peak_memory(step, loaded.model, *loaded.args, *loaded.kwargs.values(), device=_device(loaded))


def _best_times_s(fns: list[Callable], device: torch.device, repeats: int = 5) -> list[float]:
    """Best wall time of each function, after one warm-up each; run interleaved so drift hits all alike."""
    return [min(ts) for ts in interleaved_times(fns, device, rounds=repeats, warmup=1)]


def measure_extra_pct(loaded: Loaded, analysis: Analysis, plan: Plan) -> float:
    """Real extra step time under the plan, as % of the real forward: the unit of Plan.extra_compute_pct."""
    forward = _forward_fn(loaded, analysis, None)
    fns = [_step_fn(loaded, forward), _step_fn(loaded, _forward_fn(loaded, analysis, plan)), forward]
    with preserved(loaded.model):
        base_s, planned_s, forward_s = _best_times_s(fns, _device(loaded))
    return 100.0 * (planned_s - base_s) / forward_s


def time_plan(loaded: Loaded, analysis: Analysis, plan: Plan) -> StepTiming:
    """The plan's real step against the unplanned step on the example inputs, timed in
    interleaved rounds (runtime.measure.timing), beside the plan's own estimate, with each
    region's recompute timed in backward."""
    device = _device(loaded)
    gm = rewrite_plan(loaded.model, analysis.traced.gm, plan)
    fns = [_step_fn(loaded, _forward_fn(loaded, analysis, None)), _step_fn(loaded, lambda: gm(**analysis.example_inputs))]
    with preserved(loaded.model), RecomputeTimes(gm, device) as regions:
        timing = step_timing(*fns, plan.recompute_s, plan.cost_model, device)
    return replace(timing, region_recompute_s=regions.fastest())
