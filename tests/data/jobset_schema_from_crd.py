"""Derive tests/data/jobset-v1alpha2.schema.json from JobSet's CustomResourceDefinition.

No package registry ships a JSON schema of JobSet (jobset.x-k8s.io), so the manifests' test
(tests/unit/test_kubernetes_manifests.py) checks JobSet's own fields against this derivation of the upstream
CRD, and validates every embedded Job template with kubernetes-validate instead. Run it again when the
manifests move to a newer JobSet release:

    git clone --branch v0.12.0 https://github.com/kubernetes-sigs/jobset
    python tests/data/jobset_schema_from_crd.py \\
        jobset/config/components/crd/bases/jobset.x-k8s.io_jobsets.yaml v0.12.0 COMMIT

What the derivation does to the CRD's ``openAPIV3Schema`` (and nothing else):

- ``apiVersion`` and ``kind`` are pinned to the CRD's group/version and kind, and required with ``spec``;
- ``status`` is dropped (a manifest never sets it);
- every object with listed properties refuses unknown fields (``additionalProperties: false``), as
  kubernetes-validate's strict schemas do and as the API server's pruning would silently do;
- ``replicatedJobs[].template`` (a batch/v1 JobTemplateSpec, 800 KB of inlined pod schema) and
  ``volumeClaimPolicies[].templates[]`` (PersistentVolumeClaims) become plain objects: the test validates
  them with kubernetes-validate, wrapped as a Job and as a PersistentVolumeClaim;
- the ``x-kubernetes-*`` annotations go (not JSON Schema): list semantics and CEL rules (immutability,
  startupPolicy versus dependsOn) are the API server's to check, not this schema's.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import yaml  # type: ignore[import-untyped]  # no stubs in the test extra; safe_load only

HERE = Path(__file__).resolve().parent
OUT = HERE / "jobset-v1alpha2.schema.json"
CRD_PATH = "config/components/crd/bases/jobset.x-k8s.io_jobsets.yaml"


def _strip(node: Any) -> Any:
    """``node`` without ``x-kubernetes-*`` keys, objects with properties closed to unknown fields."""
    if isinstance(node, list):
        return [_strip(item) for item in node]
    if not isinstance(node, dict):
        return node
    out = {key: _strip(value) for key, value in node.items() if not key.startswith("x-kubernetes-")}
    preserve = node.get("x-kubernetes-preserve-unknown-fields") is True
    if "properties" in out and "additionalProperties" not in out and not preserve:
        out["additionalProperties"] = False
    return out


def derive(crd: dict[str, Any], tag: str, commit: str) -> dict[str, Any]:
    """The JSON schema (draft 2020-12) of the CRD's one served version, see the module doc."""
    version = next(v for v in crd["spec"]["versions"] if v.get("served", True))
    group, kind = crd["spec"]["group"], crd["spec"]["names"]["kind"]
    root = dict(version["schema"]["openAPIV3Schema"])
    props = dict(root["properties"])
    props.pop("status", None)
    props["apiVersion"] = {**props["apiVersion"], "const": f"{group}/{version['name']}"}
    props["kind"] = {**props["kind"], "const": kind}
    spec = json.loads(json.dumps(props["spec"]))
    job = spec["properties"]["replicatedJobs"]["items"]["properties"]
    job["template"] = {
        "type": "object",
        "description": "A batch/v1 JobTemplateSpec: validated as a Job by kubernetes-validate (strict).",
    }
    if "volumeClaimPolicies" in spec["properties"]:  # since JobSet v0.11
        claims = spec["properties"]["volumeClaimPolicies"]["items"]["properties"]["templates"]
        claims["items"] = {
            "type": "object",
            "description": "A PersistentVolumeClaim: validated as one by kubernetes-validate (strict).",
        }
    props["spec"] = spec
    root["properties"] = props
    root["required"] = ["apiVersion", "kind", "spec"]
    schema = _strip(root)
    source = f"https://github.com/kubernetes-sigs/jobset/blob/{tag}/{CRD_PATH}"
    return {
        "$schema": "https://json-schema.org/draft/2020-12/schema",
        "$comment": (
            f"JobSet {group}/{version['name']}, derived from {source} (commit {commit}) by "
            "tests/data/jobset_schema_from_crd.py: see its docstring for what was changed."
        ),
        "x-source": {
            "repository": "https://github.com/kubernetes-sigs/jobset",
            "release": tag,
            "commit": commit,
            "path": CRD_PATH,
            "apiVersion": f"{group}/{version['name']}",
        },
        **schema,
    }


def main(argv: list[str]) -> int:
    if len(argv) != 3:
        sys.stderr.write("usage: jobset_schema_from_crd.py CRD_YAML RELEASE_TAG COMMIT\n")
        return 2
    crd = yaml.safe_load(Path(argv[0]).read_text(encoding="utf-8"))
    schema = derive(crd, argv[1], argv[2])
    OUT.write_text(json.dumps(schema, indent=1, sort_keys=True) + "\n", encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
