"""The planner's errors: typed, carrying their numbers, with the next step in the message."""
from __future__ import annotations

from remat.planner.units import size_text


def gb(n_bytes: int) -> str:
    """Bytes as GB (10^9) with four significant digits: '0.01734 GB', '13.69 GB'."""
    return size_text(n_bytes, "GB")


class RematError(Exception):
    """Base class of every error remat raises on purpose."""


class InfeasibleBudgetError(RematError):
    """No plan fits the budget; `min_feasible_bytes` is the smallest budget that does, by the
    prediction `source` names (`"the exact replay on fake tensors"`, ...). The message prints it
    in `unit`, rounded up: typed back in as the budget, it fits."""

    def __init__(self, budget_bytes: int, min_feasible_bytes: int, source: str = "", unit: str | None = "GB",
                 asked: str = "", floor_plans: tuple = ()):
        self.budget_bytes = int(budget_bytes)
        """The budget asked for, in bytes."""
        self.min_feasible_bytes = int(min_feasible_bytes)
        """The smallest budget that fits, in bytes."""
        self.source, self.unit = source, unit
        self.asked = asked
        """The budget as the user wrote it where that was not a size ('40%'), else ''."""
        self.floor_plans = tuple(floor_plans)
        """The plans the floor was found among, where the planner knows them: (peak bytes by
        `source`, regions), least first (the first one's peak is `min_feasible_bytes`)."""
        floor = size_text(min_feasible_bytes, unit, round_up=True)
        budget = size_text(budget_bytes, unit)
        super().__init__(
            f"budget {f'{asked} ({budget})' if asked else budget} is below the smallest feasible peak {floor} for "
            f"this model and input{f' ({source})' if source else ''}; raise the budget to at least {floor}, or "
            f"shrink the batch/sequence"
        )

    def __reduce__(self):
        return (type(self), (self.budget_bytes, self.min_feasible_bytes, self.source, self.unit, self.asked,
                             self.floor_plans))

    def in_unit(self, unit: str | None, asked: str = "") -> "InfeasibleBudgetError":
        """The same error, its sizes printed in `unit` (the one the user wrote the budget in; None:
        the decimal unit that suits), and the budget as written (`asked`: '40%') beside its bytes."""
        return InfeasibleBudgetError(self.budget_bytes, self.min_feasible_bytes, self.source, unit, asked or self.asked,
                                     self.floor_plans)


class TraceError(RematError):
    """The model could not be captured as a graph, even with opaque submodules."""

    def __init__(self, where: str, cause: str):
        self.where = where
        """What could not be traced (`"GPT2LMHeadModel.forward"`)."""
        self.cause = cause
        """Why not."""
        super().__init__(f"cannot trace {where}: {cause}")

    def __reduce__(self):
        return (type(self), (self.where, self.cause))


class ForwardError(RematError):
    """The model's own forward raised on the example inputs: a bug in the model or its inputs,
    not something a tracer could not follow. `model` is the model's name, `cause` the exception
    its forward raised."""

    def __init__(self, model: str, cause: BaseException):
        self.model, self.cause = model, cause
        first = next((line for line in str(cause).splitlines() if line.strip()), "")
        super().__init__(f"{model}.forward raises on the example inputs ({type(cause).__name__}: {first}): "
                         "the model's own error, not a tracing limitation; fix the model or its inputs")

    def __reduce__(self):
        return (type(self), (self.model, self.cause))


class LossFnError(RematError):
    """The `loss_fn` remat plans with raised on a call's output: most often a loss that closes
    over the example batch's targets, given a batch of another size. `shapes` are the output's
    tensor shapes, `cause` the exception the loss raised."""

    def __init__(self, shapes: str, cause: BaseException):
        self.shapes, self.cause = shapes, cause
        first = next((line for line in str(cause).splitlines() if line.strip()), "")
        super().__init__(
            f"the loss_fn given to remat raised {type(cause).__name__} ({first}) on the output of this call "
            f"({shapes}): a loss_fn that closes over the example batch's targets cannot take a batch of another "
            "size. Give remat the loss of these inputs with model.remat.set_loss_fn(...) before the call, or pass "
            "the targets to the model as an argument (as Hugging Face's labels) and return the loss from forward")

    def __reduce__(self):
        return (type(self), (self.shapes, self.cause))


class InputLayoutError(RematError, TypeError):
    """An example input that is not a strided tensor (a sparse COO adjacency, a nested tensor):
    remat measures a step by its tensors' storages, which such a tensor has not, so neither a
    graph nor the module tree can be planned. `name` is the input, `layout` its layout."""

    def __init__(self, name: str, layout: str):
        self.name, self.layout = name, layout
        super().__init__(f"example input {name} is a {layout} tensor: remat plans strided (dense) inputs only, "
                         f"as it measures a step by its tensors' storages, which a {layout} tensor has not; pass "
                         "it dense (.to_dense()), or train this model without remat")

    def __reduce__(self):
        return (type(self), (self.name, self.layout))


class SolverError(RematError):
    """The ILP solver failed without a usable plan."""

    def __init__(self, status: str, detail: str = ""):
        self.status = status
        """The solver's status."""
        self.detail = detail
        super().__init__(f"ILP solver returned status {status!r}. {detail}".strip())

    def __reduce__(self):
        return (type(self), (self.status, self.detail))


class UnsafePlanError(RematError):
    """A plan asks for something the runtime cannot do correctly (not one the planner makes)."""


class BudgetError(RematError, ValueError):
    """A budget that is not one: not a size, not positive, an unknown unit."""


class PlanMismatchError(RematError, ValueError):
    """A saved plan applied to a model or inputs it was not made for; the message says what differs."""
