"""Render a kustomization of deploy/ in Python, offline: the subset of kustomize it uses.

deploy/ is applied with `kubectl apply -k`, whose kustomize the tests may not have. It uses
only three of kustomize's features, and this renders exactly those, refusing anything else
(an unknown kustomization key, a patch that is not a JSON 6902 list, a generator option it
does not implement), so that the subset cannot drift silently:

- `resources`: YAML files (every document) and other kustomization directories;
- `secretGenerator` and `configMapGenerator` with `files` (`KEY=PATH` or `PATH`) and
  `generatorOptions.disableNameSuffixHash: true` (fixed names);
- `patches` of JSON 6902 operations (`add`, `replace`, `remove`) with a `target` of
  `kind` and `name`.

Where kubectl is installed, tests/deploy/test_manifests.py checks that kustomize itself
renders the same objects.
"""

from __future__ import annotations

import base64
import copy
from pathlib import Path
from typing import Any

import yaml

Obj = dict[str, Any]
_KNOWN_KEYS = {
    "apiVersion",
    "kind",
    "resources",
    "patches",
    "secretGenerator",
    "configMapGenerator",
    "generatorOptions",
}


class RenderError(Exception):
    """The kustomization uses something this subset does not render, or is wrong."""


def render(directory: Path) -> list[Obj]:
    """The objects `kubectl kustomize DIRECTORY` renders, in no particular order."""
    kustomization = yaml.safe_load((directory / "kustomization.yaml").read_text())
    unknown = set(kustomization) - _KNOWN_KEYS
    if unknown:
        raise RenderError(f"{directory}: kustomization keys not rendered here: {sorted(unknown)}")
    objects: list[Obj] = []
    for entry in kustomization.get("resources", []):
        path = directory / entry
        if path.is_dir():
            objects += render(path)
        else:
            objects += [d for d in yaml.safe_load_all(path.read_text()) if d is not None]
    options = kustomization.get("generatorOptions", {})
    generators = kustomization.get("secretGenerator", []) + kustomization.get(
        "configMapGenerator", []
    )
    if generators and options != {"disableNameSuffixHash": True}:
        raise RenderError(f"{directory}: only generatorOptions.disableNameSuffixHash is rendered")
    for spec in kustomization.get("secretGenerator", []):
        objects.append(_generated(directory, spec, secret=True))
    for spec in kustomization.get("configMapGenerator", []):
        objects.append(_generated(directory, spec, secret=False))
    for patch in kustomization.get("patches", []):
        _patch(directory, patch, objects)
    return objects


def _generated(directory: Path, spec: Obj, *, secret: bool) -> Obj:
    if set(spec) != {"name", "files"}:
        raise RenderError(f"{directory}: generator fields not rendered here: {sorted(spec)}")
    data: dict[str, str] = {}
    for entry in spec["files"]:
        key, _, path = entry.rpartition("=")
        content = (directory / path).read_bytes()
        key = key or Path(path).name
        data[key] = base64.b64encode(content).decode() if secret else content.decode()
    obj: Obj = {"apiVersion": "v1", "kind": "Secret" if secret else "ConfigMap"}
    obj["metadata"] = {"name": spec["name"]}
    if secret:
        obj["type"] = "Opaque"
    obj["data"] = data
    return obj


def _patch(directory: Path, patch: Obj, objects: list[Obj]) -> None:
    target = patch.get("target", {})
    if set(patch) != {"path", "target"} or not set(target) <= {"kind", "name"}:
        raise RenderError(f"{directory}: only path + target(kind, name) patches are rendered")
    operations = yaml.safe_load((directory / patch["path"]).read_text())
    if not isinstance(operations, list):
        raise RenderError(f"{directory / patch['path']}: not a JSON 6902 patch (a list)")
    matched = [
        obj
        for obj in objects
        if target.get("kind", obj["kind"]) == obj["kind"]
        and target.get("name", obj["metadata"]["name"]) == obj["metadata"]["name"]
    ]
    if not matched:
        raise RenderError(f"{directory}: patch {patch['path']} matches no object ({target})")
    for obj in matched:
        for op in operations:
            _apply(obj, op)


def _apply(document: Obj, op: Obj) -> None:
    """One RFC 6902 operation, in place."""
    kind, pointer = op.get("op"), op.get("path", "")
    if kind not in ("add", "replace", "remove") or not pointer.startswith("/"):
        raise RenderError(f"JSON 6902 operation not rendered here: {op}")
    tokens = [t.replace("~1", "/").replace("~0", "~") for t in pointer[1:].split("/")]
    parent: Any = document
    for token in tokens[:-1]:
        parent = parent[int(token)] if isinstance(parent, list) else parent[token]
    last = tokens[-1]
    if isinstance(parent, list):
        index = len(parent) if last == "-" else int(last)
        if kind == "add":
            parent.insert(index, copy.deepcopy(op["value"]))
        elif kind == "replace":
            parent[index] = copy.deepcopy(op["value"])
        else:
            del parent[index]
        return
    if kind != "add" and last not in parent:
        raise RenderError(f"{kind} of {pointer}, which does not exist")
    if kind == "remove":
        del parent[last]
    else:
        parent[last] = copy.deepcopy(op["value"])
