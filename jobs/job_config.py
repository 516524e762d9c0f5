"""JobConfig: one offline generation job, validated once at the edge (CLI flags, Ray job entrypoint).

The same JSON travels from `eaglectl submit-job` to the driver, whether the driver runs here or as
a Ray job on a cluster, so the config is plain data: paths are made absolute on the client and
nothing in it imports Ray or the engine. `generation_fingerprint()` is what a resumed run must
share with the run that wrote the existing output (same model, same sampling, same columns), so a
resume never mixes two different jobs' rows in one dataset.
"""
from __future__ import annotations

import glob as _glob
import os
import posixpath
from pathlib import Path
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, ValidationInfo, field_validator, model_validator

from cluster.config_base import MAX_COUNT
from cluster.config_sections import SpeculationConfig
from cluster.openai_requests import MAX_SEED, truncation_given
from eagle_worker.engine_api import draft_rules

JSONL_SUFFIXES = (".jsonl", ".ndjson")


def encodable(text: str) -> bool:
    """Whether `text` can be written as UTF-8 (a lone surrogate from a JSON escape or a file name's
    undecodable bytes cannot: no output could hold it)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


# A count or size beyond a 32-bit int is a typo, and would overflow where it meets arrays (the output's
# int32 token counts, the engine's tensors): refused with the field's name instead of failing every row.
Count = Annotated[int, Field(le=MAX_COUNT)]
RESOLVED = {"resolved": True}   # validation context of a config that already passed its edge (the driver's JSON)


class JobConfigError(ValueError):
    """A job that cannot run; the message says which setting and why."""


class JobConfig(BaseModel):
    # NaN and infinities (`--temperature inf`) are refused like any other out-of-range value
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    # what to read and where to write
    input: str
    output: str | None = Field(None, description="output folder; default `<input name>.out/` next to the input")
    format: Literal["auto", "parquet", "openai-batch"] = "auto"
    keep_columns: bool = False
    overwrite: bool = False
    retry_errors: bool = Field(False, description="run the committed error rows again (their ids), replacing them")

    # the model
    model: str = "gemma-3-270m"
    draft: str = Field("auto", description="'auto' (the hybrid with the model's built-in EAGLE head, or prompt "
                                           "lookup where it has none), 'default' (that head, required), "
                                           "'none' (no speculation), or a head folder")
    dtype: Literal["float32", "float16", "bfloat16"] = "float32"
    device: Literal["cpu", "cuda"] = "cpu"
    engine: str = Field("eagle_worker", description="module exposing LLMEngine/EngineConfig/SamplingParams")
    chat_template: str | None = None
    max_model_len: Count | None = Field(None, ge=16)
    enable_prefix_caching: bool = Field(True, description="reuse the KV cache of shared prompt prefixes; "
                                        "does not change outputs, so a resume may change it")
    speculation: SpeculationConfig | None = Field(None, description="EAGLE settings beyond `draft` (the serve "
                                                  "config's `speculation:`); omit for the default (the hybrid, "
                                                  "sized per step); does not change outputs, so a resume may change it")

    # sampling defaults (per-row columns override them)
    max_tokens: Count = Field(256, ge=1)
    temperature: float = Field(0.0, ge=0)
    top_p: float = Field(1.0, gt=0, le=1)
    top_k: Count = Field(-1, ge=-1)
    seed: int | None = Field(None, ge=0, lt=MAX_SEED, description="the engine's range: [0, 2**63)")
    stop: list[str] | None = None
    truncate_prompt_tokens: Count | None = Field(None, ge=-1, description="keep each prompt's last this many tokens "
                                               "(-1: as many as leave the context room for max_tokens); default: "
                                               "none, a prompt beyond the context is an error row")

    # execution: own replicas, or a running Serve app (jobs/app_pool.py)
    serve_app: str | None = Field(None, min_length=1, description="send rows to this running Serve application "
                                  "(`eaglectl serve`'s app name) instead of starting replicas; the app's engine "
                                  "settings (model, dtype, draft, context) are the job's")
    replicas: Count = Field(1, ge=1)
    tp_size: Count = Field(1, ge=1)
    cpus_per_replica: float | None = Field(None, gt=0, description="default: the CPUs of the cluster split evenly")
    max_num_seqs: Count = Field(64, ge=1)
    max_in_flight: Count | None = Field(None, ge=1, description="rows sent to one replica at once; default a batch "
                                        "plus a quarter")
    min_ready_replicas: Count = Field(1, ge=1, description="replicas loaded before rows are sent (benchmarks: all)")
    max_row_retries: Count = Field(1, ge=0, description="re-runs of a row whose replica died, then an error row")
    max_replica_restarts: Count | None = Field(None, ge=0, description="default: 2 per replica + 2")
    startup_timeout_s: float = Field(900.0, gt=0)
    step_timeout_s: float | None = Field(300.0, gt=0, le=86400.0, description="an engine step running longer "
                                         "(hung) ends its replica, which is replaced and its rows sent again; "
                                         "null: never")

    engine_from_app: bool = Field(False, description="internal: model/dtype/draft/... were filled in from "
                                  "the serve app's engine config (jobs/app_pool.py), not given")

    # committing output
    rows_per_file: Count = Field(10_000, ge=1)
    row_group_rows: Count = Field(1_000, ge=1)
    commit_interval_s: float = Field(30.0, gt=0, description="a file is committed at least this often")
    read_batch_rows: Count = Field(256, ge=1)
    log_interval_s: float = Field(10.0, gt=0)

    @field_validator("input", "output")
    @classmethod
    def _location(cls, v):
        if v is not None and "://" in v and v.split("://", 1)[0].lower() not in ("s3", "gs", "gcs"):
            raise ValueError(f"{v}: only local paths and s3://, gs:// URIs are supported")
        if v is not None and not encodable(v):   # a shell's undecodable bytes: no file system call could take it
            raise ValueError(f"{v.encode('utf-8', 'backslashreplace').decode()}: not valid UTF-8; name the "
                             "folder in UTF-8")
        return v

    _truncation = field_validator("truncate_prompt_tokens")(truncation_given)

    @field_validator("stop", mode="before")
    @classmethod
    def _stop_list(cls, v):
        if isinstance(v, str):
            v = [v]
        if isinstance(v, list) and "" in v:
            raise ValueError("stop must not hold an empty string (it would match at once; leave stop out for none)")
        return v or None

    @model_validator(mode="after")
    def _consistent(self, info: ValidationInfo) -> "JobConfig":
        if self.row_group_rows > self.rows_per_file:
            self.row_group_rows = self.rows_per_file
        if self.output is not None and same_place(self.output, self.input):
            raise ValueError(f"output {self.output} is the input itself; the output is a folder beside it "
                             "(leave output out for `<input>.out`)")
        if self.max_model_len is not None and self.max_tokens >= self.max_model_len:
            raise ValueError(f"max_tokens ({self.max_tokens}) must be < max_model_len ({self.max_model_len})")
        if self.speculation is not None and self.draft == "none":
            raise ValueError("--draft none turns speculation off: drop --speculation, or pick a draft "
                             "(auto, default or a head folder)")
        # what the user GAVE, even at its default value (`--model gemma-3-270m` is refused too); the driver's
        # JSON (context RESOLVED) holds every field, and its client checked this already
        if self.serve_app is not None and not self.engine_from_app and not (info.context or {}).get("resolved"):
            own = [flag for field, flag in OWN_REPLICA_FLAGS.items() if field in self.model_fields_set]
            if own:
                one = len(own) == 1
                raise ValueError(f"--serve-app {self.serve_app}: {', '.join(own)} only appl{'ies' if one else 'y'} "
                                 "to a job's own replicas; the app's engine settings are used (drop "
                                 f"{'it' if one else 'them'}, or drop --serve-app)")
        return self

    # ---- derived values --------------------------------------------------------------------
    @property
    def in_flight_per_replica(self) -> int:
        """A full batch plus a quarter queued: a replica does not wait for the driver between two
        steps (the driver answers a finished row within milliseconds), while a row does not wait
        in the engine's queue behind a whole batch (its `ttft_s` is then its own prefill, not the
        batch ahead of it, and fewer rows are in flight to send again if a replica dies)."""
        return self.max_in_flight or self.max_num_seqs + max(4, self.max_num_seqs // 4)

    @property
    def replica_restarts(self) -> int:
        # enough that a row which crashes engines (killing max_row_retries + 1 replicas) ends as an
        # error row instead of ending the job
        return 2 * self.replicas + 2 if self.max_replica_restarts is None else self.max_replica_restarts

    def input_is_jsonl(self) -> bool:
        return self.input.lower().endswith(JSONL_SUFFIXES)

    def output_format(self, kind: str | None = None) -> str:
        """`auto`: OpenAI Batch output for JSONL input, else Parquet. `kind` is the opened input's
        ("jsonl" for a folder or glob of JSONL files too); without it, the input's name decides."""
        if self.format != "auto":
            return self.format
        jsonl = kind == "jsonl" if kind else self.input_is_jsonl()
        return "openai-batch" if jsonl else "parquet"

    def resolved_draft(self) -> str | None:
        """None (plain decoding), or what the engine's `EngineConfig.draft` gets: the engine's one
        rule for draft settings (`auto`: the model's built-in head if it ships one)."""
        choose, _ = draft_rules(self.engine)
        return choose(self.draft, self.model)

    def generation_fingerprint(self) -> dict:
        """Settings that change what a row's output is; a resume must match them. `serve_app` too: a
        job through an app resumes through the same app (None, own replicas, matches older manifests)."""
        return {k: getattr(self, k) for k in ("model", "dtype", "engine", "chat_template", "max_model_len",
                                              "max_tokens", "temperature", "top_p", "top_k", "seed", "stop",
                                              "truncate_prompt_tokens", "keep_columns", "serve_app")} | {
            "draft": self.resolved_draft(), "format": self.output_format()}

    def with_app_engine(self, engine: dict) -> "JobConfig":
        """This job with the serve app's engine settings (AppClient.engine_config()) as its own, so the
        manifest records them and a resume compares them: an app now serving another model, dtype or
        draft is refused like a changed flag."""
        update = {k: engine.get(k, getattr(self, k)) for k in ("model", "dtype", "engine", "chat_template",
                                                                 "max_model_len", "device", "tp_size")}
        draft = engine.get("draft", "none")
        update["draft"] = "none" if draft in (None, "none") else str(draft)
        if "enable_prefix_caching" in engine:
            update["enable_prefix_caching"] = bool(engine["enable_prefix_caching"])
        return self.model_copy(update={**{k: v for k, v in update.items() if v is not None}, "engine_from_app": True})

    def absolute(self) -> "JobConfig":
        """Paths made absolute and the default output filled in (before shipping to a cluster)."""
        inp = _absolute(self.input)
        try:
            out = _absolute(self.output or default_output(inp))
        except ValueError as e:
            raise JobConfigError(str(e)) from None
        update = {"input": inp, "output": out}
        if self.draft not in ("auto", "none", "default"):
            update["draft"] = os.path.abspath(os.path.expanduser(self.draft))
        return self.model_copy(update=update)

    @classmethod
    def from_options(cls, **kwargs) -> "JobConfig":
        """Build from the CLI options the user gave (None = use the default; a value given is given even when
        it equals the default: `--serve-app` refuses own-replica flags by that), raising JobConfigError with
        field names."""
        try:
            return cls(**{k: v for k, v in kwargs.items() if v is not None})
        except ValidationError as e:
            lines = [f"{'.'.join(map(str, err['loc'])) or 'config'}: {err['msg'].removeprefix('Value error, ')}"
                     for err in e.errors()]
            raise JobConfigError("invalid job settings:\n  " + "\n  ".join(lines)) from None


