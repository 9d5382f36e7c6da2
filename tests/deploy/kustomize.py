"""A pure-Python renderer for the part of Kustomize that docker/k8s/ uses (no kubectl or kustomize here).

It renders what `kubectl kustomize <dir>` renders for these fields, and refuses any other field, so that a
kustomization cannot use a feature whose meaning these tests would get wrong:

    resources             files (one or more YAML documents) and folders with a kustomization.yaml
    configMapGenerator    name + files, with generatorOptions.disableNameSuffixHash: true
    patches               RFC 6902 JSON patches (add / replace / remove) from a file, on a target kind + name
    namespace             metadata.namespace of namespaced objects, and the namespace of the ServiceAccount
                          subjects of (Cluster)RoleBindings that name none
    labels                pairs added to metadata.labels (includeSelectors / includeTemplates left false)
    images                newName / newTag of containers and init containers whose image has that name

Order of a kustomization's steps, as in Kustomize: its resources (each folder rendered first), its generators,
then patches, namespace, labels, images. The output is sorted by kind the way Kustomize's default order is.
"""

from __future__ import annotations

import copy
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import yaml

Doc = dict[str, Any]

ALLOWED_FIELDS = {"apiVersion", "kind", "resources", "configMapGenerator", "generatorOptions", "patches", "namespace",
                  "labels", "images"}  # fmt: skip
CLUSTER_SCOPED = {"Namespace", "ClusterRole", "ClusterRoleBinding", "CustomResourceDefinition", "PersistentVolume",
                  "StorageClass", "PriorityClass", "MutatingWebhookConfiguration",
                  "ValidatingWebhookConfiguration"}  # fmt: skip
# Kustomize's default ("legacy") output order: these kinds first, in this order; the rest after, by kind.
ORDER_FIRST = ["Namespace", "ResourceQuota", "StorageClass", "CustomResourceDefinition", "ServiceAccount",
               "PodSecurityPolicy", "Role", "ClusterRole", "RoleBinding", "ClusterRoleBinding", "ConfigMap", "Secret",
               "Endpoints", "Service", "LimitRange", "PriorityClass", "PersistentVolume", "PersistentVolumeClaim",
               "Deployment", "StatefulSet", "CronJob", "PodDisruptionBudget"]  # fmt: skip
ORDER_LAST = ["MutatingWebhookConfiguration", "ValidatingWebhookConfiguration"]


class KustomizeError(ValueError):
    pass


def render(folder: Path) -> list[Doc]:
    """The objects that `kubectl kustomize folder` would print, in its order."""
    return sorted(_build(folder.resolve()), key=_order_key)


def _build(folder: Path) -> list[Doc]:
    kustomization = _load_kustomization(folder)
    docs: list[Doc] = []
    for entry in kustomization.get("resources", []):
        path = (folder / entry).resolve()
        docs += _build(path) if path.is_dir() else list(_load_docs(path))
    docs += _generate(folder, kustomization)
    for patch in kustomization.get("patches", []):
        _apply_patch(folder, patch, docs)
    if "namespace" in kustomization:
        for doc in docs:
            _set_namespace(doc, kustomization["namespace"])
    for label in kustomization.get("labels", []):
        _add_labels(label, docs)
    for image in kustomization.get("images", []):
        for doc in docs:
            _set_image(doc, image)
    return docs


def _load_kustomization(folder: Path) -> Doc:
    path = folder / "kustomization.yaml"
    if not path.is_file():
        raise KustomizeError(f"{folder} has no kustomization.yaml")
    kustomization = yaml.safe_load(path.read_text())
    unknown = set(kustomization) - ALLOWED_FIELDS
    if unknown:
        raise KustomizeError(f"{path}: fields this renderer does not implement: {sorted(unknown)}")
    if kustomization.get("kind") != "Kustomization":
        raise KustomizeError(f"{path}: kind must be Kustomization")
    return kustomization


def _load_docs(path: Path) -> Iterator[Doc]:
    for doc in yaml.safe_load_all(path.read_text()):
        if doc is not None:
            if not isinstance(doc, dict) or "kind" not in doc:
                raise KustomizeError(f"{path}: every document must be an object with a kind")
            yield doc


def _generate(folder: Path, kustomization: Doc) -> list[Doc]:
    generators = kustomization.get("configMapGenerator", [])
    if generators and not kustomization.get("generatorOptions", {}).get("disableNameSuffixHash"):
        raise KustomizeError(f"{folder}: configMapGenerator needs generatorOptions.disableNameSuffixHash: true here")
    docs = []
    for generator in generators:
        if set(generator) - {"name", "files"}:
            raise KustomizeError(f"{folder}: configMapGenerator supports name and files only")
        data = {Path(name).name: (folder / name).read_text() for name in generator["files"]}
        docs.append({"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": generator["name"]}, "data": data})
    return docs


