"""radixd as SGLang 0.5.23's radix-cache backend, on real SGLang classes with CPU pools and a live radixd
server (tests/sglang_backend_check.py runs in SGLang's own venv; `.ci/run` builds `.venv-sglang`)."""
from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from radixd.client import CacheClient

from .conftest import ServerProc, venv_python

CHECK = Path(__file__).resolve().parent / "sglang_backend_check.py"
DIFF = Path(__file__).resolve().parent / "sglang_differential.py"


SGL_PY = venv_python("RADIXD_SGLANG_PYTHON", ".venv-sglang")
pytestmark = pytest.mark.skipif(SGL_PY is None, reason="no SGLang venv (.ci/run builds .venv-sglang with sglang "
                                                       "0.5.23; or set RADIXD_SGLANG_PYTHON)")
SCENARIOS = ["two_engines_share_pages_byte_for_byte", "a_scheduler_step_publishes_its_stores_in_one_call",
             "cpu_copies_go_by_whole_pages_only", "pages_on_radixd_host_tier_are_loaded_back",
             "partial_hit_and_namespaces", "abort_and_unused_markers_release_radixd_locks",
             "a_lock_outlives_a_queued_load_back_copy", "a_request_whose_lookup_is_out_waits_in_the_queue",
             "a_finished_hit_publishes_only_its_new_pages", "a_queued_hit_is_copied_ahead_into_spare_slots",
             "same_matches_as_sglang_alone", "overridden_signatures_match_sglang",
             "a_stopped_radixd_costs_a_miss_at_the_deadline",
             "tensor_parallel_ranks_share_their_heads", "a_hybrid_model_is_refused_at_engine_start_in_one_line"]


@pytest.fixture(scope="module")
def server():
    s = ServerProc("--num-slots", "4096", "--page-size", "4", "--layers", "2", "--kv-heads", "2", "--head-dim", "8",
                   "--dtype", "float32", "--host-slots", "8192", "--load-back-threshold", "1")
    yield s
    s.stop()


@pytest.mark.parametrize("scenario", SCENARIOS)
def test_backend_scenario(server, scenario):
    r = subprocess.run([SGL_PY, str(CHECK), server.target, scenario], capture_output=True, text=True, timeout=600,
                       env={**os.environ, "PYTHONPATH": "", "RADIXD_SERVER_PID": str(server.proc.pid)})
    assert r.returncode == 0 and f"ok {scenario}" in r.stdout, (r.stdout[-3000:] + r.stderr[-5000:])
    with CacheClient(server.target, name="after") as c:  # the scenario's sessions are gone: nothing leaks
        s = c.stats()
        assert s["receipts"] == 0 and s["held_tokens"] == 0 and c.check() == []


def test_a_miss_makes_no_round_trip_with_kv_events():
    srv = ServerProc("--num-slots", "4096", "--page-size", "4", "--layers", "2", "--kv-heads", "2", "--head-dim", "8",
                     "--dtype", "float32", "--kv-events")
    try:
        scenario = "a_miss_makes_no_round_trip_with_kv_events"
        r = subprocess.run([SGL_PY, str(CHECK), srv.target, scenario], capture_output=True, text=True, timeout=600,
                           env={**os.environ, "PYTHONPATH": ""})
        assert r.returncode == 0 and f"ok {scenario}" in r.stdout, (r.stdout[-3000:] + r.stderr[-5000:])
    finally:
        srv.stop()


def test_wrong_page_size_is_refused_in_plain_words():
    srv = ServerProc("--num-slots", "4096", "--page-size", "8", "--layers", "2", "--kv-heads", "2", "--head-dim",
                     "8", "--dtype", "float32")
    try:
        r = subprocess.run([SGL_PY, str(CHECK), srv.target, "two_engines_share_pages_byte_for_byte"],
                           capture_output=True, text=True, timeout=600, env={**os.environ, "PYTHONPATH": ""})
        assert r.returncode != 0 and "start radixd with --page-size 4" in r.stderr
    finally:
        srv.stop()


@pytest.mark.parametrize("page,seed", [(1, 2), (1, 5), (16, 3)])
def test_backend_against_sglangs_own_cache_op_by_op(page, seed):
    """tests/sglang_differential.py: 2,000 seeded scheduler operations on SGLang's RadixCache and on the
    backend, compared after every one (SGLang's real Req and array('q') keys, its own match, checkpoint and
    release helpers); radixd's receipts, held and protected slots back to 0 whenever the engine is idle."""
    srv = ServerProc("--num-slots", str(2048 if page == 1 else 4096), "--page-size", str(page), "--layers", "2",
                     "--kv-heads", "2", "--head-dim", "8", "--dtype", "float32")  # device only: every lock is
    # an engine's (a host tier's backups lock briefly on their own; its load-backs have their own scenario)
    try:
        r = subprocess.run([SGL_PY, str(DIFF), srv.target, str(page), str(seed), "2000"], capture_output=True,
                           text=True, timeout=900, env={**os.environ, "PYTHONPATH": ""})
        assert r.returncode == 0 and f"ok differential {page}" in r.stdout, r.stdout[-3000:] + r.stderr[-5000:]
        with CacheClient(srv.target, name="after") as c:
            s = c.stats()
            assert (s["receipts"], s["held_tokens"], s["protected_tokens"]) == (0, 0, 0) and c.check() == []
    finally:
        srv.stop()
