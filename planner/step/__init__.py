"""The model of a training step: the step remat plans (planner/step/fake.py: forward, loss,
backward; the fake step on fake copies of the model's tensors), the model's state around it kept
as it was (state.py: buffers, attributes, modes), live-storage accounting (storage.py), RNG
(rng.py), the attention kernels a device runs (kernels.py), the optimizer's state and step
(optimizer.py) and library workspaces (workspace.py)."""
