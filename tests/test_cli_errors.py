"""User errors end in one line that names the bad value's source, with exit status 2 (usage) or 1
(unreachable), never a traceback; `radixd health` answers probes."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

CLI = [sys.executable, "-m", "radixd.server.cli"]
_CONFIGS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "configs")

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
    (["--storage", "file:///tmp/radixd-l3"], {}, "--storage"),  # L3 without a host tier
    (["--host-slots", "64", "--storage", "ftp://store"], {}, "--storage"),
    (["--host-slots", "64", "--storage", "valkey://"], {}, "--storage"),
    (["--host-slots", "64", "--storage", "file://relative/dir"], {}, "--storage"),
    (["--host-slots", "64", "--storage", "mooncake://127.0.0.1"], {}, "--storage"),
    (["--host-slots", "64", "--storage", "valkey+unix://"], {}, "--storage"),
    (["--host-slots", "64", "--storage", "redis://h:1?timeout_ms=soon"], {}, "--storage"),
    (["--prefetch-threshold", "0"], {}, "--prefetch-threshold"),
    (["--prefetch-timeout-ms", "-1"], {}, "--prefetch-timeout-ms"),
    ([], {"RADIXD_PREFETCH_POLICY": "sometimes"}, "RADIXD_PREFETCH_POLICY"),
    ([], {"RADIXD_STORAGE_WRITE_POLICY": "never"}, "RADIXD_STORAGE_WRITE_POLICY"),
    (["--model-config", "/nonexistent/config.json"], {}, "--model-config"),
    (["--model-config", "/dev/null"], {}, "--model-config"),
    (["--tp-size", "0"], {}, "--tp-size"),
    (["--hybrid-cache"], {}, "needs --model-config"),
    (["--hybrid-cache", "--model-config", f"{_CONFIGS}/gemma3-text.json", "--bigram"], {}, "--bigram"),
    (["--hybrid-cache", "--model-config", f"{_CONFIGS}/gemma3-text.json", "--swa-ratio", "0"], {}, "--swa-ratio"),
    (["--hybrid-cache", "--model-config", f"{_CONFIGS}/nemotron-h-4b.json", "--mamba-states", "0"], {},
     "--mamba-states"),
    (["--model-config", f"{_CONFIGS}/nemotron-h-4b.json"], {}, "need --hybrid-cache"),
]


def _run(argv, env=None, timeout=60):
    """One CLI run; a shared-memory segment the process left behind shows as a last line 'left NAME'."""
    p = subprocess.Popen(CLI + argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         env={**os.environ, **(env or {})})
    out, err = p.communicate(timeout=timeout)
    left = sorted(n for n in os.listdir("/dev/shm") if n.startswith(f"radixd-{p.pid}-"))
    return subprocess.CompletedProcess(p.args, p.returncode, out, err + "".join(f"left {n}\n" for n in left))


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


@pytest.mark.parametrize("argv,flag", [
    (["--num-slots", "4000000", "--layers", "32", "--kv-heads", "8", "--head-dim", "128"], "--num-slots"),
    (["--num-slots", "100000000000"], "--num-slots"),
    (["--num-slots", "4096", "--host-mem", "900TiB"], "lower --host-mem"),  # the setting actually given
    (["--device-mem", "4 TB"], "lower --device-mem (4 TB)"),
])
def test_pools_that_cannot_be_backed_are_refused_at_start(argv, flag, tmp_path):
    r = _run(["serve", "--listen", f"unix:{tmp_path}/s.sock", *argv])
    assert r.returncode == 2 and "Traceback" not in r.stderr
    line = r.stderr.strip().splitlines()[-1]
    assert "of shared memory" in line and "GB free" in line and flag in line, line
    assert "left radixd-" not in r.stderr and not os.path.exists(tmp_path / "s.sock")


def test_a_failed_start_after_the_pools_leaves_nothing_behind(tmp_path):
    r = _run(["serve", "--num-slots", "4096", "--host-slots", "4096", "--listen", f"unix:{tmp_path}/no/such/dir.sock"])
    assert r.returncode == 2 and "does not exist" in r.stderr and len(r.stderr.strip().splitlines()) == 1
    assert "left radixd-" not in r.stderr  # the device and host pools were created, then removed


def test_prefault_starts_and_serves(tmp_path):
    from .conftest import ServerProc
    s = ServerProc("--num-slots", "65536", "--host-slots", "65536", "--prefault")
    try:
        r = _run(["health", "--target", s.target])
        assert r.returncode == 0
    finally:
        s.stop()


def test_model_config_sets_the_kv_geometry_and_flags_win(tmp_path):
    import json
    from radixd.server.config import load, model_geometry
    llama = dict(num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8, hidden_size=4096,
                 torch_dtype="bfloat16")
    assert model_geometry(llama) == dict(layers=32, kv_heads=8, head_dim=128, dtype="bfloat16", mla=False)
    assert model_geometry(llama, tp_size=4)["kv_heads"] == 2
    assert model_geometry(llama, tp_size=16)["kv_heads"] == 1  # heads replicated across ranks
    deepseek = dict(num_hidden_layers=61, num_attention_heads=128, kv_lora_rank=512, qk_rope_head_dim=64,
                    hidden_size=7168, torch_dtype="bfloat16")
    assert model_geometry(deepseek) == dict(layers=61, kv_heads=1, head_dim=576, dtype="bfloat16", mla=True)
    qwen_vl = dict(text_config=dict(num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=2,
                                    hidden_size=2048, head_dim=128, torch_dtype="float16"))
    assert model_geometry(qwen_vl) == dict(layers=28, kv_heads=2, head_dim=128, dtype="float16", mla=False)
    f = tmp_path / "config.json"
    f.write_text(json.dumps(llama))
    cfg = load({"model_config": str(f), "layers": 2})
    assert (cfg.layers, cfg.kv_heads, cfg.head_dim, cfg.dtype) == (2, 8, 128, "bfloat16")


@pytest.mark.parametrize("step", ["pools", "storage", "events", "listen", "metrics", "serving"])
def test_a_failure_at_any_start_up_step_leaves_nothing_behind(step, tmp_path):
    from radixd.server.app import START_STEPS
    assert step in START_STEPS
    sock = tmp_path / "s.sock"
    r = _run(["serve", "--device", "cpu", "--num-slots", "1024", "--host-slots", "2048", "--listen", f"unix:{sock}",
              "--storage", f"file://{tmp_path}/l3", "--kv-events-replay-endpoint", f"ipc://{tmp_path}/replay"],
             env={"RADIXD_TEST_FAIL_AT": step})
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    assert r.stderr.strip().splitlines()[-1] == f"radixd: injected failure at start-up step {step!r} " \
                                                "(RADIXD_TEST_FAIL_AT)"
    assert "left radixd-" not in r.stderr and not sock.exists()


# Every `radixd serve` flag with a value that cannot work: one line naming the flag, exit status 2.
ANY_STRING = {"--token": "any string is a token", "--kv-events-topic": "any string is a topic",
              "--model-id": "any string names a model"}
BAD_VALUE = {"--listen": "bogus", "--gpus": "a,b", "--host-mem": "lots", "--metrics-addr": "nohost",
             "--config": "/nonexistent/radixd.toml", "--tls-cert": "/etc/hostname", "--tls-key": "/etc/hostname",
             "--kv-events-endpoint": "bogus", "--kv-events-replay-endpoint": "bogus", "--storage": "ftp://store",
             "--model-config": "/nonexistent/config.json", "--model": "no-such-model", "--device-mem": "lots"}


def _bad_argv(name: str, opts: dict) -> list[str]:
    from radixd.server.config import SCHEMA
    st = SCHEMA[name[2:].replace("-", "_")]
    if opts.get("action") == "store_const":
        return [f"{name}=1"]  # a switch takes no value
    if st.kind == "choice":
        return [name, "bogus"]
    if st.kind in ("int", "float"):
        return [name, "x"]
    assert name in BAD_VALUE, f"add a bad value for the new flag {name} to BAD_VALUE (or to ANY_STRING)"
    return [name, BAD_VALUE[name]]


def test_every_serve_flag_refuses_a_bad_value_in_one_line():
    from concurrent.futures import ThreadPoolExecutor

    from radixd.server.cli import SERVE_FLAGS
    cases = [(name, _bad_argv(name, opts)) for name, opts in SERVE_FLAGS if name not in ANY_STRING]
    assert len(cases) + len(ANY_STRING) == len(SERVE_FLAGS)
    with ThreadPoolExecutor(4) as ex:
        runs = list(ex.map(lambda c: _run(["serve", "--device", "cpu", "--num-slots", "64", *c[1]]), cases))
    for (name, argv), r in zip(cases, runs):
        lines = r.stderr.strip().splitlines()
        assert r.returncode == 2, (argv, r.stderr[-2000:])
        named = name in lines[0] or (name == "--config" and argv[-1] in lines[0])  # the file names itself
        assert len(lines) == 1 and named and "Traceback" not in r.stderr, (argv, r.stderr[-2000:])


def test_a_device_pool_larger_than_the_gpu_has_free_is_refused():
    """The GPU check itself (a GPU host runs it for real in tests/gpu): numbers and the flag to lower."""
    from radixd.server.app import StartupError, check_gpus
    check_gpus(10 << 30, [0, 1], free_of=lambda g: 40 << 30)
    with pytest.raises(StartupError) as e:
        check_gpus(30 << 30, [0, 1], free_of=lambda g: (40 << 30) if g == 0 else (20 << 30))
    assert "GPU 1" in str(e.value) and "21.5 GB free" in str(e.value) and "--num-slots" in str(e.value)



def test_sizing_by_model_preset_and_bytes():
    from radixd.server.config import ConfigError, load, slot_bytes_of
    cfg = load({"model": "llama-3.1-8b", "device_mem": "1GiB", "page_size": 16})
    assert (cfg.layers, cfg.kv_heads, cfg.head_dim, cfg.dtype) == (32, 8, 128, "bfloat16")
    assert slot_bytes_of(cfg) == 32 * 2 * 8 * 128 * 2 and cfg.num_slots == (1 << 30) // slot_bytes_of(cfg)
    ds = load({"model": "deepseek-v3", "device_mem": "1GiB", "tp_size": 8})
    assert (ds.mla, ds.kv_heads, ds.head_dim) == (True, 1, 576) and slot_bytes_of(ds) == 61 * 576 * 2
    with pytest.raises(ConfigError, match="presets: "):
        load({"model": "gpt-17"})
    with pytest.raises(ConfigError, match="give one of --device-mem, --num-slots"):
        load({"device_mem": "1GiB", "num_slots": 64})
    with pytest.raises(ConfigError, match="less than one page"):
        load({"model": "llama-3.1-70b", "device_mem": "1KiB"})


def test_the_ready_line_says_what_was_sized(tmp_path):
    p = subprocess.Popen(CLI + ["serve", "--device", "cpu", "--listen", f"unix:{tmp_path}/s.sock", "--model",
                                "qwen2.5-7b", "--device-mem", "64MiB", "--page-size", "16"],
                         stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        line = p.stdout.readline()
    finally:
        p.terminate()
        p.wait(30)
    per_token = 28 * 2 * 4 * 128 * 2
    slots = (64 << 20) // per_token // 16 * 16
    assert f"device_tokens={slots} host_tokens=0 bytes_per_token={per_token} instance=" in line, line


def test_every_serve_flag_is_in_the_readme():
    from pathlib import Path

    from radixd.server.cli import SERVE_FLAGS
    readme = (Path(__file__).resolve().parent.parent / "README.md").read_text()
    block = readme.split("## Using it", 1)[1].split("```")[1]
    assert not [name for name, _ in SERVE_FLAGS if name not in block], "README's flag block is out of date"


def test_every_serve_flag_has_help_text():
    from radixd.server.cli import SERVE_FLAGS
    assert not [name for name, kw in SERVE_FLAGS if len(kw.get("help", "")) < 10]
    r = _run(["serve", "--help"])
    assert r.returncode == 0 and all(name in r.stdout for name, _ in SERVE_FLAGS)


def test_a_refused_start_beside_a_dead_servers_segment_is_still_one_line():
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    seg = f"/dev/shm/radixd-{dead.pid}-{os.urandom(8).hex()}-device"
    open(seg, "wb").close()
    try:
        r = _run(["serve", "--storage", "file:///tmp/radixd-l3"])
        assert r.returncode == 2, r.stderr
        lines = r.stderr.strip().splitlines()
        assert len(lines) == 1 and "L3 needs the host tier" in lines[0], r.stderr
        assert not os.path.exists(seg)  # swept all the same
    finally:
        if os.path.exists(seg):
            os.unlink(seg)