# JobConfig fields that describe a job's own replicas -> the flag that sets them (refused with --serve-app)
OWN_REPLICA_FLAGS: dict[str, str] = {
    "model": "--model", "draft": "--draft", "dtype": "--dtype", "device": "--device", "engine": "--engine",
    "chat_template": "chat_template", "max_model_len": "--max-model-len", "replicas": "--replicas",
    "tp_size": "--tp-size", "cpus_per_replica": "--cpus-per-replica", "max_num_seqs": "--max-num-seqs",
    "min_ready_replicas": "--min-ready-replicas", "max_replica_restarts": "max_replica_restarts",
    "step_timeout_s": "step_timeout_s",
    "enable_prefix_caching": "--enable-prefix-caching/--no-enable-prefix-caching", "speculation": "--speculation",
}

# The `submit-job` command line (declared with click in eaglectl/jobs.py; tests/jobs/test_input_reader.py
# keeps the two equal) as data: flag -> whether it takes a value. The KubeRay renderer checks the RayJob
# entrypoints it writes against it, so deploy/ needs no CLI to know what submit-job accepts.
SUBMIT_JOB_FLAGS: dict[str, bool] = {
    "--output": True, "-o": True, "--format": True, "--model": True, "--draft": True, "--dtype": True,
    "--device": True, "--max-tokens": True, "--temperature": True, "--top-p": True, "--top-k": True,
    "--seed": True, "--stop": True, "--truncate-prompt-tokens": True, "--max-model-len": True, "--replicas": True,
    "--tp-size": True,
    "--cpus-per-replica": True, "--max-num-seqs": True, "--max-in-flight": True, "--min-ready-replicas": True,
    "--keep-columns": False, "--overwrite": False, "--retry-errors": False,
    "--enable-prefix-caching": False, "--no-enable-prefix-caching": False, "--rows-per-file": True, "--commit-interval": True,
    "--speculation": True, "--engine": True, "--serve-app": True, "--address": True, "--job-id": True,
    "--wait": False, "--no-wait": False,
}


