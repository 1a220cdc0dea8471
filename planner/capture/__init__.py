"""Capture: the model's training step as a graph (planner/capture/trace.py: fx with opaque
leaves, else torch.export), what a graph would lose and how it is kept or refused (fidelity.py:
custom autograd Functions, grad modes, hooks, the user's own checkpoint), the check of a captured
graph against the model on a real batch (check.py), and a failed export kept quiet in the
capturing thread (muted.py). In: a model and example inputs; out: a `Traced` graph."""
