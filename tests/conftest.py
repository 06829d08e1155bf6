"""Tests are grouped by the part of ckptlib they cover: api/ (save, load, async, state),
format/ (formats, checksums, verify, conversion and export), storage/ (backends), elastic/
(the save-at-N/load-at-M matrix, multi-node, GPU), manager/, cli/, harness/.

Fixtures come from the plugin (dist_run, the emulators' s3_root/gcs_root/azure_root...:
ckptlib.testing.plugin, registered by the repository's conftest.py) or from conftest.py
files; helpers shared by test modules live in helpers/ (`from helpers.golden import diff`),
importable because this file puts tests/ on sys.path. No test module imports another."""

import pytest

# Asserts in the helpers fail with pytest's explanations, also in ranks (the launcher hands
# every rewritten module to them).
pytest.register_assert_rewrite("helpers")


# ---------------------------------------------------------------- the default run's time budget
#: Tests past the default run's budget (the README's test command: about 20 minutes on a
#: 2-core machine): the crash-boundary enumerations, torchrun end-to-end runs of the examples and
#: of several simulated nodes, real benchmark runs, the slowest rank-loss cases. They carry the
#: `extended` mark; `.ci/run` runs them after the default run with `--suite extended`; `-m EXPR`
#: selects by its expression alone, `--suite all` runs both. Each entry is `path::function`, or
#: `path::function[` followed by a part of the case id; every entry must match a collected test.
EXTENDED = (
    "manager/test_crash_boundaries.py::test_crash_at_every_write_boundary",
    "harness/test_nothing_outlives.py::test_sigkill_of_a_running_suite_leaves_no_process[xdist",
    "elastic/test_cluster_tier.py::test_kill_one_node_mid_upload_then_resume_at_3_and_4",
    "elastic/test_read_once_nodes.py::test_two_torchrun_nodes_read_each_item_once",
    "elastic/test_multinode.py::test_torchrun_two_nodes_then_resume_on_one",
    "cli/test_validate_spec.py::test_example_validates_from_the_command_line",
    "cli/test_validate_spec.py::test_spec_under_torchrun_on_two_nodes",
    "cli/test_validate.py::test_validate_under_torchrun",
    "elastic/test_checkpointers.py::test_plain_dcp_passes_every_pair_of_1_to_4",
    "cli/test_example.py::test_torchrun_sigterm_saves_the_step_reached_then_resumes_on_2",
    "cli/test_example.py::test_torchrun_crash_on_4_resume_on_2",
    "cli/test_example.py::test_sigkill_mid_run_then_resume",
    "cli/test_not_a_checkpoint_fast.py::test_a_large_prefix_is_refused_with_one_top_level_listing[azure",
    "cli/test_bench_ceilings.py::test_ceilings_first_in_a_real_run",
    "cli/test_bench_tier.py::test_bench_tier_reports_the_tier_beside_its_baselines",
    "cli/test_bench_recovery.py::test_bench_recovery_quick_times_every_phase_and_resumes_from_peers",
    "cli/test_bench_tensors.py::test_bench_tensors_ablation_times_both_collector_settings",
    "api/test_async_process_ranks.py::test_fsdp2_saved_at_4_in_process_mode_loads_at_2",
    "api/test_async_process.py::test_exit_without_wait_commits_and_stops_the_writer",
    "api/test_rank_loss.py::test_survivors_of_a_rank_dying_mid_save_raise_rank_lost[manager-async",
    "api/test_rank_loss.py::test_survivors_of_a_rank_dying_mid_save_raise_rank_lost[save-async",
    # torchrun's elastic agent losing and regaining a host (about a minute each)
    "elastic/test_agent.py::test_lose_rank_0s_host_the_survivors_resume_then_a_relaunch_grows_back",
    "elastic/test_agent.py::test_lose_rank_0s_host_then_a_replacement_joins_the_running_job",
    "elastic/test_agent.py::test_sigterm_to_one_agent_saves_the_step_reached_and_the_rest_restarts_smaller",
    # a paused lock holder refuses each irreversible step (the siblings of these cases run by default)
    "manager/test_lock_fencing.py::test_a_paused_holder_refuses_its_next_irreversible_step_after_losing_the_lease[commit-held",
    "manager/test_lock_fencing.py::test_a_paused_holder_refuses_its_next_irreversible_step_after_losing_the_lease[gc",
    "manager/test_lock_fencing.py::test_a_paused_holder_refuses_its_next_irreversible_step_after_losing_the_lease[node-retention",
    "manager/test_lock_fencing.py::test_a_paused_holder_refuses_its_next_irreversible_step_after_losing_the_lease[remote-retention",
    "manager/test_lock_fencing.py::test_every_rank_of_a_paused_writer_raises_the_lost_lock[latest",
    "manager/test_lock_fencing.py::test_a_paused_holder_refuses_its_next_irreversible_step_after_losing_the_lease[latest-async",
    # every kill point of a manager save (the crash-boundary enumeration above covers each write)
    "manager/test_crash.py::test_kill_during_save",
    "format/test_output_errors.py::test_a_full_disk_is_a_storage_error_naming_the_file_and_leaves_nothing",
    # the stateful fault model's long random runs (its fixed budget runs in the default run)
    "manager/test_fault_model.py::test_single_root_fault_model_long",
    "manager/test_fault_model.py::test_tier_fault_model_long",
    # the crash harness for any checkpointer: full sweeps, and S3 (its probe is tested in-process by default)
    "harness/test_crash_check.py::test_object_store_requests_are_the_boundaries_on_s3",
    "harness/test_crash_check.py::test_ckptlib_managers_save_is_crash_consistent_at_many_boundaries",
    "harness/test_crash_check.py::test_every_boundary_of_tutorial_dcp_raises_or_resumes",
    # the real clients' round trips (each client's recipe runs in the default run)
    "clients/test_lightning.py::test_ckptlib_strategies_save_and_resume_elastically",
    "clients/test_lightning.py::test_lightning_checkpoint_loads_bit_exactly_through_the_preset",
    "clients/test_torchtitan.py::test_ckptlib_checkpoint_manager_interoperates_with_torchtitans",
    "clients/test_torchtitan.py::test_torchtitan_checkpoint_loads_bit_exactly_through_the_preset",
    "clients/test_torchtitan_state_hooks.py::test_torchtitan_fused_qkv_saves_and_reshards_bit_exact",
    "clients/test_composer.py::test_composer_checkpoint_loads_bit_exactly_through_the_preset",
    "clients/test_composer.py::test_a_ckptlib_save_in_composers_layout_autoresumes_in_composer",
    # the checkpointer adapters against the real packages and the packages' findings (one round
    # trip and the Lightning finding run by default)
    "clients/test_checkpointer_adapters.py::test_adapter_saves_at_n_and_loads_at_m_bit_exactly[save2-load1-lightning",
    "clients/test_checkpointer_adapters.py::test_adapter_saves_at_n_and_loads_at_m_bit_exactly[save2-load1-torchtitan",
    "clients/test_checkpointer_adapters.py::test_adapter_saves_at_n_and_loads_at_m_bit_exactly[save1-load2",
    "clients/test_checkpointer_adapters.py::test_adapter_load_of_an_empty_root_is_a_fresh_start",
    "clients/test_checkpointer_adapters.py::test_torchtitan_async_save_resumes_the_state_it_staged",
    "clients/test_conformance_findings.py::test_torchtitan_refuses_its_data_loader_at_another_dp_size",
    "clients/test_conformance_findings.py::test_lightning_sharded_load_does_not_restore_stateful_objects[full",
    "clients/test_conformance_findings.py::test_lightning_sharded_load_does_not_restore_stateful_objects[fsdp1",
    "clients/test_conformance_findings.py::test_accelerate_ignores_the_fsdp_plugin_on_cpu",
)
#: The quick tier (`pytest -m smoke`, a few minutes on 2 cores): save at N ranks and load at M
#: (FSDP2, AdamW, bit-exact), the manager's resume and retention, S3 (moto) at 2 -> 3 ranks, and
#: the CLI. Entries as in EXTENDED, a "]"-closed case id naming one case; none may be extended.
SMOKE = (
    "elastic/test_elastic.py::test_save_n_load_m[save4-load3-fsdp2-adamw]",
    "elastic/test_elastic.py::test_save_n_load_m[save1-load2-fsdp2-adamw]",
    "elastic/test_elastic.py::test_save_n_load_m[save2-load1-fsdp2-adamw]",
    "elastic/test_elastic.py::test_manager_round_trip_across_world_sizes[save4-load2-fsdp2-adamw-via-manager]",
    "elastic/test_s3_elastic.py::test_fsdp2_adamw_save2_load3",
    "manager/test_manager.py::test_autoresume_on_missing_and_empty_root",
    "manager/test_manager.py::test_retention_keeps_newest",
    "manager/test_manager.py::test_stale_pointer_falls_back_with_warning",
    "manager/test_manager.py::test_saving_an_existing_step_is_refused",
    "api/test_call_mistakes.py::test_a_renamed_layer_lists_the_unused_keys_and_the_rename",
    "cli/test_cli.py::test_verify_intact",
    "cli/test_cli.py::test_inspect_ckptlib_checkpoint",
    "cli/test_cli.py::test_ls_text_and_json",
    "cli/test_json_reports.py::test_gc_json_reports_what_it_removes",
)
SUITES = ("default", "extended", "all")


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--suite",
        choices=SUITES,
        default="default",
        help="default: the README's run (leaves out the `extended` tests, see tests/conftest.py EXTENDED); "
        "extended: only those; all: both. With -m, the expression alone decides.",
    )


