"""Shared fixtures: the SGLang oracle (torch references from the installed sglang==0.5.23 wheel)."""

from __future__ import annotations

import gc
import importlib.metadata
import importlib.util
import os
import re
import sys

import pytest

import jax

from kvcanary_jax import oracle as _oracle

import _impls
import _tier


# Compiling is most of the suite's time on a CPU: XLA's CPU backend takes 1 to 10 s for a program
# of the Pallas interpreter or of TPU interpret mode at its default settings. The suite asks for
# quick compiles instead: optimization level 0 and, on jaxlib < 0.11 (whose XLA has the flag), the
# elemental emitters instead of the fusion emitters. On jax 0.10.2 that cuts the fast tier's
# compile time about 3.4x and, with the race detector's scope below, its time 2x (bench/NOTES.md,
# "the test suite's time"). The elemental emitters once changed a bf16 NaN's payload in `xla`'s
# real-KV hash, which now moves KV bytes as integers; test_write.py's NaN-payload test checks
# every implementation for that. The Python 3.12 leg, whose jaxlib lacks the emitter flag, and
# the GPU gate compile with the default emitters. Set before anything compiles (XLA reads
# XLA_FLAGS at its first compile) and carried to the subprocesses tests start. Left alone: a
# flag the user's XLA_FLAGS sets already; machines with a GPU plugin or libtpu (the GPU gate, and
# the TPU compile tests, whose memory and compile-time figures must be the real compiler's); and
# runs with KVCANARY_TEST_XLA_DEFAULTS=1.
QUICK_CPU_COMPILES = {"xla_backend_optimization_level": "0", "xla_cpu_use_fusion_emitters": "false"}
ACCELERATOR_PLUGINS = ("libtpu", "jax_cuda12_plugin", "jax_cuda13_plugin", "jax_cuda12_pjrt",
                       "jax_cuda13_pjrt", "jax_rocm60_plugin", "jax_rocm7_plugin")


def _quick_cpu_compile_flags(environ=os.environ) -> str | None:
    """XLA_FLAGS with :data:`QUICK_CPU_COMPILES` added, or None where they are left out."""
    import importlib.metadata

    if environ.get("KVCANARY_TEST_XLA_DEFAULTS"):
        return None
    if any(importlib.util.find_spec(m) for m in ACCELERATOR_PLUGINS):
        return None
    flags = environ.get("XLA_FLAGS", "")
    jaxlib = tuple(int(p) for p in importlib.metadata.version("jaxlib").split(".")[:2])
    added = [f"--{k}={v}" for k, v in QUICK_CPU_COMPILES.items()
             if f"--{k}" not in flags and (k != "xla_cpu_use_fusion_emitters" or jaxlib < (0, 11))]
    return " ".join([flags, *added]).strip() if added else None


if (_flags := _quick_cpu_compile_flags()) is not None:
    os.environ["XLA_FLAGS"] = _flags


# Python's cyclic garbage collector, in the test processes only (the pytest process and each
# xdist worker; not the package, not the subprocesses tests start). Tracing and lowering a kernel
# allocate millions of short-lived containers, and at CPython's default thresholds (700, 10, 10)
# a collection starts every 700 allocations and a full one walks the whole heap (torch, JAX,
# SGLang: millions of objects): 10-15% of a TPU-interpreted test's samples sat in the collector
# (perf). A first generation of 50,000 objects collects the same garbage about 70x less often:
# 4-7% off a test module in interleaved pairs (bench/NOTES.md, "the test suite's time").
# Memory: garbage in cycles waits at most 50,000 allocations longer; the tests that measure
# memory call gc.collect() first.
GC_THRESHOLDS = (50_000, 20, 20)
gc.set_threshold(*GC_THRESHOLDS)


def _deselect(config, items, marker):
    kept = [it for it in items if marker not in it.keywords]
    if len(kept) != len(items):
        config.hook.pytest_deselected(items=[it for it in items if marker in it.keywords])
        items[:] = kept


def pytest_addoption(parser):
    parser.addoption("--tpu-long", action="store_true", default=False,
                     help="also run the long TPU interpret-mode fuzz (tests marked both "
                          "tpu_interpret and slow; an hour or more on two cores)")
    parser.addoption("--long", action="store_true", default=False,
                     help="the long tier: every fuzz test (marked fuzz) draws its full count of "
                          "cases, with the fast tier's seeds (the README lists the counts)")
    parser.addoption("--compile-time", action="store_true", default=False,
                     help="add up JAX's trace, lowering and XLA compile time per test and print "
                          "it by implementation (tests/_compile_time.py)")