def _apply_patch(folder: Path, patch: Doc, docs: list[Doc]) -> None:
    target = patch.get("target", {})
    if set(patch) - {"path", "target"} or set(target) - {"group", "version", "kind", "name"}:
        raise KustomizeError(f"{folder}: patches take a path and a target of group, version, kind, name")
    operations = yaml.safe_load((folder / patch["path"]).read_text())
    if not isinstance(operations, list):
        raise KustomizeError(f"{patch['path']}: only RFC 6902 JSON patches (a list of operations) are supported")
    matched = [doc for doc in docs if _matches(doc, target)]
    if not matched:
        raise KustomizeError(f"{patch['path']}: no resource matches {target}")
    for doc in matched:
        for operation in operations:
            json_patch(doc, operation)


def _matches(doc: Doc, target: Doc) -> bool:
    group, _, version = doc["apiVersion"].rpartition("/")
    wanted = {"group": group, "version": version, "kind": doc["kind"], "name": doc["metadata"]["name"]}
    return all(wanted[key] == value for key, value in target.items())


def json_patch(doc: Doc, operation: Doc) -> None:
    """One RFC 6902 operation (add, replace, remove) on `doc`, in place."""
    op, tokens = operation["op"], _pointer(operation["path"])
    parent = doc
    for token in tokens[:-1]:
        parent = parent[int(token)] if isinstance(parent, list) else parent[token]
    last = tokens[-1]
    if isinstance(parent, list):
        index = len(parent) if last == "-" else int(last)
        if op == "add":
            parent.insert(index, copy.deepcopy(operation["value"]))
        elif op == "replace":
            parent[index] = copy.deepcopy(operation["value"])
        elif op == "remove":
            del parent[index]
        else:
            raise KustomizeError(f"unsupported JSON patch operation {op!r}")
        return
    if op in ("add", "replace"):
        if op == "replace" and last not in parent:
            raise KustomizeError(f"replace of a missing member: {operation['path']}")
        parent[last] = copy.deepcopy(operation["value"])
    elif op == "remove":
        del parent[last]
    else:
        raise KustomizeError(f"unsupported JSON patch operation {op!r}")


def _pointer(path: str) -> list[str]:
    if not path.startswith("/"):
        raise KustomizeError(f"not a JSON pointer: {path!r}")
    return [token.replace("~1", "/").replace("~0", "~") for token in path[1:].split("/")]


def _set_namespace(doc: Doc, namespace: str) -> None:
    if doc["kind"] not in CLUSTER_SCOPED:
        doc["metadata"]["namespace"] = namespace
    if doc["kind"] in ("RoleBinding", "ClusterRoleBinding"):
        for subject in doc.get("subjects", []):
            if subject.get("kind") == "ServiceAccount" and subject.get("namespace") in (None, "default"):
                subject["namespace"] = namespace


def _add_labels(label: Doc, docs: list[Doc]) -> None:
    if set(label) - {"pairs", "includeSelectors", "includeTemplates"}:
        raise KustomizeError(f"labels entries take pairs, includeSelectors, includeTemplates: {label}")
    if label.get("includeSelectors") or label.get("includeTemplates"):
        raise KustomizeError("labels with includeSelectors or includeTemplates are not implemented")
    for doc in docs:
        doc["metadata"].setdefault("labels", {}).update(label["pairs"])


def _set_image(doc: Doc, image: Doc) -> None:
    if set(image) - {"name", "newName", "newTag"}:
        raise KustomizeError(f"images entries take name, newName, newTag: {image}")
    for container in pod_containers(doc):
        name, tag = _split_image(container["image"])
        if name == image["name"]:
            new_tag = image.get("newTag", tag)
            container["image"] = image.get("newName", name) + (f":{new_tag}" if new_tag else "")


def _split_image(reference: str) -> tuple[str, str | None]:
    slash = reference.rfind("/")
    colon = reference.rfind(":")
    if colon > slash:
        return reference[:colon], reference[colon + 1 :]
    return reference, None


def pod_spec(doc: Doc) -> Doc | None:
    """The pod spec of a workload (a Deployment's template), or None."""
    template = doc.get("spec", {}).get("template")
    return template.get("spec") if isinstance(template, dict) else None


def pod_containers(doc: Doc) -> list[Doc]:
    spec = pod_spec(doc)
    if spec is None:
        return []
    return list(spec.get("initContainers", [])) + list(spec.get("containers", []))


def _order_key(doc: Doc) -> tuple[int, str, str, str]:
    kind = doc["kind"]
    if kind in ORDER_FIRST:
        rank = ORDER_FIRST.index(kind)
    elif kind in ORDER_LAST:
        rank = len(ORDER_FIRST) + 1 + ORDER_LAST.index(kind)
    else:
        rank = len(ORDER_FIRST)
    metadata = doc["metadata"]
    return rank, kind, metadata.get("namespace", ""), metadata["name"]
