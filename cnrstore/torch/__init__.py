"""PyTorch integration. For now: exporting a version as a ``torch.save`` file (see ``export``).

The trainer-side ``Checkpointer`` of API.md is built in a later issue.
"""