# The suite's persistent compilation cache (``.pytest_cache/d/jax-compilation-cache``, dropped by
# ``pytest --cache-clear``): test modules, xdist workers, the subprocesses tests start and the next
# run (CI's long tier after its fast tier) share every executable XLA compiled, instead of each
# compiling it again. JAX keys an entry on the whole program, the compile options and flags, the
# JAX and jaxlib versions and the backend, so an entry is never used for a program it was not
# compiled from. Executables with host callbacks (TPU interpret mode) are never cached. A
# JAX_COMPILATION_CACHE_DIR the user set is used as is.
COMPILATION_CACHE_BYTES = 4 << 30  # past this size the suite's cache is emptied at the next start


def _compilation_cache(config) -> None:
    if os.environ.get("JAX_COMPILATION_CACHE_DIR") or getattr(config, "cache", None) is None:
        return
    path = config.cache.mkdir("jax-compilation-cache")
    if not hasattr(config, "workerinput"):  # the controller (or a run without xdist)
        entries = [p for p in path.iterdir() if p.is_file()]
        if sum(p.stat().st_size for p in entries) > COMPILATION_CACHE_BYTES:
            for p in entries:
                p.unlink(missing_ok=True)
    # The environment carries the cache to every subprocess a test starts; this process has
    # imported JAX already, so it is told directly.
    os.environ["JAX_COMPILATION_CACHE_DIR"] = str(path)
    os.environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0.2"
    jax.config.update("jax_compilation_cache_dir", str(path))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.2)


def pytest_configure(config):
    # Before collection: the test modules read their case counts when they are imported.
    _tier.LONG = bool(config.getoption("--long"))
    if config.getoption("--compile-time"):
        import _compile_time

        config.pluginmanager.register(_compile_time, "kvcanary-compile-time")
    _compilation_cache(config)


# The modules that take longest on the 2-core CI machine, longest first. The README's commands run
# the suite with pytest-xdist, one module per worker at a time (--dist loadfile keeps a module's
# compiled executables in one process); starting with the longest modules keeps a worker from
# being left with one long module at the end while the other idles. Order only: every module runs.
LONGEST_FIRST = (  # each module's fast-tier time, the longer of the two legs' (bench/NOTES.md)
    "test_digest.py", "test_coverage.py", "test_lowering.py", "test_write.py", "test_plan.py",
    "test_coverage_rebase.py", "test_scatter.py", "test_sglang_jax_coverage.py", "test_bridge.py",
    "test_manager.py", "test_docs.py", "test_golden.py", "test_demo.py", "test_zero_sizes.py",
    "test_tpu_vs_reference.py", "test_verify.py", "test_races.py", "test_sglang_jax_layout.py",
    "test_bridge_sglang.py", "test_packaging.py", "test_sglang_jax_remediation.py",
    "test_interpret_config.py", "test_bridge_digest.py", "test_hashing.py", "test_registry.py",
    "test_manager_trust.py", "test_ring_guard.py", "test_runtime_guards.py", "test_plan_halves.py",
    "test_runtime.py", "test_bridge_serving.py", "test_bridge_coverage.py",
    # then the modules the e2e commands spend longest on
    "test_coverage_campaign.py", "test_cli.py", "test_agreement.py", "test_bench_smoke.py",
    "test_demo_manager.py", "test_sglang_jax_coverage_campaign.py", "test_sglang_jax.py",
    "test_sharded_manager.py", "test_sharded.py",
)