def submit_job_args_error(args: list[str]) -> str | None:
    """None when `submit-job ARGS` has one INPUT and only known flags, each with its value; else why
    not (in click's words). Values are not checked here: the job config validates them on the cluster."""
    positional, i, only_args = [], 0, False
    while i < len(args):
        a = args[i]
        i += 1
        if only_args or not a.startswith("-") or a == "-":
            positional.append(a)
        elif a == "--":
            only_args = True
        else:
            name, eq, _ = a.partition("=")
            if name not in SUBMIT_JOB_FLAGS:
                return f"No such option: {name}"
            if not SUBMIT_JOB_FLAGS[name] and eq:
                return f"Option '{name}' does not take a value."
            if SUBMIT_JOB_FLAGS[name] and not eq:
                if i >= len(args):
                    return f"Option '{name}' requires an argument."
                i += 1
    if not positional:
        return "Missing argument 'INPUT'."
    if len(positional) > 1:
        return f"Got unexpected extra argument ({' '.join(positional[1:])})"
    return None


def _is_glob(path: str) -> bool:
    return _glob.has_magic(path)


def is_local_glob(path: str) -> bool:
    """A local pattern: wildcards (`*`, `?`, `[`), and no file or folder of that very name
    (`my data [v2].parquet` is a file)."""
    return _is_glob(path) and not os.path.lexists(os.path.expanduser(path))


