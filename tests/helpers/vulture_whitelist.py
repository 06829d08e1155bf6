"""Names the dead-code check (tests/test_lint.py) does not report: code that runs, but is
called by name from nowhere vulture reads (torch, pickle, io, pytest or a cloud client calls
it), plus code other branches delete. Globs, as vulture's `--ignore-names` takes them; a name
is ignored wherever it is defined, so keep each one specific."""

WHITELIST = (
    # torch.distributed.checkpoint calls these on ckptlib's StorageReader / StorageWriter
    # (format/planned_reader.py, dcp_reader.py, dcp_writer.py, source.py); `checkpoint_id` is a
    # parameter of the signatures DCP calls (reset, validate_checkpoint_id).
    "set_up_storage_reader",
    "set_up_storage_writer",
    "prepare_local_plan",
    "prepare_global_plan",
    "validate_checkpoint_id",
    # DCP's SavePlanner hook (format/save_planner.py's CkptSavePlanner; the other hooks are called by name elsewhere)
    "finish_plan",
    "read_data",
    "write_data",
    "checkpoint_id",
    # pickle's Pickler / Unpickler hooks (format/item_header.py, safe_pickle.py, torch_archive.py; state.py)
    "persistent_id",
    "persistent_load",
    "reducer_override",
    # io's file protocol, asked by torch.load and zipfile (format/ranged_io.py, storage/multipart.py)
    "readable",
    "seekable",
    "writable",
    # the warnings module calls it for every warning shown (cli/__init__.py: one line per warning)
    "showwarning",
    # importlib's loader protocol (testing/harness/rank_process.py, testing/_moved.py)
    "create_module",
    # torch.nn.Module.__call__ runs forward (testing/matrices/models.py, matrix.py)
    "forward",
    # a module's __getattr__ and __dir__ (PEP 562: ckptlib/__init__.py's and testing/__init__.py's
    # names imported on first use, testing/plugin.py, testing/matrices/parallel_layouts.py)
    "__getattr__",
    "__dir__",
    # the parameter of __exit__(self, *exc_info) (manager.py)
    "exc_info",
    # pytest's hooks and a hook parameter its hookspec names (testing/harness/dist_plugin.py)
    "pytest_*",
    "nextitem",
    # SaveContext's field for users' own save policies (save_policy.py)
    "last_save_step",
    # read by google-cloud-storage when it composes the object (storage/gcs.py)
    "content_type",
    # argparse.HelpFormatter's hook, overridden to keep paragraphs and "- " items (cli/usage.py)
    "_split_lines",
    # Lightning's Strategy hooks, called by its Trainer (integrations/lightning.py)
    "save_checkpoint",
    "load_checkpoint",
    "restore_checkpoint_after_setup",
    "load_model_state_dict",
    "load_optimizer_state_dict",
    # attributes of the real packages' objects the adapters set, read by those packages
    # (testing/checkpointers/: Accelerate's Accelerator and its state, Lightning's strategy,
    # torchtitan's OptimizersContainer)
    "_models",
    "_schedulers",
    "_dataloaders",
    "_custom_objects",
    "fsdp_plugin",
    "project_configuration",
    "cluster_environment",
    "model_parts",
)