# The deep tests: whole campaigns (hundreds of flips, every layer and half), the demo and the
# benchmarks run whole inside the process, and the interpreted kernels at sizes past the hand
# cases. They check nothing the fast tier's smaller cases leave open in a kernel's logic, and they
# are most of its time, so they run after it, with the end-to-end tests (test-command-e2e and
# test-command-py312-e2e in docs/testing.md; its "Tiers" table says which leg runs which deep
# test, and the long tier runs the deep fuzzes at their full count). Each entry is a module, a
# test of it, or a test with a substring its parameter id must hold ("pallas": the interpreted
# Pallas kernels, pallas_interpret and pallas_mosaic_tpu).
DEEP = (
    ("test_coverage_campaign.py", None, None),
    ("test_sglang_jax_coverage_campaign.py", None, None),
    ("test_bridge_coverage.py", "test_every_flip_is_found_at_its_first_check", None),
    ("test_bridge_coverage.py", "test_a_clean_run_reports_nothing", None),
    ("test_bridge_coverage.py", "test_sglangs_own_canary_is_unchanged_with_the_window_on", None),
    ("test_bridge_coverage.py", "test_the_window_runs_inside_a_captured_decode_step", None),
    ("test_coverage.py", "test_the_demo_runs_the_window_and_prints_its_coverage", None),
    ("test_coverage.py", "test_without_the_window_the_demo_misses_other_layers", None),
    ("test_coverage.py", "test_sglangs_canary_is_unchanged_beside_the_window", None),
    ("test_demo.py", "test_campaign_detects_every_fault_kind", None),
    ("test_demo_manager.py", "test_campaign_through_the_manager_detects_every_fault_kind", None),
    ("test_demo_manager.py", "test_demo_flags", None),
    ("test_bridge_serving.py",
     "test_decode_loop_with_a_growing_history_compiles_logarithmically_with_flat_memory", None),
    ("test_runtime.py", "test_steps_match_sglang_references", "pallas_interpret"),
    ("test_runtime.py", "test_v_half_full_only_matches_sglang_references", "pallas_interpret"),
    ("test_verify.py", "test_single_corruptions", "large"),
    ("test_verify.py", "test_tpu_long_runs_across_slabs_and_blocks", None),
    ("test_plan.py", "test_tpu_batch_sizes", None),
    ("test_plan.py", "test_hand_cases", "pallas_mosaic_tpu"),
    ("test_write.py", "test_xla_overlapping_and_unsorted_ranges_match_the_sequential_reference",
     None),
    ("test_digest.py", "test_pallas_many_sources_few_slots", None),
    ("test_digest.py", "test_mosaic_tpu_every_dtype_and_layout", None),
    ("test_digest.py", "test_tpu_long_strips_paged_rows_and_shared_operands", None),
    ("test_digest.py", "test_pallas_launch_shapes", None),
    ("test_digest.py", "test_bench_op_digest_sweep_smoke", None),
    ("test_coverage.py", "test_cached_slots_show_unverified_when_the_sweeps_stop", None),
    # The fast tiers past 10 minutes on a slower 2-core machine (bench/NOTES.md, "the fast tiers
    # on a 1.8x slower machine"): what moved here runs the same checks on the interpreted kernels
    # (pallas_mosaic_tpu in TPU interpret mode, pallas_interpret) beyond the hand cases, the
    # hostile and family fuzzes, the long strips and chains, the demo run whole, and sglang-jax's
    # whole lives (each in a process of its own). The fast tier keeps every implementation's hand
    # cases and golden files (test_golden.py, test_scatter.py's and test_plan.py's hand cases, the
    # hand-checked hash values) against SGLang and the jnp references.
    ("test_write.py", "test_hostile_fuzz", None),
    ("test_plan.py", "test_hostile_fuzz", None),
    ("test_scatter.py", "test_hostile_fuzz", None),
    ("test_verify.py", "test_hostile_fuzz", None),
    ("test_plan.py", "test_fuzz_family", None),
    ("test_plan.py", "test_fuzz_small_blocks_multi_block_and_looping_entries", None),
    ("test_write.py", "test_write_fuzz", None),
    ("test_verify.py", "test_single_corruptions", None),
    ("test_ring_guard.py", "test_write_bad_index_writes_no_row", None),
    ("test_ring_guard.py", "test_verify_bad_index_writes_no_row", None),
    ("test_write.py", "test_real_kv_nan_payloads_hash_as_stored_bytes", None),
    ("test_write.py", "test_real_kv_long_strips", None),
    ("test_verify.py", "test_real_kv_long_strips_clean_then_last_word_flipped", None),
    ("test_verify.py", "test_real_kv_clean_then_bit_flip", "pallas_mosaic_tpu"),
    ("test_write.py", "test_long_chain", "pallas"),
    ("test_write.py", "test_ring_overflow", "pallas"),
    ("test_write.py", "test_no_valid_requests_only_bumps_kernel_counter", "pallas"),
    ("test_write.py", "test_repeated_slots_within_a_request_last_write_wins", "pallas_mosaic_tpu"),
    ("test_write.py", "test_repeated_slots_with_four_warps", "pallas"),
    ("test_write.py", "test_cross_request_races_give_one_order", "pallas_mosaic_tpu"),
    ("test_write.py", "test_anchor_chain_single_request", "pallas_mosaic_tpu"),
    ("test_write.py", "test_donated_jit_updates_in_place", "pallas_mosaic_tpu"),
    ("test_plan.py", "test_padded_batch_multi_block_offsets", "pallas_interpret"),
    ("test_plan.py", "test_expected_tokens_past_the_pool", "pallas_mosaic_tpu"),
    ("test_plan.py", "test_jit_with_donated_plans_updates_in_place", "pallas_mosaic_tpu"),
    ("test_plan.py", "test_prefix_past_row_width_reads_flat_like_the_gpu", "pallas_mosaic_tpu"),
    ("test_plan.py", "test_base_with_row_pitch_wider_than_the_view", "pallas_mosaic_tpu"),
    ("test_plan.py", "test_lut_index_clamped_like_the_gpu", "pallas_mosaic_tpu"),
    ("test_plan.py", "test_rows_outside_the_table_read_as_unfilled", "pallas_mosaic_tpu"),
    ("test_plan_halves.py", "test_each_half_against_the_reference_half", "pallas_mosaic_tpu"),
    ("test_verify.py", "test_many_blocks_grid_stride", "pallas"),
    ("test_verify.py", "test_corrupted_token", "pallas_mosaic_tpu"),
    ("test_verify.py", "test_clean_chain", "pallas_mosaic_tpu"),
    ("test_verify.py", "test_negative_slot_reads_wrapped_row_like_the_reference", "pallas_mosaic_tpu"),
    ("test_verify.py", "test_ring_overflow_with_preexisting_index", "pallas_mosaic_tpu"),
    ("test_digest.py", "test_flips_outside_the_strips_are_not_reported", "pallas_mosaic_tpu"),
    ("test_digest.py", "test_verify_hostile_indices_and_the_ring_guard", "pallas_mosaic_tpu"),
    ("test_digest.py", "test_single_bit_flips_are_always_reported", "pallas_mosaic_tpu"),
    ("test_coverage.py", "test_a_server_s_int32_token_arrays_give_the_int64_bytes",
     "pallas_interpret"),
    ("test_coverage.py", "test_the_demo_takes_the_window_from_the_servers_variable", None),
    ("test_plan.py", "test_fuzz_batch_sizes", None),
    ("test_plan.py", "test_padded_batch_with_num_reqs_equals_sglang", None),
    ("test_verify.py", "test_short_hostile_fuzz_checks_its_coverage", None),
    ("test_verify.py", "test_round_trips_clean", None),
    ("test_verify.py", "test_xla_blocks_and_branches", None),
    ("test_write.py", "test_real_kv_sources", None),
    ("test_write.py", "test_xla_windows_and_hazards", None),
    ("test_write.py", "test_wide_slot_stride_keeps_trailing_bytes", "pallas"),
    ("test_write.py", "test_skip_negative_slots", "pallas"),
    ("test_write.py", "test_multi_request_with_padding_and_capacity", "pallas"),
    ("test_write.py", "test_continue_from_seed_and_chain_position_assert", "pallas"),
    ("test_write.py", "test_offsets_past_the_token_arrays_are_skipped", "pallas"),
    ("test_write.py", "test_write_input_assert_mismatches", "pallas"),
    # The 3.11 fast tier at 598 s of its 10 minutes on dae2db0 (beside the 3.12 leg's): its
    # slowest runs of the torch bridge and the demo's command line (302 s alone on this 2-core
    # machine, these 34 s of it) go after it. The fast tier keeps the drop-in's step-by-step
    # comparison with SGLang, and a runtime comparison with SGLang's references per implementation.
    ("test_bridge_sglang.py", "test_dropin_matches_sglang_runtime_with_static_decode_batches", None),
    ("test_bridge_coverage.py", "test_digest_rows_are_reported_by_sglangs_reporter_as_kv_digest",
     None),
    ("test_bridge_digest.py",
     "test_write_then_verify_match_the_oracle_over_every_kind_of_source", None),
    ("test_runtime.py", "test_v_half_full_only_matches_sglang_references", None),
    ("test_demo.py", "test_cli_json_shape", None),
    ("test_demo.py", "test_the_demo_holds_back_the_violation_logs_of_its_trials", None),
    # Both fast tiers past 10 minutes on 4c76f8e (632 and 610 s side by side; 302 and 406 s
    # alone): the sglang-jax lives that run a process of their own (the feed's events, 64 s on
    # 3.12; the remediation script, 21 s; the managed runner, 25 s: the 3.12 e2e command and
    # the 0.1.0rc0 leg still run them), the manager's rebase tests near the counters' wrap
    # (60 s on 3.12) and the torch bridge's CPU-tensor differential runs (the GPU gate runs
    # them on CUDA tensors).
    ("test_sglang_jax.py", "test_one_feed_two_states", None),
    ("test_sglang_jax.py", "test_a_new_request_in_a_finished_one_s_row_with_its_rid", None),
    ("test_sglang_jax.py", "test_a_delta_for_another_batch_is_refused", None),
    ("test_sglang_jax_remediation.py", "test_sweep_finding_drops_the_cached_node_at_once", None),
    ("test_sglang_jax_remediation.py", "test_model_runner_with_the_managed_hook", None),
    ("test_coverage_rebase.py", "test_the_manager_rebases_the_state_it_steps", None),
    ("test_coverage_rebase.py", "test_a_state_set_from_outside_is_read_at_the_next_step", None),
    ("test_coverage_rebase.py",
     "test_a_state_near_the_wrap_checks_and_reports_as_the_state_it_was_made_from", None),
    ("test_sglang_jax_coverage.py", "test_the_guarded_step_keeps_its_step_counters_from_wrapping",
     None),
    ("test_bridge.py", "test_write_then_verify_match_sglang_reference_through_its_differential_helpers",
     "cpu"),
    ("test_bridge.py", "test_plan_matches_sglang_reference_through_its_differential_helper", "cpu"),
    ("test_bridge_serving.py", "test_dropped_buffer_sets_are_released", None),
    # The fuzzes against the jnp references (the golden files and the hand cases stay in the fast
    # tier): the 3.12 leg's e2e command runs deep fuzzes, the 3.11 leg's long tier at full count.
    ("test_verify.py", "test_round_trips_and_corruptions_against_jnp_reference", None),
    ("test_plan.py", "test_fuzz_against_jnp_reference", None),
    ("test_write.py", "test_write_fuzz_against_jnp_reference", None),
    ("test_digest.py", "test_verify_zero_sizes", "pallas_mosaic_tpu"),
    ("test_verify.py", "test_out_of_range_slot_and_prev_read_as_zero_rows", "pallas_mosaic_tpu"),
    ("test_scatter.py", "test_malformed_offsets_stay_in_bounds", "pallas_mosaic_tpu"),
    ("test_ring_guard.py", "test_verify_index_saturates_over_launches", "pallas_mosaic_tpu"),
    # sglang-jax 0.0.2's whole lives (the ``life`` fixture: a subprocess each; every life's id
    # names its page size) and the model runner's longer runs.
    ("test_sglang_jax.py", None, "page"),
    ("test_sglang_jax.py", "test_a_delta_never_run_records_nothing", None),
    ("test_sglang_jax.py", "test_model_runner_hook_with_the_coverage_window_digests_every_layer",
     None),
    ("test_sglang_jax_remediation.py", "test_model_runner_with_the_managed_hook_in_raise_mode",
     None),
    ("test_sglang_jax_remediation.py", "test_running_request_is_aborted_and_its_prefix_dropped",
     None),
    ("test_sglang_jax.py", "test_model_runner_with_the_canary_installed", None),
    ("test_sglang_jax.py", "test_the_guarded_step_lowered_for_cuda_has_no_loop_around_its_kernels",
     None),
)


