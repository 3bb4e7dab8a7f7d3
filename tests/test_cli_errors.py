"""User errors end in one line that names the bad value's source, with exit status 2 (usage) or 1
(unreachable), never a traceback; `radixd health` answers probes."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

CLI = [sys.executable, "-m", "radixd.server.cli"]

BAD_SERVE = [  # (argv after `serve`, extra environment, text the one line must contain)
    (["--num-slots", "0"], {}, "--num-slots"),
    (["--num-slots", "lots"], {}, "--num-slots"),
    (["--page-size", "0"], {}, "--page-size"),
    (["--num-slots", "100", "--page-size", "16"], {}, "multiple of the page size"),
    (["--layers", "0"], {}, "--layers"),
    (["--kv-heads", "-1"], {}, "--kv-heads"),
    (["--head-dim", "0"], {}, "--head-dim"),
    (["--host-slots", "-5"], {}, "--host-slots"),
    (["--host-ratio", "-1"], {}, "--host-ratio"),
    (["--host-mem", "lots"], {}, "--host-mem"),
    (["--write-through-threshold", "0"], {}, "--write-through-threshold"),
    (["--load-back-threshold", "-1"], {}, "--load-back-threshold"),
    (["--kv-events-buffer", "0"], {}, "--kv-events-buffer"),
    (["--grace-seconds", "-1"], {}, "--grace-seconds"),
    (["--gpus", "a,b"], {}, "--gpus"),
    ([], {"RADIXD_PAGE_SIZE": "abc"}, "RADIXD_PAGE_SIZE"),
    ([], {"RADIXD_NUM_SLOTS": "-3"}, "RADIXD_NUM_SLOTS"),
    (["--config", "/nonexistent/radixd.toml"], {}, "/nonexistent/radixd.toml"),
]


def _run(argv, env=None, timeout=60):
    return subprocess.run(CLI + argv, capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, **(env or {})})


@pytest.mark.parametrize("argv,env,names", BAD_SERVE, ids=[" ".join(a) or next(iter(e)) for a, e, _ in BAD_SERVE])
def test_bad_settings_fail_in_one_line_with_status_2(argv, env, names):
    r = _run(["serve", *argv], env)
    assert r.returncode == 2, r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("radixd") and names in lines[0], r.stderr
    assert "Traceback" not in r.stderr


def test_bad_toml_names_the_file_and_key(tmp_path):
    f = tmp_path / "r.toml"
    f.write_text("[radixd]\npage_size = 'big'\n")
    r = _run(["serve", "--config", str(f)])
    assert r.returncode == 2 and f"{f}: page_size" in r.stderr and "Traceback" not in r.stderr
    f.write_text("[radixd]\nno_such_knob = 1\n")
    r = _run(["serve", "--config", str(f)])
    assert r.returncode == 2 and "unknown setting 'no_such_knob'" in r.stderr


@pytest.mark.parametrize("cmd", ["stats", "info", "check", "health", "events"])
def test_unreachable_server_is_one_line_and_status_1(cmd, tmp_path):
    r = _run([cmd, "--target", f"unix://{tmp_path}/none.sock"])
    assert r.returncode == 1, r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "cannot get an answer" in lines[0] and "Traceback" not in r.stderr


def test_health_answers_serving(server):
    r = _run(["health", "--target", server.target])
    assert r.returncode == 0 and r.stdout.strip() == "SERVING"
