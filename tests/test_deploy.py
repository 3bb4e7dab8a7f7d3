"""The deploy files pass their linters (hadolint, the Kubernetes schema) and query only metrics radixd exports."""
import shutil
import subprocess
from pathlib import Path

import pytest

DEPLOY = Path(__file__).resolve().parent.parent / "deploy"


def _tool(name: str) -> str:
    path = shutil.which(name)
    assert path, f"{name} is not installed (it comes with the test extra: pip install -e '.[test]')"
    return path


def test_dockerfile_passes_hadolint_and_probes_with_health():
    r = subprocess.run([_tool("hadolint"), "--failure-threshold", "info", str(DEPLOY / "Dockerfile")],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr
    text = (DEPLOY / "Dockerfile").read_text()
    assert "HEALTHCHECK" in text and "radixd\", \"health\"" in text and "\nUSER " in text


PLATFORMS = ("manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_26_x86_64", "manylinux_2_24_x86_64",
             "manylinux_2_17_x86_64", "manylinux2014_x86_64", "manylinux1_x86_64", "linux_x86_64")


def test_the_images_python_environment_resolves_with_one_cuda_version(tmp_path):
    """What the Dockerfile installs, resolved by pip against the registry for the image's platform and Python (a dry
    run: metadata only, no wheel kept): it must resolve as pinned, and every CUDA piece must be of one CUDA major
    version, torch's."""
    import json
    import sys
    text = (DEPLOY / "Dockerfile").read_text()
    assert "FROM python:3.11" in text and "-r deploy/requirements-image.txt" in text
    report = tmp_path / "report.json"
    cmd = [sys.executable, "-m", "pip", "--isolated", "install", "--dry-run", "--ignore-installed",
           "--only-binary=:all:", "--python-version", "3.11", "--implementation", "cp", "--target",
           str(tmp_path / "t"), "--report", str(report), "-r", str(DEPLOY / "requirements-image.txt")]
    for p in PLATFORMS:
        cmd += ["--platform", p]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    if r.returncode and ("NewConnectionError" in r.stdout + r.stderr or "Network is unreachable" in r.stderr):
        pytest.skip("no package registry reachable from here")
    assert r.returncode == 0, (r.stdout + r.stderr)[-3000:]
    got = {i["metadata"]["name"].lower(): i["metadata"]["version"] for i in json.loads(report.read_text())["install"]}
    pinned = {line.split("==")[0].split("[")[0].lower().replace("_", "-"): line.split("==")[1].strip()
              for line in (DEPLOY / "requirements-image.txt").read_text().splitlines()
              if line and not line.startswith("#")}
    assert {k.replace("_", "-"): v for k, v in got.items()} == pinned  # nothing unpinned came along
    majors = {name.rsplit("-cu", 1)[1] for name in got if name.startswith("nvidia-") and "-cu" in name}
    assert majors == {"12"} and got["cuda-toolkit"].startswith("12.") and got["cupy-cuda12x"], (majors, got)


def test_kubernetes_example_passes_the_schema_and_probes_cheaply():
    r = subprocess.run([_tool("kubernetes-validate"), "--strict", str(DEPLOY / "k8s-sidecar.yaml")],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    assert '"radixd", "check"' not in (DEPLOY / "k8s-sidecar.yaml").read_text()  # O(cache) checker: not a probe


def test_the_kubernetes_example_shares_one_gpu_and_sizes_the_pool_in_bytes():
    """Both containers name one resource claim (an nvidia.com/gpu limit would give the GPU to one container alone),
    and radixd's args parse with its own settings schema into a pool that fits the bytes it names."""
    import yaml

    from radixd.server.config import load, parse_bytes, slot_bytes_of
    docs = list(yaml.safe_load_all((DEPLOY / "k8s-sidecar.yaml").read_text()))
    template = next(d for d in docs if d["kind"] == "ResourceClaimTemplate")
    pod = next(d for d in docs if d["kind"] == "Pod")
    (claim,) = pod["spec"]["resourceClaims"]
    assert claim["resourceClaimTemplateName"] == template["metadata"]["name"]
    containers = {c["name"]: c for c in pod["spec"]["containers"]}
    for c in containers.values():
        assert c["resources"]["claims"] == [{"name": claim["name"]}], c["name"]
        assert "nvidia.com/gpu" not in str(c["resources"])
    args = containers["radixd"]["args"]
    flags = {args[i][2:].replace("-", "_"): args[i + 1] for i in range(0, len(args), 2)}
    assert "num_slots" not in flags and "device_mem" in flags
    cfg = load(flags)
    assert 0 < cfg.num_slots * slot_bytes_of(cfg) <= parse_bytes(flags["device_mem"])
    shm = next(v for v in pod["spec"]["volumes"] if v["name"] == "dshm")["emptyDir"]["sizeLimit"]
    assert parse_bytes(flags["host_mem"]) < parse_bytes(shm.replace("Gi", "GiB"))


def _queried_metrics() -> set[str]:
    """Every radixd_* series the dashboard panels and the alert rules query."""
    import json
    import re
    import yaml
    exprs = [t["expr"] for p in json.loads((DEPLOY / "grafana" / "radixd.json").read_text())["panels"]
             for t in p["targets"]]
    rules = yaml.safe_load((DEPLOY / "radixd-alerts.yml").read_text())
    exprs += [r["expr"] for g in rules["groups"] for r in g["rules"]]
    assert all(r.get("annotations", {}).get("summary") for g in rules["groups"] for r in g["rules"])
    return {m for e in exprs for m in re.findall(r"radixd_[a-z_]+", e)}


def test_every_metric_the_dashboard_and_alerts_query_is_exported(tmp_path):
    """A live server with every tier on, after a workload that also produces errors and L3 traffic."""
    import urllib.request

    import numpy as np

    from radixd.client import CacheClient, NotFound

    from .conftest import ServerProc
    srv = ServerProc("--num-slots", "1024", "--page-size", "16", "--host-slots", "2048", "--storage",
                     f"file://{tmp_path}/l3", "--prefetch-threshold", "16")
    try:
        with CacheClient(srv.target) as c:
            toks = np.arange(1, 129, dtype=np.int32)
            ins = c.cache_finished([dict(tokens=toks, indices=c.alloc(128))])[0]
            c.wait_storage(ins.backup_transfer_ids)
            c.evict(128, host_tokens=128)
            c.prefetch([toks], wait=True)
            with pytest.raises(NotFound):
                c.unlock([12345])
        with urllib.request.urlopen(f"http://{srv.metrics_url.split('//')[1]}", timeout=10) as r:
            text = r.read().decode()
    finally:
        srv.stop()
    exported = {line.split("{")[0].split(" ")[0] for line in text.splitlines() if line and line[0] != "#"}
    missing = {m for m in _queried_metrics() if m not in exported}
    assert not missing, sorted(missing)
    assert not [m for m in exported if m.endswith("_created")]  # no duplicate _created series
    counters = [line.split()[2] for line in text.splitlines() if line.startswith("# TYPE") and line.endswith("counter")]
    assert counters and all(n.endswith("_total") for n in counters), counters  # counters end in _total


def test_the_alert_rules_pass_promtool():
    promtool = shutil.which("promtool") or str(DEPLOY.parent / ".tools" / "promtool")
    if not Path(promtool).exists():
        pytest.skip("promtool is not installed (.ci/run takes it from Debian's prometheus package)")
    r = subprocess.run([promtool, "check", "rules", str(DEPLOY / "radixd-alerts.yml")], capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 0 and "SUCCESS: 6 rules found" in r.stdout, r.stdout + r.stderr