def _is_deep(item) -> bool:
    name = getattr(item, "originalname", None) or item.name.split("[")[0]
    params = item.name[len(name):]
    return any(item.path.name == module and test in (None, name) and (sub is None or sub in params)
               for module, test, sub in DEEP)


def _module_rank(item) -> tuple[int, str]:
    name = item.path.name
    rank = LONGEST_FIRST.index(name) if name in LONGEST_FIRST else len(LONGEST_FIRST)
    return rank, str(item.path)


def pytest_collection_modifyitems(config, items):
    # Longest modules first (a stable sort: the order inside a module is unchanged).
    items.sort(key=_module_rank)
    for it in items:
        if _is_deep(it):
            it.add_marker(pytest.mark.deep)
        # The Triton kernels interpreted on the CPU: CI's long tier leaves their full-count
        # fuzzes to the GPU's long run of the same kernels (pallas_triton), and the 3.11 leg's
        # e2e command runs their deep fuzzes at the fast tier's counts (docs/testing.md).
        if "pallas_interpret" in it.name[len(getattr(it, "originalname", None) or it.name):]:
            it.add_marker(pytest.mark.pallas_interpret)
    # Tests that compare with SGLang's torch references need torch, and so does every test of a
    # module that imports torch itself (the Python 3.12 leg, without torch, cannot even import
    # those modules): the marker lets a run without torch (the newest-JAX CI leg) select the rest
    # with -m "not torch", and keeps the 3.11 leg, which runs TPU interpret mode only where torch
    # is needed, from leaving any test to a leg that cannot import it.
    torch = sys.modules.get("torch")
    for it in items:
        module = getattr(it, "module", None)
        if "sgl" in getattr(it, "fixturenames", ()) or (
                torch is not None and getattr(module, "torch", None) is torch):
            it.add_marker(pytest.mark.torch)
    # KVCANARY_TEST_SHARD=i/n keeps every n-th test from the i-th (0-based) of the collected
    # order: the GPU gate runs its longest suites as two processes each.
    shard = os.environ.get("KVCANARY_TEST_SHARD")
    if shard:
        try:
            i, n = (int(x) for x in shard.split("/"))
        except ValueError:
            i = n = 0
        if not 0 <= i < n:
            raise pytest.UsageError(f"KVCANARY_TEST_SHARD={shard!r}: want i/n with 0 <= i < n")
        config.hook.pytest_deselected(items=[it for k, it in enumerate(items) if k % n != i])
        items[:] = items[i::n]
    # A test of implementations that KVCANARY_TEST_IMPLEMENTATIONS leaves out has an empty
    # parameter set, which pytest would report as a skip: deselected, as not asked for.
    if os.environ.get("KVCANARY_TEST_IMPLEMENTATIONS"):
        notset = [it for it in items if re.search(r"[\[-]NOTSET[\]-]", it.name)]
        if notset:
            config.hook.pytest_deselected(items=notset)
            items[:] = [it for it in items if it not in notset]
    # GPU tests run on the H200 only; on CPU machines they are deselected, not skipped.
    if jax.default_backend() != "gpu":
        _deselect(config, items, "gpu")
    # sglang-jax needs Python >= 3.12: its tests run in the Python 3.12 CI leg, which installs it
    # (and fails on "no tests ran" if it did not); elsewhere they are deselected.
    if importlib.util.find_spec("sgl_jax") is None:
        _deselect(config, items, "sglang_jax")
    # What only one sglang-jax version has (0.1.0rc0: DP, the fused decode step, HiCache, its
    # API in the docs' examples; 0.0.2: the README's wiring) runs where that version is installed
    # (0.1.0rc0: its CI command, test-command-sglang-jax-0.1).
    elif importlib.metadata.version("sglang-jax").startswith("0.1."):
        _deselect(config, items, "sglang_jax_002")
    else:
        _deselect(config, items, "sglang_jax_01")
    # tpu-inference 0.32 needs Python 3.12, jax 0.11.2 and an 8 GB install: its tests run with the
    # test-command-tpu-inference (docs/testing.md), which installs it; elsewhere they are deselected.
    if importlib.util.find_spec("tpu_inference") is None:
        _deselect(config, items, "tpu_inference")
    # Compiling for TPU topologies needs libtpu (jax[tpu]); where it is not installed these tests
    # are deselected (the Python 3.12 CI leg installs it).
    if importlib.util.find_spec("libtpu") is None:
        _deselect(config, items, "tpu_compile")
    # The long TPU interpret-mode fuzz runs on request (the CI runs its short part).
    if not config.getoption("--tpu-long"):
        long = [it for it in items if "tpu_interpret" in it.keywords and "slow" in it.keywords]
        if long:
            config.hook.pytest_deselected(items=long)
            items[:] = [it for it in items if it not in long]