def glob_base(pattern: str) -> Path:
    """The folder a glob is rooted at: its longest prefix without wildcards."""
    parts = Path(pattern).parts
    base = []
    for p in parts:
        if _glob.has_magic(p):
            break
        base.append(p)
    return Path(*base) if base else Path(".")


def _absolute(path: str) -> str:
    if "://" in path:
        return path
    return os.path.abspath(os.path.expanduser(path))


def same_place(a: str, b: str) -> bool:
    """The same path or URI as written (`./x.parquet` and `x.parquet`; s3://b/k and s3://b//k/)."""
    def norm(v: str) -> str:
        scheme, sep, rest = v.partition("://")
        return (scheme.lower() + "://" + posixpath.normpath(rest)) if sep else os.path.normpath(os.path.expanduser(v))
    return norm(a) == norm(b)


def default_output(input_path: str) -> str:
    """Beside the input, never inside what it reads: `data/prompts.parquet` -> `data/prompts.out`;
    a folder `data/x/` -> `data/x.out`; a glob `data/x/*.parquet` -> `data/x.glob-<hash of the pattern>.out`
    (two globs over one folder get two outputs); a name with wildcards that exists is that file or folder.
    Same rules for `s3://`/`gs://` URIs."""
    if "://" in input_path:
        scheme, rest = input_path.split("://", 1)
        rest = rest.rstrip("/")
        if "/" not in rest:
            raise ValueError(f"{input_path}: a whole bucket as input needs --output")
        if _is_glob(rest) and _bucket_glob(input_path):
            base = str(glob_base(rest))
            if "/" not in base:
                raise ValueError(f"{input_path}: a glob at the top of a bucket needs --output")
            return f"{scheme}://{base}.glob-{_pattern_hash(rest)}.out"
        head, name = rest.rsplit("/", 1)
        stem = name.rsplit(".", 1)[0] if name.lower().endswith((".parquet",) + JSONL_SUFFIXES) else name
        return f"{scheme}://{head}/{stem}.out"
    if is_local_glob(input_path):
        base = glob_base(input_path)
        return str(base.parent / f"{base.name}.glob-{_pattern_hash(input_path)}.out")
    p = Path(input_path)
    if p.is_dir():
        return str(p.parent / f"{p.name}.out")
    return str(p.parent / f"{p.stem}.out")


def _bucket_glob(uri: str) -> bool:
    """`input_files.is_bucket_glob`, asked of the store; a store this machine cannot ask (the cluster
    has the credentials) names the output as for a pattern."""
    from jobs.input_files import filesystem, is_bucket_glob  # here only: the config is plain data
    from jobs.storage import StorageError

    try:
        return is_bucket_glob(*filesystem(uri))
    except (StorageError, OSError):
        return True


def _pattern_hash(pattern: str) -> str:
    import hashlib

    return hashlib.blake2b(pattern.encode(), digest_size=4).hexdigest()


def builtin_head_error(engine_module: str, model: str, draft: str = "default") -> str | None:
    """None when the engine can use `draft` ("default": the head shipped for a built-in model) with
    `model`, else why not. Asks the engine's own resolver (light: no torch import)."""
    try:
        _, resolve = draft_rules(engine_module)
        resolve(draft, model)
    except ImportError as e:
        return f"the engine `{engine_module}` cannot be imported: {e}"
    except ValueError as e:
        return str(e)
    return None
