"""Profile: the captured step run on fake tensors node by node (planner/profile/graph.py), into
a CostGraph (what each node makes, saves, reads and costs); modules fake tensors cannot run,
measured for real and stood in for (opaque.py); recompute costs, roofline or measured (costs.py,
rates.py); and the module tree's profile where no graph is captured (modules.py)."""
