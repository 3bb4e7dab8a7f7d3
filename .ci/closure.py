"""Print name==version for the installed dependency closure of a distribution with extras (for constraints files)."""
import sys
from importlib import metadata
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

root, extras = sys.argv[1], set(sys.argv[2].split(",")) if len(sys.argv) > 2 and sys.argv[2] else set()
skip = {canonicalize_name(x) for x in sys.argv[3].split(",")} if len(sys.argv) > 3 else set()
seen, todo = {}, [(root, extras)]
while todo:
    name, ex = todo.pop()
    try:
        dist = metadata.distribution(name)
    except metadata.PackageNotFoundError:
        continue
    key = canonicalize_name(dist.metadata["Name"])
    if key in seen and ex <= seen[key][1]:
        continue
    prev = seen.get(key, (None, set()))[1]
    seen[key] = (dist.version, prev | ex)
    for r in dist.requires or []:
        req = Requirement(r)
        envs = [{"extra": e} for e in (ex or {""})]
        if req.marker and not any(req.marker.evaluate(e) for e in envs):
            continue
        todo.append((req.name, set(req.extras)))
for key in sorted(seen):
    if key != canonicalize_name(root) and key not in skip:
        print(f"{key}=={seen[key][0]}")
