"""Re-create k8s-v1.33-strict.json: the strict JSON schemas of the core Kubernetes kinds the renderer
emits (Service, PodDisruptionBudget), with just the definitions they reference, descriptions dropped.

Source: the `kubernetes-validate` wheel (PyPI, Apache-2.0), folder
`kubernetes_validate/kubernetes-json-schema/v1.33.0-local-strict/` (generated from the Kubernetes
OpenAPI spec, Apache-2.0). Usage: python make_k8s_bundle.py PATH/TO/v1.33.0-local-strict
"""
import json
import sys
from pathlib import Path

KINDS = {"v1/Service": "service-v1.json", "policy/v1/PodDisruptionBudget": "poddisruptionbudget-policy-v1.json"}
PREFIX = "/api/_definitions.json#/$defs/"


def main(src: Path) -> None:
    defs = json.loads((src / "_definitions.json").read_text())["$defs"]
    out_defs: dict = {}

    def clean(node):
        if isinstance(node, dict):
            node = {k: clean(v) for k, v in node.items() if k != "description"}
            ref = node.get("$ref")
            if isinstance(ref, str) and ref.startswith((PREFIX, "#/$defs/")):
                name = ref.rsplit("/", 1)[1]
                node["$ref"] = "#/$defs/" + name
                if name not in out_defs:
                    out_defs[name] = None
                    out_defs[name] = clean(defs[name])
            return node
        if isinstance(node, list):
            return [clean(v) for v in node]
        return node

    kinds = {key: clean(json.loads((src / f).read_text())) for key, f in KINDS.items()}
    bundle = {"source": "kubernetes-validate (PyPI) kubernetes-json-schema/v1.33.0-local-strict, Apache-2.0",
              "kinds": kinds, "$defs": dict(sorted(out_defs.items()))}
    (Path(__file__).parent / "k8s-v1.33-strict.json").write_text(json.dumps(bundle, indent=1, sort_keys=False) + "\n")


if __name__ == "__main__":
    main(Path(sys.argv[1]))
