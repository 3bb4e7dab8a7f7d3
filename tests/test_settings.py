"""Every setting through every source, the way an operator gets them wrong, and start-ups that fail or are
stopped at every step: one line naming the real source, exit status 2, no traceback, nothing left behind and
nothing of the operator's touched."""
from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from radixd.client import CacheClient
from radixd.server.config import SCHEMA, settings_table

from .conftest import ServerProc

CLI = [sys.executable, "-m", "radixd.server.cli", "serve"]
ROOT = Path(__file__).resolve().parent.parent

# Bad values by kind, as text (flags, variables) and as TOML literals (typed).
TEXT = {"int": ["x", "16.5"], "float": ["x", "nan"], "bool": ["ture"], "choice": ["bogus"], "size": ["lots"],
        "listen": ["bogus"], "gpus": ["a,b"]}
TOML = {"int": ["16.5", "true"], "float": ['"x"'], "bool": ['"ture"', "1"], "choice": ['"bogus"', "5"],
        "size": ['"lots"', "-5"], "listen": ["5"], "gpus": ['["a"]'], "str": ["9100"]}
# Text settings whose value has a meaning that can be wrong (the rest take any string).
STR_BAD = {"storage": "ftp://store", "kv_events_endpoint": "bogus", "kv_events_replay_endpoint": "bogus",
           "metrics_addr": "nohost", "model": "no-such-model", "model_config": "/nonexistent/config.json",
           "tls_cert": "/etc/hostname", "tls_key": "/etc/hostname"}


def _cases() -> list[tuple[str, str, str]]:
    """(setting, source, raw value): every setting, through each source where the value can be wrong."""
    out = []
    for name, st in SCHEMA.items():
        if name == "config":
            continue  # the file's own path: its cases are below
        text = TEXT.get(st.kind, [STR_BAD[name]] if name in STR_BAD else [])
        if st.minimum is not None:
            text = text + [str(int(st.minimum) - 1)]
        for v in text:
            if st.kind != "bool":  # a switch takes no value on the command line
                out.append((name, "flag", v))
            out.append((name, "env", v))
        literals = TOML.get(st.kind, []) if st.kind != "str" else (['9100'] + ([json.dumps(STR_BAD[name])]
                                                                               if name in STR_BAD else []))
        for v in literals:
            out.append((name, "toml", v))
    return out


CASES = _cases()


def _segments() -> set[str]:
    return {n for n in os.listdir("/dev/shm") if n.startswith("radixd-")}


def _snapshot(folder: Path) -> dict[str, tuple[int, bytes]]:
    return {p.name: (p.stat().st_mtime_ns, p.read_bytes() if p.is_file() else b"") for p in folder.iterdir()}