def _extended_entry(item: pytest.Item, entries: tuple[str, ...] = EXTENDED) -> str | None:
    """The entry of `entries` (EXTENDED, SMOKE) `item` matches, None if none: the same function
    (every case of it), or, for an entry with a "[", the cases whose id starts so."""
    path, _, name = item.nodeid.partition("::")
    rel = path.removeprefix("tests/")
    for entry in entries:
        where, _, case = entry.partition("::")
        if where == rel and (name.startswith(case) if "[" in case else name.split("[")[0] == case):
            return entry
    return None


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    matched, smoke = set(), set()
    for item in items:
        entry = _extended_entry(item)
        if entry is not None:
            matched.add(entry)
            item.add_marker(pytest.mark.extended)
        quick = _extended_entry(item, SMOKE)
        if quick is not None:
            if entry is not None:
                raise pytest.UsageError(f"tests/conftest.py SMOKE names an extended test: {item.nodeid}")
            smoke.add(quick)
            item.add_marker(pytest.mark.smoke)
    suite = config.getoption("suite")
    if config.option.markexpr or suite == "all":
        return
    whole_run = not config.args or all(arg.rstrip("/") in ("tests", ".") for arg in config.args)
    stale = sorted(set(EXTENDED) - matched) + sorted(set(SMOKE) - smoke)
    if whole_run and stale and suite == "default":
        raise pytest.UsageError(f"tests/conftest.py EXTENDED or SMOKE names no collected test: {stale}")
    keep = (
        (lambda item: item.get_closest_marker("extended") is None)
        if suite == "default"
        else (lambda item: item.get_closest_marker("extended") is not None)
    )
    dropped = [item for item in items if not keep(item)]
    if dropped:
        config.hook.pytest_deselected(items=dropped)
        items[:] = [item for item in items if keep(item)]
