"""Solve: plans from a CostGraph, pure (no torch). The simulator that predicts a plan's peak
(simulate.py, NOTE [ liveness ]), the candidate regions (candidates.py) and hand-made baselines
(baselines.py), the flat ILP (ilp.py, NOTE [ ILP ]) on CBC (cbc.py), the local search
(improve.py), the hierarchical solver for repeated blocks (hierarchy.py with blocks.py,
segment.py, front.py, lower.py, chain.py), and `solve_plan` fitting a budget (fit.py)."""