def _attempt(case: tuple[str, str, str], tmp: Path) -> tuple[str, subprocess.CompletedProcess, str, dict, dict]:
    name, source, value = case
    d = tmp / f"{name}-{source}-{abs(hash(value)) % 10**8}"
    d.mkdir()
    (d / "operator.txt").write_text("an operator's file next to the socket\n")
    base = {"device": "cpu", "num_slots": "64", "listen": f"unix:{d}/s.sock", "metrics_addr": "127.0.0.1:0"}
    argv = []
    for k, v in base.items():
        if k != name:
            argv += [f"--{k.replace('_', '-')}", v]
    env = {k: v for k, v in os.environ.items() if not k.startswith("RADIXD_")}
    flag = f"--{name.replace('_', '-')}"
    if source == "flag":
        argv += [flag, value]
        where = flag
    elif source == "env":
        env[f"RADIXD_{name.upper()}"] = value
        where = f"RADIXD_{name.upper()}"
    else:
        f = d / "radixd.toml"
        f.write_text(f"[radixd]\n{name} = {value}\n")
        argv += ["--config", str(f)]
        where = f"{f}: {name}"
    before = _snapshot(d)
    p = subprocess.Popen(CLI + argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    out, err = p.communicate(timeout=120)
    left = [n for n in _segments() if n.startswith(f"radixd-{p.pid}-")]  # this server's segments, if any
    return where, subprocess.CompletedProcess(p.args, p.returncode, out, err + "".join(left)), str(d), before, \
        _snapshot(d)


def test_at_least_a_hundred_bad_settings_each_fail_in_one_line_naming_their_source(tmp_path):
    assert len(CASES) >= 100, len(CASES)
    with ThreadPoolExecutor(4) as ex:
        results = list(ex.map(lambda c: _attempt(c, tmp_path), CASES))
    bad = []
    for case, (where, r, d, files_before, files_after) in zip(CASES, results):
        text = (r.stdout + r.stderr).strip()
        lines = text.splitlines()
        ok = (r.returncode == 2 and len(lines) == 1 and where in lines[0] and "Traceback" not in text
              and files_after == files_before and not os.path.exists(os.path.join(d, "s.sock")))
        if not ok:
            bad.append((case, r.returncode, text[-500:]))
    assert not bad, "\n".join(map(str, bad[:20]))  # (a segment left behind would be a second line)


def _one_line(r: subprocess.CompletedProcess, *needles: str) -> str:
    text = (r.stdout + r.stderr).strip()
    assert r.returncode == 2 and len(text.splitlines()) == 1 and "Traceback" not in text, text[-2000:]
    for n in needles:
        assert n in text, (n, text)
    return text


def _serve(*argv: str, env: dict | None = None, timeout: float = 120) -> subprocess.CompletedProcess:
    """A start; a shared-memory segment it left behind is reported as one more line of its output."""
    p = subprocess.Popen(CLI + ["--device", "cpu", "--num-slots", "1024", "--metrics-addr", "127.0.0.1:0", *argv],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env={**os.environ, **(env or {})})
    out, err = p.communicate(timeout=timeout)
    left = [n for n in _segments() if n.startswith(f"radixd-{p.pid}-")]
    return subprocess.CompletedProcess(p.args, p.returncode, out, err + "".join(f"\nleft {n}" for n in left))


def test_the_reported_examples(tmp_path):
    """The cases an operator reported, each through the source it came from."""
    sock = f"unix:{tmp_path}/s.sock"
    toml = tmp_path / "r.toml"
    cases = [
        ((), {"RADIXD_EVICTION_POLICY": "random"}, None, "RADIXD_EVICTION_POLICY"),
        ((), {"RADIXD_DTYPE": "int8"}, None, "RADIXD_DTYPE"),
        ((), {}, 'write_policy = "sometimes"', f"{toml}: write_policy"),
        ((), {"RADIXD_DEVICE": "tpu"}, None, "RADIXD_DEVICE"),
        ((), {"RADIXD_MLA": "ture"}, None, "RADIXD_MLA"),
        ((), {}, "page_size = 16.5", f"{toml}: page_size"),
        ((), {}, "metrics_addr = 9100", f"{toml}: metrics_addr"),
        (("--device-mem", "4 TB"), {}, None, "--device-mem"),
        ((), {"RADIXD_HOST_SLOTS": "100000000000000"}, None, "RADIXD_HOST_SLOTS"),
        ((), {"RADIXD_NUM_SLOTS": "100000000000000"}, None, "lower RADIXD_NUM_SLOTS"),
        ((), {"RADIXD_STORAGE": "ftp://x"}, None, "RADIXD_STORAGE"),
        ((), {}, "host_slots = 100000000000000", f"{toml}: host_slots"),
        ((), {}, "num_slots = 100000000000000", f"lower {toml}: num_slots"),
        (("--host-slots", "64", "--host-ratio", "2"), {}, None, "--host-slots and --host-ratio"),
        (("--host-slots", "64", "--host-mem", "1GiB"), {}, None, "--host-slots and --host-mem"),
        (("--model", "llama-3.1-8b", "--tp-size", "3"), {}, None, "--tp-size"),
        (("--model", "llama-3.1-8b", "--tp-size", "0"), {}, None, "--tp-size"),
        (("--tls-cert", "/etc/hostname", "--tls-key", "/etc/hostname"), {}, None, "--tls-cert"),
    ]
    arr = tmp_path / "array.json"
    arr.write_text("[1, 2]")
    cases.append((("--model-config", str(arr)), {}, None, "--model-config"))
    for argv, env, body, where in cases:
        args = list(argv)
        if body is not None:
            toml.write_text(f"[radixd]\n{body}\n")
            args += ["--config", str(toml)]
        if "--device-mem" in args or "RADIXD_NUM_SLOTS" in env or "num_slots" in (body or ""):  # no --num-slots
            r = subprocess.run(CLI + ["--device", "cpu", "--listen", sock, *args], capture_output=True, text=True,
                               timeout=120, env={**os.environ, **env})  # refused before any pool exists
        else:
            r = _serve("--listen", sock, *args, env=env)
        _one_line(r, where)
        assert not os.path.exists(f"{tmp_path}/s.sock")


def test_listen_paths_are_handled_with_care(tmp_path):
    op = tmp_path / "operator.toml"
    op.write_text("page_size = 16\n")
    _one_line(_serve("--listen", f"unix:{op}"), "is a file that is not a socket")
    assert op.read_text() == "page_size = 16\n"
    (tmp_path / "adir").mkdir()
    _one_line(_serve("--listen", f"unix:{tmp_path}/adir"), "is a directory")
    _one_line(_serve("--listen", f"unix:{tmp_path}/no/such/s.sock"), "does not exist")
    long = tmp_path / ("x" * 110)
    _one_line(_serve("--listen", f"unix:{long}"), "at most 107")
    held = socket.socket()
    held.bind(("127.0.0.1", 0))
    held.listen()
    try:
        _one_line(_serve("--listen", f"127.0.0.1:{held.getsockname()[1]}"), "the address is in use")
    finally:
        held.close()


def test_a_second_server_on_a_live_socket_is_refused_and_the_first_keeps_serving(tmp_path):
    first = ServerProc("--num-slots", "1024")
    try:
        r = _serve("--listen", f"unix:{first.sock}")
        _one_line(r, "a server is listening on")
        with CacheClient(first.target, name="still-there") as c:
            assert c.stats()["capacity_tokens"] == 1024
        first.proc.send_signal(signal.SIGKILL)
        first.proc.wait()
        assert os.path.exists(first.sock)  # a dead server's socket, and segments: the next start reclaims both
        again = ServerProc("--num-slots", "1024", sock=first.sock)
        with CacheClient(again.target) as c:
            assert c.stats()["capacity_tokens"] == 1024
        again.stop()
    finally:
        first.stop()


def test_a_missing_extra_is_one_line_naming_it(tmp_path):
    shadow = tmp_path / "shadow"
    for mod in ("zmq", "redis", "mooncake"):
        (shadow / mod).mkdir(parents=True)
        (shadow / mod / "__init__.py").write_text(f"raise ImportError('No module named {mod}')\n")
    env = {"PYTHONPATH": str(shadow)}
    sock = f"unix:{tmp_path}/s.sock"
    _one_line(_serve("--listen", sock, "--kv-events-endpoint", f"ipc://{tmp_path}/ev", env=env),
              "--kv-events-endpoint", "radixd[events]")
    _one_line(_serve("--listen", sock, "--host-slots", "64", "--storage", "valkey://127.0.0.1:1", env=env),
              "--storage", "radixd[storage]")
    _one_line(_serve("--listen", sock, "--host-slots", "64", "--storage", "mooncake://127.0.0.1:1", env=env),
              "--storage", "radixd[mooncake]")
    for mod in ("rich", "matplotlib"):
        (shadow / mod).mkdir(parents=True)
        (shadow / mod / "__init__.py").write_text(f"raise ImportError('No module named {mod}')\n")
    base = [sys.executable, "-m", "radixd.server.cli"]
    r = subprocess.run(base + ["top", "--target", f"unix://{tmp_path}/none.sock"], capture_output=True, text=True,
                       timeout=120, env={**os.environ, **env})
    _one_line(r, "radixd[top]")
    r = subprocess.run(base + ["simulate", "--requests", "20", "--capacity", "4096", "--out", str(tmp_path / "sim")],
                       capture_output=True, text=True, timeout=300, env={**os.environ, **env})
    assert r.returncode == 0 and "radixd[plots]" in r.stderr and "Traceback" not in r.stderr, r.stderr[-2000:]


def test_a_store_that_is_not_there_is_refused_at_start_quickly(tmp_path):
    closed = socket.socket()
    closed.bind(("127.0.0.1", 0))
    port = closed.getsockname()[1]
    closed.close()  # nothing listens there now
    sock = f"unix:{tmp_path}/s.sock"
    for url in (f"mooncake://127.0.0.1:{port}", f"valkey://127.0.0.1:{port}"):
        t0 = time.monotonic()
        r = _serve("--listen", sock, "--host-slots", "64", "--storage", url)
        assert time.monotonic() - t0 < 10
        _one_line(r, "--storage")
        assert not os.path.exists(f"{tmp_path}/s.sock")


def _tls(tmp_path: Path) -> tuple[str, str]:
    """A self-signed certificate and key (PEM) for localhost."""
    import datetime

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "localhost")])
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
            .serial_number(1).not_valid_before(now).not_valid_after(now + datetime.timedelta(days=1))
            .sign(key, hashes.SHA256()))
    c, k = tmp_path / "cert.pem", tmp_path / "key.pem"
    c.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    k.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                    serialization.NoEncryption()))
    return str(c), str(k)