# Compiled executables are kept across test modules (recompiling them is most of a module's time)
# until the process holds this many memory maps: every XLA CPU executable holds hundreds of them,
# and past the kernel's limit (vm.max_map_count, 65,530 by default) LLVM fails to allocate and the
# process dies with SIGSEGV inside a compilation. The whole fast tier peaks near 20,000 maps
# without any clearing (KVCANARY_TEST_MAPS=1 prints the count after each module).
MAP_BUDGET = 40_000


def _map_count() -> int | None:
    try:
        with open("/proc/self/maps") as f:
            return sum(1 for _ in f)
    except OSError:  # no procfs: no way to watch the limit, so clear after every module
        return None


@pytest.fixture(autouse=True, scope="module")
def _release_executables():
    """Drops JAX's compiled executables after a test module once the process's memory maps
    approach the kernel's limit (:data:`MAP_BUDGET`)."""
    yield
    maps = _map_count()
    if maps is None or maps > MAP_BUDGET:
        jax.clear_caches()
    if os.environ.get("KVCANARY_TEST_MAPS"):  # diagnostics: the process's map count
        print(f"\n[maps after module: {maps} -> {_map_count()}]")


@pytest.fixture(scope="session")
def sgl():
    """SGLang 0.5.23's kv-canary modules (references, consts, dataclasses)."""
    return _oracle.load()


