"""What `kubectl apply -k deploy/k8s` applies: kustomize's output, from kubectl where it is
installed, else from a small resolver of the features the kustomization uses (resources,
namespace, images). Where both exist a test holds the resolver to kustomize's output."""

from __future__ import annotations

import copy
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import yaml

from tests.deploy.consistency import load_all

#: kinds without a namespace (kustomize leaves them alone)
CLUSTER_KINDS = {"Namespace", "ClusterRole", "ClusterRoleBinding", "PersistentVolume",
                 "StorageClass", "CustomResourceDefinition"}  # fmt: skip
KUBECTL_TIMEOUT_S = 60


def kubectl_kustomize(folder: Path) -> list[dict[str, Any]] | None:
    """kustomize's own build of ``folder`` (kubectl's), or None where kubectl is missing."""
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        return None
    done = subprocess.run(
        [kubectl, "kustomize", str(folder)],
        capture_output=True,
        text=True,
        timeout=KUBECTL_TIMEOUT_S,
    )
    assert done.returncode == 0, f"kubectl kustomize {folder} failed:\n{done.stderr}"
    return [doc for doc in yaml.safe_load_all(done.stdout) if doc]


def resolve(folder: Path) -> list[dict[str, Any]]:
    """The kustomization's resources with its namespace and image entries applied."""
    (kustomization,) = load_all(folder / "kustomization.yaml")
    known = {"apiVersion", "kind", "namespace", "resources", "images"}
    unknown = set(kustomization) - known
    assert not unknown, f"the resolver does not know kustomization fields {sorted(unknown)}"
    docs = [
        copy.deepcopy(d) for name in kustomization["resources"] for d in load_all(folder / name)
    ]
    images = {entry["name"]: entry for entry in kustomization.get("images", [])}
    for doc in docs:
        if doc["kind"] not in CLUSTER_KINDS and "namespace" in kustomization:
            doc["metadata"]["namespace"] = kustomization["namespace"]
        for container in containers(doc):
            name, _, tag = container["image"].partition(":")
            entry = images.get(name)
            if entry is not None:
                container["image"] = f"{entry.get('newName', name)}:{entry.get('newTag', tag)}"
    return docs


def render(folder: Path) -> list[dict[str, Any]]:
    return kubectl_kustomize(folder) or resolve(folder)


def containers(node: Any) -> Iterator[dict[str, Any]]:
    """Every container spec anywhere in a manifest (pod templates of any kind, KEDA's too)."""
    if isinstance(node, dict):
        for key, value in node.items():
            if key in ("containers", "initContainers") and isinstance(value, list):
                yield from value
            else:
                yield from containers(value)
    elif isinstance(node, list):
        for item in node:
            yield from containers(item)


def by_key(docs: list[dict[str, Any]]) -> dict[tuple[str, str], dict[str, Any]]:
    return {(d["kind"], d["metadata"]["name"]): d for d in docs}