def _free_port() -> int:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


@pytest.mark.parametrize("how", ["fail", "sigterm"])
def test_a_start_stopped_at_any_step_leaves_nothing_behind(how, tmp_path):
    """Every start-up step in turn (config, pools, host pool, storage, events, TLS, each listen address,
    metrics, serving): an injected failure, and separately a SIGTERM, leave no segment, socket or ipc file."""
    from radixd.server.app import START_STEPS
    cert, key = _tls(tmp_path)
    for step in START_STEPS:
        d = tmp_path / step
        d.mkdir()
        before = _segments()
        argv = ["--device", "cpu", "--num-slots", "1024", "--host-slots", "2048", "--listen", f"unix:{d}/s.sock",
                "--listen", f"127.0.0.1:{_free_port()}", "--tls-cert", cert, "--tls-key", key,
                "--storage", f"file://{d}/l3", "--kv-events-replay-endpoint", f"ipc://{d}/replay",
                "--metrics-addr", "127.0.0.1:0", "--grace-seconds", "0"]
        var = "RADIXD_TEST_FAIL_AT" if how == "fail" else "RADIXD_TEST_TERM_AT"
        p = subprocess.Popen(CLI + argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                             env={**os.environ, var: step})
        out, err = p.communicate(timeout=120)
        r = subprocess.CompletedProcess(p.args, p.returncode, out, err)
        if how == "fail":
            assert r.returncode == 2 and r.stderr.strip().splitlines()[-1] == \
                f"radixd: injected failure at start-up step {step!r} (RADIXD_TEST_FAIL_AT)", (step, r.stderr[-2000:])
        else:  # a stopped start (or, once serving, a graceful stop)
            assert r.returncode == (0 if step == "serving" else 143), (step, r.returncode, r.stderr[-2000:])
        assert "Traceback" not in r.stderr, (step, r.stderr[-3000:])
        assert not [n for n in _segments() - before if n.startswith(f"radixd-{p.pid}-")], step
        left = sorted(p.name for p in d.iterdir() if p.name != "l3")
        assert left == [], (step, left)


def test_the_readme_lists_every_setting_once():
    readme = (ROOT / "README.md").read_text()
    start = readme.index("<!-- settings table")
    block = readme[readme.index("\n", start) + 1:readme.index("<!-- end of settings table -->")].strip()
    assert block == settings_table(), "README's settings table is stale: paste radixd.server.config.settings_table()"
    for name in SCHEMA:
        assert readme.count(f"| `--{name.replace('_', '-')}` |") == 1, name