def _detects_races(node) -> bool:
    """Whether the test's TPU-interpreted kernels run the race detector (``_impls.DETECT_RACES``):
    every test under ``--long``; in the fast tier the tests marked ``fuzz`` (random and hostile
    cases, the race tests) or ``tpu_races``."""
    return _tier.LONG or any(node.get_closest_marker(m) for m in ("fuzz", "tpu_races"))


def _ordered(x, y) -> bool:
    """JAX's vector-clock ``ordered(x, y)`` (``lt(x, y) or lt(y, x)``: every component of one
    clock <= the other's and one <) on two clock arrays, with one subtraction instead of eight
    NumPy reductions."""
    import numpy as np

    d = np.subtract(x, y, dtype=np.int64).tolist()
    lo, hi = min(d), max(d)
    return (hi <= 0 and lo < 0) or (lo >= 0 and hi > 0)


def _quick_vector_clocks(monkeypatch) -> None:
    """The race detector compares each access's vector clock with every earlier access to the
    buffer (quadratic in a kernel's accesses) through the clocks' ``ordered``: most of a
    race-checked kernel's interpreted time in the fast tier. :func:`_ordered` gives the same
    answers (tests/test_suite_settings.py checks it against JAX's on random clocks) about 7x
    faster. Only the comparison changes; what is compared, and when, is JAX's. (jax < 0.11: a
    module function on arrays; later: ``NpVectorClock.ordered``.)"""
    try:
        from jax._src.pallas.mosaic.interpret import vector_clock
    except ImportError:  # an interpret mode without vector clocks: nothing to speed up
        return
    cls = getattr(vector_clock, "NpVectorClock", None)
    if cls is not None and callable(getattr(cls, "ordered", None)):
        monkeypatch.setattr(cls, "ordered", lambda self, other: _ordered(self.clock, other.clock))
    elif callable(getattr(vector_clock, "ordered", None)):
        monkeypatch.setattr(vector_clock, "ordered", _ordered)


@pytest.fixture(autouse=True)
def tpu_interpret_races(request, monkeypatch):
    """TPU interpret mode's race detector: every kernel the test interprets gets a fresh detector
    (JAX keeps only the last one, and before jax 0.11 it reports races by printing); a race in
    any of them fails the test. (JAX has no public API for this; it is test-only.)"""
    monkeypatch.setattr(_impls, "DETECT_RACES", _detects_races(request.node))
    try:
        from jax._src.pallas.mosaic.interpret import interpret_pallas_call as ipc
    except ImportError:  # no TPU interpret mode in this JAX
        yield
        return
    _quick_vector_clocks(monkeypatch)
    seen = []
    base = ipc.RaceDetectionState

    class Recorded(base):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            seen.append(self)

    monkeypatch.setattr(ipc, "RaceDetectionState", Recorded)
    yield
    found = [s for s in seen if s.races_found]
    assert not found, f"TPU interpret mode found races in {len(found)} of {len(seen)} kernels"
