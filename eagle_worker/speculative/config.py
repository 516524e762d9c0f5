"""How to speculate: which head, which tree, how big, and whether the budget adapts to load."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from eagle_worker.sampling_params import is_int

TREES = ("dynamic", "static", "chain")
# Largest tree sizes accepted (EAGLE-2's published tree is 60 nodes, depth 6, top-k 10): beyond these a
# step's tree only costs, and a mistyped 10**9 would hang the step or fill memory instead of failing.
SPEC_LIMITS = {"depth": 32, "top_k": 64, "num_draft_tokens": 256, "lookup_max_tokens": 64, "lookup_max_branches": 16}
HEAD_DTYPES = ("target", "auto", "float32", "bfloat16", "float16")


@dataclass
class SpecConfig:
    """The defaults are the default method: the hybrid (lookup merged with the head's tree), sized
    per sequence and step (hybrid.py); `lookup=False` is the head alone, `draft=None` lookup alone."""

    draft: str | None = None            # head folder, "default" (the built-in head of a built-in model), None
    method: str | None = None           # "eagle" (EAGLE-1/2) | "eagle3"; None: whatever the checkpoint is
    tree: str = "dynamic"               # EAGLE-2 dynamic tree, EAGLE-1 static tree, or a chain
    depth: int = 5                      # draft levels (chain length for "chain")
    top_k: int = 8                      # dynamic: nodes expanded per level, children per node
    num_draft_tokens: int = 16          # tree nodes verified per step, root excluded
    static_choices: list[list[int]] | None = None   # static tree paths; default EAGLE-1's 25-node tree
    adaptive: bool = True               # size each step's trees from measured costs (False: always the full tree)
    lookup: bool = True                 # also propose prompt-lookup continuations, merged into the tree
    lookup_ngram: tuple[int, int] = (2, 5)   # n-gram lengths matched, longest first
    lookup_max_tokens: int = 8          # tokens per lookup branch
    lookup_max_branches: int = 3        # matches (branches) per step
    head_dtype: str = "target"          # the head's weights and KV: the target's dtype, "auto" (bfloat16 under a
                                        # float32 target where the device has bf16 arithmetic), or a dtype

    def __post_init__(self) -> None:
        for name in ("adaptive", "lookup"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"SpecConfig.{name} must be true or false, got {getattr(self, name)!r}")
        if self.draft is not None and not isinstance(self.draft, str):
            raise ValueError(f"SpecConfig.draft must be a head folder, 'default' or None, got {self.draft!r}")
        if self.draft is None and not self.lookup:
            raise ValueError("SpecConfig needs a draft head (draft=...) or lookup=True")
        ngram = self.lookup_ngram
        if not (isinstance(ngram, (list, tuple)) and len(ngram) == 2 and all(is_int(n) for n in ngram)
                and 1 <= ngram[0] <= ngram[1] <= 64):
            raise ValueError(f"SpecConfig.lookup_ngram must be (min, max) with 1 <= min <= max <= 64, got {ngram!r}")
        self.lookup_ngram = tuple(ngram)
        choices = self.static_choices
        if choices is not None and not (isinstance(choices, (list, tuple)) and choices and all(
                isinstance(c, (list, tuple)) and all(is_int(i) for i in c) for c in choices)):
            raise ValueError(f"SpecConfig.static_choices must be a non-empty list of paths (lists of child indices), "
                             f"got {choices!r}"[:300])
        if self.head_dtype not in HEAD_DTYPES:
            raise ValueError(f"SpecConfig.head_dtype must be one of {HEAD_DTYPES}, got {self.head_dtype!r}")
        if self.method not in (None, "eagle", "eagle3"):
            raise ValueError(f"SpecConfig.method must be 'eagle' or 'eagle3', got {self.method!r}")
        if self.tree not in TREES:
            raise ValueError(f"SpecConfig.tree must be one of {TREES}, got {self.tree!r}")
        for name, most in SPEC_LIMITS.items():
            value = getattr(self, name)
            if not (is_int(value) and 1 <= value <= most):
                raise ValueError(f"SpecConfig.{name} must be an integer from 1 to {most}, got {value!r}")


HEADS_DIR = Path(__file__).resolve().parent.parent / "heads"


def has_builtin_head(model: str) -> bool:
    """Only built-in model names (not paths or hub ids) have heads shipped with the package."""
    if not model or "/" in model or "\\" in model or Path(model).exists():
        return False
    return (HEADS_DIR / model / "config.json").exists()


def choose_draft(draft: str | None, model: str) -> str | None:
    """The one rule for a `draft` setting, whatever reads it (the engine, the serve and job configs,
    the KubeRay renderer): None, "" and "none" mean no head; "auto" means the model's built-in head
    ("default") when it ships one, else none; anything else stays as given. The same on every
    tensor-parallel size: the head runs beside a TP target too."""
    if draft in (None, "", "none"):
        return None
    if draft == "auto":
        return "default" if has_builtin_head(model) else None
    return draft


def default_spec(draft: str | None, model: str) -> SpecConfig | None:
    """The speculation a `draft` setting gets, on every front door (`LLM()`, `eaglectl generate`,
    `eaglectl serve`, `submit-job`): None, "" and "none" turn it off; anything else gets the fastest
    lossless method for the model: the hybrid with the head `choose_draft` names, or prompt lookup
    alone where the model has no head (measured in `eaglectl bench spec --batch-sizes`)."""
    if draft in (None, "", "none"):
        return None
    return SpecConfig(draft=choose_draft(draft, model))


def resolve_draft(draft: str | None, model: str) -> str | None:
    """A head folder for `draft`: a path as is, or "default": the head shipped for a built-in model."""
    if draft is None:
        return None
    if draft != "default":
        if not Path(draft).is_dir():
            raise ValueError(f"draft head {draft!r} is not a folder (expected config.json + weights)")
        return draft
    shipped = HEADS_DIR / model
    if not has_builtin_head(model):
        raise ValueError(f"model {model!r} has no built-in draft head; pass draft=PATH or draft=None")
    return str(shipped)
