"""ckptlib inside the training frameworks users already run, each an optional extra:

- `lightning`: `ckptlib.integrations.lightning` (`pip install ckptlib[lightning]`): Lightning strategies
  whose checkpoints are ckptlib's (sharded, committed, elastic across world sizes);
- `torchtitan`: `ckptlib.integrations.torchtitan` (`pip install ckptlib[torchtitan]`): a torchtitan
  checkpoint manager that saves and loads through ckptlib.

Importing this package imports neither framework; import the module you use.
"""
