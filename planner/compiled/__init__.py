"""The step torch.compile runs (compile mode): the joint graph Inductor partitions, captured on
fake tensors (joint.py); a plan as the partitioner's recompute tags (tags.py); each partitioned
graph's buffers replayed as Inductor runs them (memory.py); a compiled step as plain data
(step.py). runtime/rewrite/compiled.py stands it in for the exact replay and compiles the model
that trains."""
