"""The CLI's models: loading a MODEL spec and profiling it, its errors as one-line ModelErrors.

MODEL is a built-in example (gpt2, mlp, resnet, unet), `path/to/file.py:factory` or
`package.module:factory`. The factory takes no arguments and returns `(model, inputs)`,
`(model, inputs, loss_fn)` or `(model, args, loss_fn, kwargs)` (a runtime.examples.Example),
where inputs is a tuple (positional), a dict (keyword) or one tensor. docs/example_model.py is one;
benchmarks/zoo_models.py has the real architectures (`benchmarks/zoo_models.py:hf_llama`).
Here: load it (`load_model`) and profile it on fake tensors (`profile_model`); solving for a
budget and real steps under a plan are runtime.steps' (`assert_fits` uses them too). Errors from
the user's code become one-line ModelErrors (`model_code`).
"""
from __future__ import annotations

import importlib
import importlib.util
from contextlib import contextmanager
from pathlib import Path

import torch

from remat.planner import Analysis, InfeasibleBudgetError, PlanOptions, TraceError
from remat.planner.api import analyze_for
from remat.planner.errors import BudgetError

from .. import examples
from ..rewrite import REGION_PROBE
from ..steps import Loaded, split_inputs


class UsageError(Exception):
    """Bad command-line input: exit code 2, one line, no traceback."""


class ModelError(UsageError):
    """The model, its factory or its training step failed: exit code 2, one line."""


# ----------------------------------------------------------------------------- the model
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
